"""The bake-off's report: one table per point (workload, situation, load) with every
router's figures and every run side by side, the JSON, and a plot.

A point of the `pd` situation shows, besides, each router's fleet (`PD_FLEET_SHORT`),
its inter-token and end-to-end latency beside its TTFT (disaggregation's published
benefit is inter-token latency: a decode engine that never prefills), where the prompt
tokens came from (computed: the fleet's prefill work; pulled: moved between engines)
and kvplane's own P/D counters (requests split and whole, fallbacks), its rows fleet by
fleet, and says of each run where P/D was not as claimed (not in play; in play for the
never-split reference). The same-fleet comparison (`standings.same_fleet`) follows the
standings. The `noisy-tenant` situation has tables of its own (`noisy.py`): one TTFT
over every tenant says nothing there."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.live.bakeoff import CellResult
from benchmarks.live.engines import FLEET_AGGREGATED, FLEET_BOTH, FLEET_PD
from benchmarks.live.grid import EVICTION_SITUATIONS, NOISY_SITUATION, PD
from benchmarks.live.noisy import render_noisy_tenant
from benchmarks.live.standings import render_same_fleet, render_standings, same_fleet, standings
from simulations.reporting import format_table


def _runs(values: Sequence[float], fmt: str) -> str:
    """Each run's figure, '/' between them: the spread is what a 2-core machine gives."""
    return " / ".join("-" if math.isnan(value) else format(value, fmt) for value in values)


def _points(results: Sequence[CellResult]) -> dict[tuple[str, str, str], list[CellResult]]:
    points: dict[tuple[str, str, str], list[CellResult]] = {}
    for result in results:
        points.setdefault((result.workload, result.situation, result.load), []).append(result)
    return points


def _by_router(results: Sequence[CellResult]) -> dict[str, list[CellResult]]:
    routers: dict[str, list[CellResult]] = {}
    for result in sorted(results, key=lambda r: r.run):
        routers.setdefault(result.router, []).append(result)
    return routers


def render_tables(results: Sequence[CellResult]) -> str:
    """`hit %` is the engines' own counters (hit over queried tokens), `cached %` the
    cached share of the prompt tokens the answers' usage reports. They part where
    requests wait for KV memory: an engine queries a waiting request's prefix again at
    every step it cannot admit it, so the counters fall while the answers do not."""
    sections = []
    for (workload, situation, load), point in _points(results).items():
        if situation == NOISY_SITUATION:
            continue  # its own tables, below
        rate = point[0].rate_per_s
        pd = any(result.situation == PD or result.fleet != FLEET_AGGREGATED for result in point)
        evicting = situation in EVICTION_SITUATIONS
        host_tier = any(result.host_held_blocks for result in point)
        header_row = (
            "router",
            *(("fleet",) if pd else ()),
            "hit %",
            "cached %",
            "TTFT p50 ms",
            "TTFT p90 ms",
            "TTFT p99 ms",
            *(PD_LATENCY_COLUMNS if pd else ()),
            "req/s",
            "failed",
            "busiest/mean",
            "CPU ms/req",
            "at rest ms/s",
        )
        block_columns = (
            (BLOCK_COLUMNS + (HOST_BLOCK_COLUMNS if host_tier else ())) if evicting else ()
        )
        rows: list[tuple[str, ...]] = [header_row + (PD_COLUMNS if pd else ()) + block_columns]
        notes = []
        routers = list(_by_router(point).items())
        if pd:  # fleet by fleet: each P/D fleet's routers side by side
            routers.sort(key=lambda item: _FLEET_ORDER.get(item[1][0].fleet, len(_FLEET_ORDER)))
        for router, runs in routers:
            ok = [run for run in runs if run.error is None]
            if not ok:
                notes.append(f"{router}: no figures: {runs[0].error}")
                continue
            row = (
                router,
                *((PD_FLEET_SHORT.get(ok[0].fleet, ok[0].fleet),) if pd else ()),
                _runs([run.engine_hit_rate * 100 for run in ok], ".1f"),
                _runs([run.client_cached_share * 100 for run in ok], ".1f"),
                _runs([run.ttft_p50_ms for run in ok], ".0f"),
                _runs([run.ttft_p90_ms for run in ok], ".0f"),
                _runs([run.ttft_p99_ms for run in ok], ".0f"),
                *(pd_latencies(ok) if pd else ()),
                _runs([run.requests_per_s for run in ok], ".1f"),
                _runs([float(run.failed) for run in ok], ".0f"),
                _runs([run.imbalance for run in ok], ".2f"),
                _runs([run.cpu_ms_per_request for run in ok], ".1f"),
                _runs([run.rest_cpu_ms_per_s for run in ok], ".1f"),
            )
            blocks = fleet_blocks(ok, host_tier) if evicting else ()
            rows.append(row + (pd_figures(ok) if pd else ()) + blocks)
            notes += [f"{router} run {run.run}: {run.error}" for run in runs if run.error]
            notes += [
                f"{router} run {run.run}: {run.pd_unexpected}" for run in ok if run.pd_unexpected
            ]
            split = _cpu_split(ok)
            if split:
                notes.append(f"{router}: CPU ms/req by part: {split}")
            notes += [
                f"{router} run {run.run}: fallbacks: {_fallback_reasons(run)}"
                for run in ok
                if run.fallbacks
            ]
            if any(run.unsalted_blocks for run in ok):
                notes.append(
                    f"{router}: tenants SHARED cache (it dropped their cache_salt; "
                    f"{max(run.unsalted_blocks or 0 for run in ok)} unsalted blocks cached)"
                )
        header = f"{workload}, {situation}, {load} ({rate:g} req/s offered)"
        sections.append("\n".join([header, format_table(rows), *notes]))
    noisy = render_noisy_tenant(results)
    if noisy:
        sections.append(f"{NOISY_SITUATION}\n{noisy}")
    return "\n\n".join(sections)


