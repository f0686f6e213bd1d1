"""`kvplane demo` end to end, in process: both policies run and the table is printed,
through the router's proxy and (`--route envoy`) through a real Envoy."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from simulations import local_envoy
from simulations.demo import REQUESTS, RunResult, render_table, run_demo
from tests import heavy


@pytest.mark.slow
async def test_demo_runs_both_policies_and_kvplane_hits_more(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert await run_demo() == 0

    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "round-robin" in line and "kvplane" in line)
    assert header.split() == ["kvplane", "round-robin"]
    hit_line = next(line for line in out.splitlines() if line.startswith("cache hit rate"))
    kvplane_rate, round_robin_rate = (float(v) for v in re.findall(r"([\d.]+)%", hit_line))
    assert kvplane_rate > round_robin_rate
    failed = next(line for line in out.splitlines() if line.startswith("failed requests"))
    assert failed.split()[-2:] == ["0", "0"]
    assert "demo finished" in out
    # Each policy's fleet was proven wired before anything was measured on it.
    assert out.count("wiring checked: 3 workers, no check failed") == 2


def test_the_table_lines_up() -> None:
    first, second = RunResult("kvplane"), RunResult("round-robin")
    first.per_worker["worker-1"] = 3
    second.per_worker["worker-2"] = 12
    lines = render_table([first, second]).splitlines()
    assert len({len(line) for line in lines}) == 1  # every row as wide as the header
    assert any(line.startswith("requests on worker-2") for line in lines)


@pytest.mark.heavy("envoy")
async def test_the_demo_through_envoy_and_kvplane_hits_more(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    envoy = heavy.envoy_binary()
    temporary = tmp_path / "tmp"  # where the demo's temporary directory goes
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))

    assert await run_demo(route="envoy", envoy=envoy) == 0

    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(line for line in lines if "round-robin" in line and "kvplane" in line)
    assert re.split(r"\s{2,}", header.strip()) == ["kvplane via Envoy", "round-robin via Envoy"]
    hit_line = next(line for line in lines if line.startswith("cache hit rate"))
    kvplane_rate, round_robin_rate = (float(v) for v in re.findall(r"([\d.]+)%", hit_line))
    assert kvplane_rate > round_robin_rate
    failed = next(line for line in lines if line.startswith("failed requests"))
    assert failed.split()[-2:] == ["0", "0"]
    # Envoy's own count of what each worker served accounts for every request.
    served = [line.split()[-2:] for line in lines if line.startswith("requests on worker-")]
    assert len(served) == 3
    assert [sum(int(row[column]) for row in served) for column in (0, 1)] == [REQUESTS] * 2
    # The caption says what the round-robin column is.
    assert "router on --policy round-robin" in out
    assert "demo finished" in out
    assert out.count("wiring checked: 3 workers, no check failed") == 2
    assert out.count("Envoy ready, its picker healthy") == 2
    # Envoy's config and log went with their temporary directory, Envoy with them.
    assert not list(temporary.iterdir())
    assert not _processes_naming(str(temporary))


def test_without_envoy_the_demo_says_make_envoy_env_and_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "envoy"
    entry = "import sys; from kvplane.cli import main; sys.exit(main())"
    finished = subprocess.run(
        [sys.executable, "-c", entry, "demo", "--route", "envoy", "--envoy", str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert finished.returncode == 2
    assert "make envoy-env" in finished.stderr
    assert str(missing) in finished.stderr
    assert "Traceback" not in finished.stderr
    assert finished.stdout == ""  # nothing was started


def test_envoy_is_looked_for_in_envoy_env_then_on_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_envoy, "ENVOY_ENV", tmp_path / "venv" / "bin" / "envoy")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(local_envoy.EnvoyMissing, match="make envoy-env"):
        local_envoy.find_envoy()

    on_path = tmp_path / "bin" / "envoy"
    on_path.parent.mkdir()
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    assert local_envoy.find_envoy() == on_path

    local_envoy.ENVOY_ENV.parent.mkdir(parents=True)
    local_envoy.ENVOY_ENV.write_text("#!/bin/sh\n")
    local_envoy.ENVOY_ENV.chmod(0o755)
    assert local_envoy.find_envoy() == local_envoy.ENVOY_ENV


def _processes_naming(text: str) -> list[str]:
    """The command lines of running processes that contain `text`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in command:
            found.append(command)
    return found
