"""Configuration precedence (file < environment < flags) and the CLI's error handling."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from kvplane.cli import build_parser, main
from kvplane.core.config import load_settings
from kvplane.core.flags import settings_from_args
from kvplane.core.worker_credentials import worker_token


def write_config(tmp_path: Path) -> Path:
    path = tmp_path / "kvplane.toml"
    path.write_text(
        '[index]\nbackend = "redis"\nmax_entries = 5\n'
        "[http]\nport = 9000\n"
        '[control_plane]\nagent_token = "from-file"\n'
    )
    return path


def test_defaults_run_one_router_with_nothing_else() -> None:
    settings = load_settings()
    assert settings.index.backend == "memory"
    assert (settings.http.host, settings.control_plane.grpc_host) == ("127.0.0.1", "127.0.0.1")
    assert settings.control_plane.agent_token is None


def test_environment_beats_file_and_flags_beat_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_config(tmp_path)
    monkeypatch.setenv("KVPLANE_HTTP__PORT", "9001")
    monkeypatch.setenv("KVPLANE_INDEX__MAX_ENTRIES", "6")

    settings = load_settings(path, {"index": {"max_entries": 7}})

    assert settings.index.backend == "redis"  # file only
    assert settings.http.port == 9001  # environment over file
    assert settings.index.max_entries == 7  # flag over environment
    token = settings.control_plane.agent_token
    assert token is not None
    assert token.get_secret_value() == "from-file"
    assert "from-file" not in repr(settings)  # secrets stay out of logs


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["router", "--http-port", "99999"], "http.port: Input should be less than or equal"),
        (["router", "--config", "/nonexistent/kvplane.toml"], "does not exist"),
        (["router", "--index", "sqlite"], "invalid choice"),
    ],
)
def test_bad_configuration_is_one_clear_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code != 0
    error = capsys.readouterr().err
    assert message in error
    assert "Traceback" not in error


def test_unknown_setting_in_a_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "typo.toml"
    path.write_text("[index]\nbakend = 'redis'\n")
    with pytest.raises(SystemExit):
        main(["router", "--config", str(path)])
    assert "index.bakend" in capsys.readouterr().err


def test_router_flags_land_in_their_settings(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "router",
            "--http-host",
            "0.0.0.0",
            "--tokenizer",
            str(tmp_path),
            "--tenants-file",
            str(tmp_path / "tenants.toml"),
            "--otlp-endpoint",
            "http://collector:4318/v1/traces",
            "--policy",
            "round-robin",
        ]
    )
    settings = settings_from_args(args)
    assert settings.http.host == "0.0.0.0"
    assert settings.proxy.tokenizer_dir == tmp_path
    assert settings.tenants.tenants_file == tmp_path / "tenants.toml"
    assert settings.tracing.otlp_endpoint == "http://collector:4318/v1/traces"
    assert settings.scoring.policy == "round-robin"


def test_a_dedicated_tenant_without_a_pool_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text("[[tenants.tenants]]\nname = 'acme'\nisolation = 'dedicated'\n")
    with pytest.raises(SystemExit):
        main(["router", "--config", str(path)])
    assert "the dedicated class needs a pool" in capsys.readouterr().err


def test_tenants_that_do_not_hold_together_are_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("[[tenants]]\nname = 'acme'\n[[tenants]]\nname = 'acme'\n")
    with pytest.raises(SystemExit) as exited:
        main(["router", "--http-port", "0", "--grpc-port", "0", "--tenants-file", str(tenants)])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "tenant names must be distinct" in error
    assert "Traceback" not in error


def test_a_missing_tokenizer_directory_fails_the_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-tokenizer"
    with pytest.raises(SystemExit) as exited:
        main(["router", "--http-port", "0", "--grpc-port", "0", "--tokenizer", str(missing)])
    assert exited.value.code == 1
    assert f"no tokenizer directory at {missing}" in capsys.readouterr().err


def test_worker_token_prints_the_token_the_router_verifies(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    secret = "s" * 40
    monkeypatch.setenv("KVPLANE_CONTROL_PLANE__WORKER_CREDENTIAL_SECRET", secret)
    assert main(["worker-token", "--worker-id", "pod-7"]) == 0
    assert capsys.readouterr().out.strip() == worker_token(secret, "pod-7")
    # Written to a file, it is what an agent's agent_token_file reads.
    written = tmp_path / "worker-token"
    assert main(["worker-token", "--worker-id", "pod-7", "--output", str(written)]) == 0
    assert written.stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv("KVPLANE_CONTROL_PLANE__AGENT_TOKEN_FILE", str(written))
    agent_token = load_settings().control_plane.agent_token
    assert agent_token is not None
    assert agent_token.get_secret_value() == worker_token(secret, "pod-7")
    monkeypatch.setenv("KVPLANE_CONTROL_PLANE__AGENT_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValidationError, match="cannot be read"):
        load_settings()
    monkeypatch.delenv("KVPLANE_CONTROL_PLANE__AGENT_TOKEN_FILE")
    monkeypatch.delenv("KVPLANE_CONTROL_PLANE__WORKER_CREDENTIAL_SECRET")
    with pytest.raises(SystemExit) as refused:
        main(["worker-token", "--worker-id", "pod-7"])
    assert refused.value.code == 2
    assert "worker_credential_secret" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "127.0.0.1:6379"])
def test_a_redis_url_of_another_scheme_is_one_line_of_invalid_configuration(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["router", "--index", "redis", "--redis-url", url, "--http-port", "0"])
    assert refused.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert "index.redis_url" in error
    assert "redis://" in error