BLOCK_COLUMNS = ("distinct blocks",)
HOST_BLOCK_COLUMNS = ("CPU distinct", "distinct either")
"""An eviction point's last columns: the distinct blocks the engines' device caches hold
at the cell's end (held by several engines counted once: what placement kept), and with
a CPU tier the distinct blocks in host memory and on either tier."""


def fleet_blocks(runs: Sequence[CellResult], host_tier: bool) -> tuple[str, ...]:
    """The `BLOCK_COLUMNS` (and `HOST_BLOCK_COLUMNS`) of a router's runs."""

    def counts(values: Sequence[int | None]) -> str:
        return _runs([math.nan if value is None else float(value) for value in values], ".0f")

    device = (counts([run.distinct_blocks for run in runs]),)
    if not host_tier:
        return device
    return (
        *device,
        counts([run.host_distinct_blocks for run in runs]),
        counts([run.distinct_blocks_any_tier for run in runs]),
    )


PD_FLEET_SHORT = {FLEET_AGGREGATED: "4 plain", FLEET_PD: "2P+2D", FLEET_BOTH: "4 both"}
"""A `pd` point's `fleet` column: four engines with no connector (`kvplane kvplane`);
two prefill and two decode engines; four engines each with NixlConnector, any of them
taking either leg or a whole request (kvplane's agents `--role both`)."""
_FLEET_ORDER = {FLEET_AGGREGATED: 0, FLEET_PD: 1, FLEET_BOTH: 2}

PD_LATENCY_COLUMNS = ("ITL p50 ms", "ITL p90 ms", "e2e p90 ms")
"""A `pd` point's latencies beside its TTFT: inter-token latency (every gap between
successive content chunks of every streamed answer of the cell, pooled) and end-to-end
latency (sent to the stream's end) of the answered requests."""


def pd_latencies(runs: Sequence[CellResult]) -> tuple[str, str, str]:
    """The `PD_LATENCY_COLUMNS` of a router's runs."""
    return (
        _runs([run.itl_p50_ms for run in runs], ".1f"),
        _runs([run.itl_p90_ms for run in runs], ".1f"),
        _runs([run.e2e_p90_ms for run in runs], ".0f"),
    )


PD_COLUMNS = ("computed ktok", "pulled ktok", "split / whole", "fallbacks")
"""A disaggregated point's columns: prompt tokens computed on the fleet and pulled
between its engines (thousands, from the engines' `vllm:prompt_tokens_by_source`), and
kvplane's own counts of requests split and served whole, and of fallbacks
(`kvplane_legs_decided_total`, `kvplane_disaggregation_fallbacks_total`); `-` for a
router that counts none."""


