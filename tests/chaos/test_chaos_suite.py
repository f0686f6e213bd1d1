"""The chaos suite's short profile, in `make test`: every fault of `make chaos`, against
real processes (engine simulators, agents, two routers, a private Redis), for less time.
The full run and its report: `make chaos`, docs/reliability.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos.load import Outcome
from chaos.report import markdown
from chaos.scenarios import SCENARIOS, SHORT, run_suite
from chaos.stack import ChaosStack


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_every_fault_keeps_every_promise(tmp_path: Path) -> None:
    fleet = ChaosStack(tmp_path)
    try:
        await fleet.start()
        results = await run_suite(fleet, SHORT)
    finally:
        await fleet.stop()
    report = markdown(results, SHORT, "# Chaos report (short)")
    print(report)  # shown with -rP, or when the test fails
    assert [result.name for result in results] == [name for name, _, _ in SCENARIOS]
    assert sum(result.outcomes[Outcome.LOST] for result in results) == 0, report
    assert all(result.cross_tenant_matches == 0 for result in results), report
    assert all(result.passed for result in results), report
    # The checks had something to check: traffic, faults that cost something, timings.
    assert all(result.sent > 0 for result in results)
    assert sum(result.outcomes[Outcome.RETRIED] for result in results) > 0
    assert all(
        result.measured.purge_s is not None
        for result in results
        if result.name.endswith(("killed", "blackhole", "drop")) and result.name != "router-killed"
    )
