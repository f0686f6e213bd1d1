"""The `noisy-tenant` situation's report: what the well-behaved tenants got while the
noisy one flooded, against their solo run, and issue 49's targets read off it.

Each router's flood run (`noisy-same`, `noisy-long`) is set against two runs with its
number: its own solo run (the well-behaved tenants' very requests, alone: their TTFT
reference) and `kvplane kvplane`'s run of the same variant (kvplane without flow
control: the throughput and hit-rate reference). The targets, for kvplane with flow
control (one router and two replicas):
- the well-behaved tenants' TTFT p90 within `P90_TARGET` times their solo run's;
- output tokens a second over the schedule at least `THROUGHPUT_TARGET` of kvplane's
  without flow control, the engines' hit rate within `HIT_POINTS_TARGET` points;
- the noisy tenant takes all the shedding (no well-behaved request shed);
- in `shares-2-1-1`, every tenant's share of the service while all were backlogged
  within `SHARE_TARGET` of its configured share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.live.bakeoff import CellResult
from benchmarks.live.capacity import CAPACITY_ROUTER
from benchmarks.live.fairness import (
    BACKLOG_WAIT_S,
    NOISY_GROUP,
    WELL_BEHAVED_GROUP,
    TenantFigures,
    group_of,
)
from benchmarks.live.grid import NOISY_SITUATION
from benchmarks.live.routers import FLOW_ROUTERS, FLOW_WAIT_EVIDENCE
from benchmarks.live.workloads import NOISY_SOLO, NOISY_TENANT, NOISY_VARIANTS, SHARES_WORKLOAD
from simulations.reporting import format_table

P90_TARGET = 1.25
THROUGHPUT_TARGET = 0.95
HIT_POINTS_TARGET = 5.0
SHARE_TARGET = 0.10
FLOW_CONTROL_ROUTERS = frozenset(router.name for router in FLOW_ROUTERS)  # judged


@dataclass(frozen=True, slots=True)
class Flood:
    """One router's run of a flood variant, with its solo run and kvplane's run without
    flow control of the same variant (None where they did not run or have no figures)."""

    run: CellResult
    solo: CellResult | None
    reference: CellResult | None

    @property
    def tenancy(self) -> TenantFigures:
        assert self.run.tenancy is not None  # a flood run with figures has them
        return self.run.tenancy

    def ttft(self, group: str, percentile: str) -> float:
        return self.tenancy.ttft_ms_by_group.get(group, {}).get(percentile, math.nan)

    @property
    def solo_p90_ms(self) -> float:
        if self.solo is None or self.solo.tenancy is None:
            return math.nan
        return self.solo.tenancy.ttft_ms_by_group.get(WELL_BEHAVED_GROUP, {}).get("p90", math.nan)

    def router_wait_ms(self, group: str) -> float:
        """The mean time the group's requests that queued in the router waited there,
        over every replica (NaN where none queued: no flow control)."""
        seconds = requests = 0.0
        for evidence in self.run.evidence.values():
            for tenant, wait in evidence.get(FLOW_WAIT_EVIDENCE, {}).items():
                if group_of(tenant, NOISY_TENANT) == group:
                    seconds += wait.get("seconds", 0.0)
                    requests += wait.get("requests", 0.0)
        return seconds / requests * 1000 if requests else math.nan

    @property
    def p90_ratio(self) -> float:
        """The well-behaved tenants' TTFT p90 over their solo run's."""
        return _ratio(self.ttft(WELL_BEHAVED_GROUP, "p90"), self.solo_p90_ms)

    @property
    def throughput_ratio(self) -> float:
        """Output tokens a second over the schedule, over kvplane's without flow control."""
        if self.reference is None or self.reference.tenancy is None:
            return math.nan
        return _ratio(
            self.tenancy.span_output_tokens_per_s,
            self.reference.tenancy.span_output_tokens_per_s,
        )

    @property
    def hit_points(self) -> float:
        """The engines' hit rate less kvplane's without flow control, in points."""
        if self.reference is None:
            return math.nan
        return (self.run.engine_hit_rate - self.reference.engine_hit_rate) * 100

    @property
    def answered_hit_points(self) -> float:
        """The same over the answered requests' prompts (what their usage reported
        cached): the engines' rate also counts each lookup of a request that waited in an
        engine for memory, again at every step it did not fit."""
        if self.reference is None:
            return math.nan
        return (self.run.client_cached_share - self.reference.client_cached_share) * 100

    @property
    def shed_well_behaved(self) -> int:
        return sum(
            sum(reasons.values())
            for tenant, reasons in self.tenancy.shed_by_tenant.items()
            if tenant != NOISY_TENANT
        )

    @property
    def shed_noisy(self) -> int:
        return sum(self.tenancy.shed_by_tenant.get(NOISY_TENANT, {}).values())

    def targets(self) -> dict[str, bool]:
        """Issue 49's targets for this run, each met or not (a missing reference: not)."""
        return {
            f"well-behaved p90 within {P90_TARGET:g}x solo": self.p90_ratio <= P90_TARGET,
            f"throughput at least {THROUGHPUT_TARGET:.0%} of {CAPACITY_ROUTER}'s": (
                self.throughput_ratio >= THROUGHPUT_TARGET
            ),
            f"hit rate within {HIT_POINTS_TARGET:g} points": (
                self.hit_points >= -HIT_POINTS_TARGET
            ),
            "the noisy tenant takes all the shedding": self.shed_well_behaved == 0,
        }


