"""Where kvplane stands against the peers, run by run: issue 17's targets read off the
bake-off's own results, as ratios in one run, so that nobody counts them by hand.

A kvplane router's run of a point (workload, situation, load) is set against the peer
routers' runs of the same point with the same run number (the bake-off runs every
router's run 1, then every router's run 2): its engine hit rate against the highest of
theirs, its TTFT p90 against the lowest, its CPU per request against the least. A run
that has no figures (its cell failed, or no request was answered) is left out, and so
is a point with no peer.

Ties are counted as the tables show the figures: hit rates to 0.1 point, TTFT to the
millisecond. A peer that let tenants share cache (it dropped their `cache_salt`) is
marked: its hit rate is one kvplane refuses to earn that way.

In the `pd` situation a router stands only against those in front of the same kind of
fleet: kvplane's P/D routers against vllm-router's P/D mode; kvplane's aggregated
reference there (`kvplane kvplane`) has no peer, and is read against kvplane's own P/D
rows in the point's table.

kvplane behind Envoy (`kvplane-envoy kvplane`) stands as kvplane does: its routing, at
a gateway. Envoy alone (`envoy round_robin`) is no peer: it is no LLM router, only the
floor for what the picker adds at a gateway, and stands in neither column.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from benchmarks.live.bakeoff import CellResult
from simulations.reporting import format_table

KVPLANE_FAMILIES = frozenset({"kvplane", "kvplane-envoy"})
NOT_PEERS = frozenset({"envoy"})  # baselines for kvplane-envoy, not routers to beat


@dataclass(frozen=True, slots=True)
class Standing:
    """One kvplane run of one point against the peers' runs with its number."""

    router: str
    workload: str
    situation: str
    load: str
    run: int
    hit_rate: float
    peer_hit_rate: float  # the highest of the peers'
    peer_with_hit_rate: str
    peer_shared_tenants_cache: bool  # that peer let tenants share cache
    ttft_p90_ms: float
    peer_ttft_p90_ms: float  # the lowest of the peers'
    peer_with_ttft_p90: str
    cpu_ms_per_request: float
    peer_cpu_ms_per_request: float  # the least of the peers'
    peer_with_cpu: str

    @property
    def highest_hit_rate(self) -> bool:
        return round(self.hit_rate * 100, 1) >= round(self.peer_hit_rate * 100, 1)

    @property
    def lowest_ttft_p90(self) -> bool:
        return round(self.ttft_p90_ms) <= round(self.peer_ttft_p90_ms)

    @property
    def cpu_ratio(self) -> float:
        """kvplane's CPU per request over the least of the peers' (inf if that is 0)."""
        if self.peer_cpu_ms_per_request <= 0:
            return float("inf")
        return self.cpu_ms_per_request / self.peer_cpu_ms_per_request


def standings(results: Sequence[CellResult]) -> list[Standing]:
    """Every kvplane run that has peers' runs to be set against, in the results' order."""
    found = []
    for kvplane, peers in _pairs(results):
        best_hit = max(peers, key=lambda peer: peer.engine_hit_rate)
        best_p90 = min(peers, key=lambda peer: peer.ttft_p90_ms)
        least_cpu = min(peers, key=lambda peer: peer.cpu_ms_per_request)
        found.append(
            Standing(
                router=kvplane.router,
                workload=kvplane.workload,
                situation=kvplane.situation,
                load=kvplane.load,
                run=kvplane.run,
                hit_rate=kvplane.engine_hit_rate,
                peer_hit_rate=best_hit.engine_hit_rate,
                peer_with_hit_rate=best_hit.router,
                peer_shared_tenants_cache=bool(best_hit.unsalted_blocks),
                ttft_p90_ms=kvplane.ttft_p90_ms,
                peer_ttft_p90_ms=best_p90.ttft_p90_ms,
                peer_with_ttft_p90=best_p90.router,
                cpu_ms_per_request=kvplane.cpu_ms_per_request,
                peer_cpu_ms_per_request=least_cpu.cpu_ms_per_request,
                peer_with_cpu=least_cpu.router,
            )
        )
    return found


def _pairs(results: Sequence[CellResult]) -> Iterator[tuple[CellResult, list[CellResult]]]:
    measured = [result for result in results if result.error is None and _has_figures(result)]
    for kvplane in measured:
        if kvplane.family not in KVPLANE_FAMILIES:
            continue
        peers = [
            result
            for result in measured
            if result.family not in KVPLANE_FAMILIES | NOT_PEERS
            and (result.workload, result.situation, result.load, result.run, result.fleet)
            == (kvplane.workload, kvplane.situation, kvplane.load, kvplane.run, kvplane.fleet)
        ]
        if peers:
            yield kvplane, peers


def _has_figures(result: CellResult) -> bool:
    """A run without a TTFT (no request answered) has nothing to set against, and NaN
    would make every comparison with it false, whichever side it is on."""
    return math.isfinite(result.ttft_p90_ms) and math.isfinite(result.engine_hit_rate)


def render_standings(found: Sequence[Standing]) -> str:
    """A table per kvplane router, a row per standing (`leads`: ahead or tied), then its
    counts; empty without standings (no peer ran)."""
    sections = []
    for router in dict.fromkeys(standing.router for standing in found):
        mine = [standing for standing in found if standing.router == router]
        rows: list[tuple[str, ...]] = [
            (f"{router} against the best peer", "hit %", "ratio", "leads", "TTFT p90 ms",
             "ratio", "leads", "CPU ms/req", "ratio")
        ]  # fmt: skip
        rows += [_row(standing) for standing in mine]
        hits = sum(standing.highest_hit_rate for standing in mine)
        p90s = sum(standing.lowest_ttft_p90 for standing in mine)
        cpu = [standing.cpu_ratio for standing in mine]
        spread = f"{min(cpu):.1f}-{max(cpu):.1f}" if len(mine) > 1 else f"{cpu[0]:.1f}"
        summary = (
            f"{router}: the highest hit rate in {hits} of {len(mine)} runs (ties to 0.1 "
            f"point counted), the lowest TTFT p90 in {p90s} of {len(mine)}, CPU per "
            f"request {spread}x the least of the peers'"
        )
        sections.append(f"{format_table(rows)}\n{summary}")
    return "\n\n".join(sections)


def _row(standing: Standing) -> tuple[str, ...]:
    shared = ", shared tenants' cache" if standing.peer_shared_tenants_cache else ""
    return (
        f"{standing.workload}, {standing.situation}, {standing.load}, run {standing.run}",
        f"{standing.hit_rate * 100:.1f} vs {standing.peer_hit_rate * 100:.1f} "
        f"({standing.peer_with_hit_rate}{shared})",
        _ratio(standing.hit_rate, standing.peer_hit_rate),
        _mark(standing.highest_hit_rate),
        f"{standing.ttft_p90_ms:.0f} vs {standing.peer_ttft_p90_ms:.0f} "
        f"({standing.peer_with_ttft_p90})",
        _ratio(standing.ttft_p90_ms, standing.peer_ttft_p90_ms),
        _mark(standing.lowest_ttft_p90),
        f"{standing.cpu_ms_per_request:.1f} vs {standing.peer_cpu_ms_per_request:.1f} "
        f"({standing.peer_with_cpu})",
        f"{standing.cpu_ratio:.2f}",
    )


def _mark(leads: bool) -> str:
    return "yes" if leads else "no"


def _ratio(mine: float, theirs: float) -> str:
    return f"{mine / theirs:.2f}" if theirs > 0 else "-"