def pd_figures(runs: Sequence[CellResult]) -> tuple[str, str, str, str]:
    """The `PD_COLUMNS` of a router's runs."""
    counted = [run for run in runs if run.pd_counters or _counts_legs(run)]
    decisions = (
        " / ".join(f"{run.split_requests:.0f}/{run.whole_requests:.0f}" for run in runs)
        if counted
        else "-"
    )
    fallbacks = _runs([run.fallbacks for run in runs], ".0f") if counted else "-"
    return (
        _runs([run.prompt_tokens_computed / 1000 for run in runs], ".1f"),
        _runs([run.prompt_tokens_pulled / 1000 for run in runs], ".1f"),
        decisions,
        fallbacks,
    )


def _counts_legs(run: CellResult) -> bool:
    """kvplane in front of a fleet that can split counts its decisions, even none."""
    return run.family == "kvplane" and run.fleet != FLEET_AGGREGATED


def _fallback_reasons(run: CellResult) -> str:
    """`no_kv_params 3, kv_load_failed 1`: a run's fallbacks by reason."""
    return ", ".join(
        f"{name.partition('reason=')[2].rstrip('}')} {value:.0f}"
        for name, value in run.pd_counters.items()
        if name.startswith("kvplane_disaggregation_fallbacks_total")
    )


def _pd_summary(runs: Sequence[CellResult]) -> str:
    """A `pd` point's runs in the Markdown summary: TTFT p90, ITL p90, e2e p90, prompt
    tokens computed and pulled (thousands), and kvplane's requests split."""
    ok = [run for run in runs if run.error is None]
    computed, pulled, decisions, _ = pd_figures(ok)
    _, itl, e2e = pd_latencies(ok)
    text = (
        f"{_runs([run.ttft_p90_ms for run in ok], '.0f')} ms · ITL {itl} ms · e2e {e2e} ms"
        f" · {computed} · {pulled}"
    )
    if decisions != "-":
        text += f" · split {' / '.join(f'{run.split_requests:.0f}' for run in ok)}"
    if any(run.pd_in_play is False and not run.pd_reference for run in ok):
        text += " (P/D not in play)"
    if any(run.pd_in_play and run.pd_reference for run in ok):
        text += " (the never-split reference split)"
    return text


def _cpu_split(runs: Sequence[CellResult]) -> str:
    """Each part's CPU per request, every run ("envoy 0.4 / 0.5, router ..."), where the
    router is charged more than one part (kvplane's agents, the Envoys in front)."""
    parts = list(dict.fromkeys(part for run in runs for part in run.cpu_ms_per_request_by_part))
    if len(parts) < 2:
        return ""
    return ", ".join(
        f"{part} "
        + _runs([run.cpu_ms_per_request_by_part.get(part, math.nan) for run in runs], ".1f")
        for part in parts
    )


def _hit_and_p90(runs: Sequence[CellResult]) -> str:
    ok = [run for run in runs if run.error is None]
    hits = _runs([run.engine_hit_rate * 100 for run in ok], ".1f")
    shared = " (tenants shared cache)" if any(run.unsalted_blocks for run in ok) else ""
    return f"{hits} % · {_runs([run.ttft_p90_ms for run in ok], '.0f')} ms{shared}"


def _cpu(runs: Sequence[CellResult]) -> str:
    return _runs([run.cpu_ms_per_request for run in runs if run.error is None], ".1f")


