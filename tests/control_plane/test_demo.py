"""`kvplane demo` end to end, in process."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from kvplane.config import ControlPlaneSettings, Settings
from router.demo import run_demo


@pytest.mark.parametrize("token", [None, "demo-token"], ids=["open", "token"])
async def test_demo_succeeds_and_reports(
    capsys: pytest.CaptureFixture[str], token: str | None
) -> None:
    # The configured ports are replaced with free ones: 50051 may well be taken.
    secret = None if token is None else SecretStr(token)
    settings = Settings(control_plane=ControlPlaneSettings(agent_token=secret))

    assert await run_demo(settings) == 0

    out = capsys.readouterr().out
    assert "demo-worker-a  state live" in out
    assert "demo-worker-b  state draining" in out
    assert "demo-worker-a  6 blocks (device 6)" in out
    assert "demo-worker-b  4 blocks (host 4)" in out
    assert "GET /readyz -> 200" in out
    assert 'kvplane_blocks_applied_total{kind="stored"} 12.0' in out
    assert "dropped from the index" in out


async def test_demo_failure_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    settings = Settings(control_plane=ControlPlaneSettings(key_scheme_version=99))

    assert await run_demo(settings) == 1

    assert "demo failed" in capsys.readouterr().err