def floods(results: Sequence[CellResult]) -> list[Flood]:
    """Every flood run with figures, router by router, with its references."""
    measured = {
        (result.router, result.workload, result.run): result
        for result in results
        if result.situation == NOISY_SITUATION and result.error is None and result.tenancy
    }
    return [
        Flood(
            result,
            measured.get((router, NOISY_SOLO, run)),
            measured.get((CAPACITY_ROUTER, workload, run)),
        )
        for (router, workload, run), result in _router_by_router(measured)
        if workload in NOISY_VARIANTS
    ]


def _router_by_router(
    measured: dict[tuple[str, str, int], CellResult],
) -> list[tuple[tuple[str, str, int], CellResult]]:
    """Each router's runs together, in the order the routers first ran, run by run."""
    order = list(dict.fromkeys(router for router, _, _ in measured))
    return sorted(measured.items(), key=lambda item: (order.index(item[0][0]), item[0][2]))


FLOOD_COLUMNS = (
    "WB p50 ms",
    "WB p90 ms",
    "WB p99 ms",
    "solo p90 ms",
    "p90/solo",
    "WB wait ms",
    "noisy p90 ms",
    "shed WB",
    "shed noisy",
    "failed WB",
    "failed noisy",
    "req/s",
    "out tok/s",
    "tput/kvplane",
    "hit %",
    "hit pts",
    "answered hit pts",
    "WB hit %",
    "noisy hit %",
    "noisy backlogged s",
    "noisy share",
)


def _flood_row(flood: Flood) -> tuple[str, ...]:
    tenancy = flood.tenancy
    return (
        f"{flood.run.router}, run {flood.run.run}",
        *(_ms(flood.ttft(WELL_BEHAVED_GROUP, p)) for p in ("p50", "p90", "p99")),
        _ms(flood.solo_p90_ms),
        _figure(flood.p90_ratio, ".2f"),
        _ms(flood.router_wait_ms(WELL_BEHAVED_GROUP)),
        _ms(flood.ttft(NOISY_GROUP, "p90")),
        str(flood.shed_well_behaved),
        str(flood.shed_noisy),
        str(tenancy.failed_by_group.get(WELL_BEHAVED_GROUP, 0)),
        str(tenancy.failed_by_group.get(NOISY_GROUP, 0)),
        f"{tenancy.span_requests_per_s:.1f}",
        f"{tenancy.span_output_tokens_per_s:.0f}",
        _figure(flood.throughput_ratio, ".2f"),
        f"{flood.run.engine_hit_rate * 100:.1f}",
        _figure(flood.hit_points, "+.1f"),
        _figure(flood.answered_hit_points, "+.1f"),
        *(
            _figure(tenancy.hit_rate_by_group.get(group, math.nan) * 100, ".1f")
            for group in (WELL_BEHAVED_GROUP, NOISY_GROUP)
        ),
        f"{tenancy.backlogged_s.get(NOISY_TENANT, 0.0):.0f}",
        _figure(tenancy.backlogged_share.get(NOISY_TENANT, math.nan), ".2f"),
    )


def render_floods(found: Sequence[Flood]) -> str:
    """A table per variant, a row per router's run, then the sheds by reason and each
    flow-control run's targets; empty without flood runs."""
    sections = []
    for variant in NOISY_VARIANTS:
        mine = [flood for flood in found if flood.run.workload == variant]
        if not mine:
            continue
        first = mine[0].run
        rows: list[tuple[str, ...]] = [(f"{variant} (C = {first.capacity_per_s:.1f} req/s)",
                                        *FLOOD_COLUMNS)]  # fmt: skip
        rows += [_flood_row(flood) for flood in mine]
        lines = [format_table(rows)]
        lines += [
            f"{flood.run.router}, run {flood.run.run}: shed {_reasons(flood.tenancy)}"
            for flood in mine
            if flood.tenancy.shed
        ]
        lines += [
            f"{flood.run.router}, run {flood.run.run}: targets: {_verdicts(flood.targets())}"
            for flood in mine
            if flood.run.router in FLOW_CONTROL_ROUTERS
        ]
        sections.append("\n".join(lines))
    if sections:
        sections.append(
            "WB: the four well-behaved tenants, pooled. TTFT over every request of the run "
            "but those shed, one never answered (failed: cancelled at the cell's end) as "
            "infinite; WB wait ms: the mean time the well-behaved requests that queued in "
            "the router's flow control waited there (every replica's "
            "kvplane_flow_wait_seconds; one that found room at once never queued; -: none "
            "queued, or no replica recorded it); "
            "req/s and out tok/s: answered over the schedule; tput/kvplane, hit pts: "
            f"against {CAPACITY_ROUTER} (no flow control), same variant and run (hit %: the "
            "engines' prefix-cache hits over lookups, a request that waits in an engine "
            "for memory looked up at every step; answered hit pts: over the answered "
            "requests' prompt tokens, as their usage reported them cached); WB, noisy hit "
            "%: the latter, per group; noisy "
            f"backlogged s: the noisy tenant's time with a request waiting over "
            f"{BACKLOG_WAIT_S:g} s, its share of the service (computed prompt + 2 x output "
            "tokens + 0.01 x their context) then."
        )
    return "\n\n".join(sections)


