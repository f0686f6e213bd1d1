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
rows in the point's table. The same-fleet comparison (`same_fleet`) then reads every
router of a P/D fleet against that fleet's reference (`grid.PD_FLEET_REFERENCES`), run
by run: on two prefill and two decode engines kvplane's conditional and always against
vllm-router's P/D mode; on four engines that each take either leg kvplane's conditional
and always against kvplane never splitting, whole requests on the very same engines.
That is the comparison that says whether splitting pays: `kvplane kvplane` runs on
other engines (no connector).

kvplane behind Envoy (`kvplane-envoy kvplane`) stands as kvplane does: its routing, at
a gateway. Envoy alone (`envoy round_robin`) is no peer: it is no LLM router, only the
floor for what the picker adds at a gateway, and stands in neither column.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from benchmarks.live.bakeoff import CellResult
from benchmarks.live.engines import FLEET_LABELS
from benchmarks.live.grid import NOISY_SITUATION, PD, PD_FLEET_REFERENCES
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
    # The noisy tenant's floods stand by their own targets (`noisy.py`): one TTFT over
    # every tenant says nothing there.
    measured = [
        result
        for result in results
        if result.error is None and _has_figures(result) and result.situation != NOISY_SITUATION
    ]
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
    return f"{mine / theirs:.2f}" if theirs > 0 and math.isfinite(mine) else "-"


# --- P/D on one fleet ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SameFleet:
    """One router's run of a `pd` point against its fleet's reference's run with the same
    number: TTFT, inter-token and end-to-end p90, and prompt tokens computed."""

    router: str
    reference: str
    fleet: str
    workload: str
    load: str
    run: int
    ttft_p90_ms: float
    reference_ttft_p90_ms: float
    itl_p90_ms: float
    reference_itl_p90_ms: float
    e2e_p90_ms: float
    reference_e2e_p90_ms: float
    computed_tokens: float
    reference_computed_tokens: float
    split_requests: float  # kvplane's count (0 for a router that counts none)
    # What the tables flag about P/D in either run (`CellResult.pd_unexpected`).
    flags: tuple[str, ...] = ()


SAME_FLEET_FIGURES = (
    ("TTFT p90 ms", "ttft_p90_ms", ".0f"),
    ("ITL p90 ms", "itl_p90_ms", ".1f"),
    ("e2e p90 ms", "e2e_p90_ms", ".0f"),
)


def same_fleet(results: Sequence[CellResult]) -> list[SameFleet]:
    """Every run of a router in front of a P/D fleet against the run with its number of
    that fleet's reference (`PD_FLEET_REFERENCES`), in the results' order; a run without
    figures on either side is left out."""
    measured = [
        result
        for result in results
        if result.situation == PD and result.error is None and _has_figures(result)
    ]
    references = {
        (result.fleet, result.workload, result.load, result.run): result
        for result in measured
        if PD_FLEET_REFERENCES.get(result.fleet) == result.router
    }
    found = []
    for result in measured:
        reference = references.get((result.fleet, result.workload, result.load, result.run))
        if reference is None or reference.router == result.router:
            continue
        found.append(
            SameFleet(
                router=result.router,
                reference=reference.router,
                fleet=result.fleet,
                workload=result.workload,
                load=result.load,
                run=result.run,
                ttft_p90_ms=result.ttft_p90_ms,
                reference_ttft_p90_ms=reference.ttft_p90_ms,
                itl_p90_ms=result.itl_p90_ms,
                reference_itl_p90_ms=reference.itl_p90_ms,
                e2e_p90_ms=result.e2e_p90_ms,
                reference_e2e_p90_ms=reference.e2e_p90_ms,
                computed_tokens=result.prompt_tokens_computed,
                reference_computed_tokens=reference.prompt_tokens_computed,
                split_requests=result.split_requests,
                flags=tuple(
                    f"{run.router}: {run.pd_unexpected}"
                    for run in (result, reference)
                    if run.pd_unexpected
                ),
            )
        )
    return found


def render_same_fleet(found: Sequence[SameFleet]) -> str:
    """A table per P/D fleet, a row per router's run against the reference's (requests
    split, then figures and ratios: under 1 is better for every one of them), a line per
    run whose P/D was not as claimed, then a line per router with the range of its
    ratios; empty where no fleet had its reference measured."""
    sections = []
    for fleet in dict.fromkeys(item.fleet for item in found):
        # Point by point, each router's runs together.
        points = list(dict.fromkeys((item.workload, item.load) for item in found))
        names = list(dict.fromkeys(item.router for item in found))
        mine = sorted(
            (item for item in found if item.fleet == fleet),
            key=lambda item: (
                points.index((item.workload, item.load)),
                names.index(item.router),
                item.run,
            ),
        )
        reference = mine[0].reference
        rows: list[tuple[str, ...]] = [
            (
                f"on one fleet ({FLEET_LABELS.get(fleet, fleet)}), against {reference}",
                "split",
                *(column for title, _, _ in SAME_FLEET_FIGURES for column in (title, "ratio")),
                "computed ktok",
                "ratio",
            )
        ]
        for item in mine:
            row = [
                f"{item.workload}, {item.load}, run {item.run}: {item.router}",
                f"{item.split_requests:.0f}",
            ]
            for _, name, fmt in SAME_FLEET_FIGURES:
                value, theirs = getattr(item, name), getattr(item, f"reference_{name}")
                row += [f"{_figure(value, fmt)} vs {_figure(theirs, fmt)}", _ratio(value, theirs)]
            row += [
                f"{_figure(item.computed_tokens / 1000, '.1f')} vs "
                f"{_figure(item.reference_computed_tokens / 1000, '.1f')}",
                _ratio(item.computed_tokens, item.reference_computed_tokens),
            ]
            rows.append(tuple(row))
        lines = [format_table(rows)]
        lines += dict.fromkeys(
            f"{item.workload}, {item.load}, run {item.run}: {flag}"
            for item in mine
            for flag in item.flags
        )
        for router in dict.fromkeys(item.router for item in mine):
            runs = [item for item in mine if item.router == router]
            spans = [
                f"{title.removesuffix(' ms')} {_span(runs, name)}"
                for title, name, _ in SAME_FLEET_FIGURES
            ]
            spans.append(f"computed {_span(runs, 'computed_tokens')}")
            lines.append(
                f"{router} against {reference}, {len(runs)} runs, ratios: " + ", ".join(spans)
            )
        sections.append("\n".join(lines))
    return "\n\n".join(sections)


def _figure(value: float, fmt: str) -> str:
    return "-" if math.isnan(value) else format(value, fmt)


def _span(runs: Sequence[SameFleet], name: str) -> str:
    """The range of a figure's ratios over `runs` ("0.85-1.10"; "-" where none has one)."""
    ratios = [
        getattr(run, name) / getattr(run, f"reference_{name}")
        for run in runs
        if getattr(run, f"reference_{name}") > 0 and math.isfinite(getattr(run, name))
    ]
    if not ratios:
        return "-"
    low, high = min(ratios), max(ratios)
    return f"{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}"
