"""The chaos report: one table row per scenario, then what each one noticed."""

from __future__ import annotations

import math
from collections.abc import Sequence

from chaos.load import Outcome
from chaos.scenarios import Profile, ScenarioResult


def _seconds(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}"


def markdown(results: Sequence[ScenarioResult], profile: Profile, header: str) -> str:
    lines = [
        header,
        "",
        f"Profile `{profile.name}`: faults held {profile.hold_s:g} s, soak {profile.soak_s:g} s, "
        f"{profile.concurrency} clients of steady load.",
        "",
        "| scenario | sent | ok | retried | failed, clear error | lost | purge s | recover s "
        "| index = engines (s) | cross-tenant | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        o = r.outcomes
        index = "no" if math.isnan(r.index_converge_s) else f"yes ({r.index_converge_s:.2f})"
        lines.append(
            f"| {r.name} | {r.sent} | {o[Outcome.OK]} | {o[Outcome.RETRIED]} | "
            f"{o[Outcome.FAILED]} | {o[Outcome.LOST]} | {_seconds(r.measured.purge_s)} | "
            f"{_seconds(r.measured.recover_s)} | {index} | {r.cross_tenant_matches} | "
            f"{'pass' if r.passed else 'FAIL'} |"
        )
    lines += ["", "## Scenarios", ""]
    for r in results:
        lines.append(f"- **{r.name}**: {r.fault}.")
        for kind, count in sorted(r.failure_kinds.items()):
            lines.append(f"  - {count} x {kind}")
        for note in r.measured.notes:
            lines.append(f"  - {note}")
        for problem in r.measured.problems:
            lines.append(f"  - PROBLEM: {problem}")
    totals = {
        "sent": sum(r.sent for r in results),
        "lost": sum(r.outcomes[Outcome.LOST] for r in results),
        "cross": max((r.cross_tenant_matches for r in results), default=0),
    }
    lines += [
        "",
        f"In all: {totals['sent']} requests, {totals['lost']} lost, "
        f"{totals['cross']} cross-tenant matches; "
        f"{sum(r.passed for r in results)} of {len(results)} scenarios passed.",
        "",
    ]
    return "\n".join(lines)