def render_summary_markdown(results: Sequence[CellResult]) -> str:
    """Every router's engine hit rate and TTFT p90, then its CPU per request, every run,
    in Markdown: one table per workload with a column per load, and one with a column
    per situation."""
    tables: dict[str, list[tuple[str, str, str]]] = {}  # table -> its points
    for workload, situation, load in _points(results):
        if situation == NOISY_SITUATION:
            continue  # its own tables, at the end
        tables.setdefault(workload if situation == "steady" else "situations", []).append(
            (workload, situation, load)
        )
    cells = {point: _by_router(point_results) for point, point_results in _points(results).items()}
    routers = list(dict.fromkeys(result.router for result in results))

    def table(
        name: str, points: list[tuple[str, str, str]], figure: Callable[[Sequence[CellResult]], str]
    ) -> str:
        titles = [load if name != "situations" else f"{situation} ({workload}, {load})"
                  for workload, situation, load in points]  # fmt: skip
        lines = [
            f"**{name}**" + (" (steady)" if name != "situations" else ""),
            "",
            "| router | " + " | ".join(titles) + " |",
            "|---" * (len(points) + 1) + "|",
        ]
        for router in routers:
            runs = [cells[point].get(router, []) for point in points]
            figures = [
                (figure(point_runs) if any(r.error is None for r in point_runs) else "no figures")
                if point_runs
                else ""
                for point_runs in runs
            ]
            if any(figures):
                lines.append(f"| {router} | " + " | ".join(figures) + " |")
        return "\n".join(lines)

    against_peers = render_standings(standings(results))
    on_one_fleet = render_same_fleet(same_fleet(results))
    noisy = render_noisy_tenant(results)
    pd_points = [point for point in cells if point[1] == "pd"]
    pd_tables = (
        [
            "Prefill/decode disaggregation (`pd`): TTFT p90, inter-token latency (ITL) "
            "p90, end-to-end p90, then prompt tokens computed on the fleet and pulled "
            "between its engines (thousands), then the requests kvplane split, of every "
            "run. `pd-*` on two prefill and two decode engines (with `vllm-router "
            "pd-cache_aware`), `both-*` on four engines each taking either leg, "
            "`kvplane kvplane` on four engines with no connector:",
            table("situations", pd_points, _pd_summary).replace("**situations**", "**pd**"),
        ]
        if pd_points
        else []
    )
    # Headings over the tables there are (a noisy-tenant run has none of them).
    hit_heading = (
        ["Engine hit rate, then TTFT p90, of every run (run 1 / run 2):"] if tables else []
    )
    cpu_heading = (
        ["CPU ms per request (the router's processes, kvplane's agents included), every run:"]
        if tables
        else []
    )
    return (
        "\n\n".join(
            [
                *hit_heading,
                *(table(name, points, _hit_and_p90) for name, points in tables.items()),
                *pd_tables,
                *cpu_heading,
                *(table(name, points, _cpu) for name, points in tables.items()),
                *([f"```\n{against_peers}\n```"] if against_peers else []),
                *([f"```\n{on_one_fleet}\n```"] if on_one_fleet else []),
                *([f"Flow control (`{NOISY_SITUATION}`):\n\n```\n{noisy}\n```"] if noisy else []),
            ]
        )
        + "\n"
    )


def write_json(path: Path, results: Sequence[CellResult], meta: dict[str, Any]) -> None:
    document = {**meta, "cpus": os.cpu_count(), "cells": [result.as_json() for result in results]}
    path.write_text(json.dumps(document, indent=2, allow_nan=True) + "\n")


def read_json(path: Path) -> tuple[dict[str, Any], list[CellResult]]:
    """What `write_json` wrote: the run's description and its cells."""
    document = json.loads(path.read_text())
    cells = [CellResult.from_json(cell) for cell in document.pop("cells")]
    return document, cells


def write_plot(path: Path, results: Sequence[CellResult]) -> None:
    """One panel per point: each router's TTFT p90 (bar: mean of the runs; whiskers: the
    runs' range) labelled with its engine-reported hit rate."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    points = {
        point: point_results
        for point, point_results in _points(results).items()
        if point[1] != NOISY_SITUATION  # one TTFT for every tenant says nothing there
    }
    columns = min(2, len(points)) or 1
    rows = math.ceil(len(points) / columns) or 1
    figure, axes = plt.subplots(rows, columns, figsize=(7 * columns, 3.2 * rows), squeeze=False)
    for panel, ((workload, situation, load), point) in zip(axes.flat, points.items(), strict=False):
        names, means, lows, highs, labels = [], [], [], [], []
        for router, runs in _by_router(point).items():
            ok = [
                run.ttft_p90_ms
                for run in runs
                if run.error is None and not math.isnan(run.ttft_p90_ms)
            ]
            if not ok:
                continue
            hits = [run.engine_hit_rate for run in runs if run.error is None]
            mean = sum(ok) / len(ok)
            names.append(router)
            means.append(mean)
            lows.append(mean - min(ok))
            highs.append(max(ok) - mean)
            labels.append(f"{sum(hits) / len(hits):.0%} hit")
        bars = panel.barh(names, means, xerr=[lows, highs], color="tab:blue", alpha=0.7)
        panel.bar_label(bars, labels, padding=4, fontsize=7)
        panel.invert_yaxis()
        panel.set_title(f"{workload}, {situation}, {load}", fontsize=9)
        panel.set_xlabel("TTFT p90 (ms)", fontsize=8)
        panel.tick_params(labelsize=7)
    for panel in list(axes.flat)[len(points) :]:
        panel.set_visible(False)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