def render_solo(results: Sequence[CellResult]) -> str:
    """The well-behaved tenants alone, each router's runs: their references."""
    order = list(dict.fromkeys(result.router for result in results))
    solo = [
        (result, result.tenancy)
        for result in sorted(results, key=lambda result: (order.index(result.router), result.run))
        if result.situation == NOISY_SITUATION
        and result.workload == NOISY_SOLO
        and result.error is None
        and result.tenancy
    ]
    if not solo:
        return ""
    rows: list[tuple[str, ...]] = [
        ("noisy-solo (well-behaved tenants alone)", "WB p50 ms", "WB p90 ms", "WB p99 ms",
         "req/s", "hit %")
    ]  # fmt: skip
    for result, tenancy in solo:
        group = tenancy.ttft_ms_by_group.get(WELL_BEHAVED_GROUP, {})
        rows.append(
            (
                f"{result.router}, run {result.run}",
                *(_ms(group.get(p, math.nan)) for p in ("p50", "p90", "p99")),
                f"{tenancy.span_requests_per_s:.1f}",
                f"{result.engine_hit_rate * 100:.1f}",
            )
        )
    return format_table(rows)


def render_shares(results: Sequence[CellResult]) -> str:
    """The shares measurement: each tenant's share of the service while all of them
    were backlogged against its configured share, a row per router's run."""
    runs = [
        (result, result.tenancy)
        for result in results
        if result.workload == SHARES_WORKLOAD and result.error is None and result.tenancy
    ]
    if not runs:
        return ""
    tenants = list(runs[0][1].configured_shares)
    rows: list[tuple[str, ...]] = [
        (
            f"{SHARES_WORKLOAD}: measured / configured share",
            "all backlogged s",
            *tenants,
            "worst error",
            f"within {SHARE_TARGET:.0%}",
        )
    ]
    for result, tenancy in runs:
        errors = tenancy.share_errors
        worst = max((abs(error) for error in errors.values()), default=math.nan)
        rows.append(
            (
                f"{result.router}, run {result.run}",
                f"{tenancy.all_backlogged_s:.0f}",
                *(
                    f"{tenancy.all_backlogged_shares.get(tenant, 0.0):.3f} / "
                    f"{tenancy.configured_shares[tenant]:.3f}"
                    for tenant in tenants
                ),
                _figure(worst * 100, ".1f") + ("%" if errors else ""),
                "yes" if errors and worst <= SHARE_TARGET else "no",
            )
        )
    return format_table(rows)


def render_noisy_tenant(results: Sequence[CellResult]) -> str:
    """The situation's tables (solo, floods with their targets, shares) and the runs
    that have no figures; empty where none of its cells is in `results`."""
    mine = [result for result in results if result.situation == NOISY_SITUATION]
    if not mine:
        return ""
    failed = [
        f"{result.router} | {result.workload} | run {result.run}: no figures: {result.error}"
        for result in mine
        if result.error
    ]
    parts = [render_solo(mine), render_floods(floods(mine)), render_shares(mine), *failed]
    return "\n\n".join(part for part in parts if part)


def _reasons(tenancy: TenantFigures) -> str:
    """`noisy queue_timeout 310, displaced 4; tenant-2 queue_full 1`."""
    return "; ".join(
        f"{tenant} " + ", ".join(f"{reason} {count}" for reason, count in reasons.items())
        for tenant, reasons in tenancy.shed_by_tenant.items()
    )


def _verdicts(targets: dict[str, bool]) -> str:
    met = sum(targets.values())
    return f"{met} of {len(targets)} met; " + "; ".join(
        f"{name}: {'yes' if ok else 'NO'}" for name, ok in targets.items()
    )


def _ratio(mine: float, theirs: float) -> float:
    """NaN without a reference; infinite where `mine` is (a tail never answered)."""
    return mine / theirs if theirs > 0 else math.nan


def _figure(value: float, fmt: str) -> str:
    return "-" if math.isnan(value) else format(value, fmt)


def _ms(value: float) -> str:
    return _figure(value, ".0f")
