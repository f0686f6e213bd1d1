"""`kvplane sim`: one workload, every chosen policy on the same fleet, and the bounds."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from kvplane.core.config import ScoringSettings
from simulations.fleet_sim.bounds import infinite_cache_hit_rate, pooled_cache_hit_rate
from simulations.fleet_sim.policies import make_policy
from simulations.fleet_sim.report import PolicyFigures, figures
from simulations.fleet_sim.requests import Workload
from simulations.fleet_sim.simulator import FleetConfig, RunRecord, simulate


@dataclass(frozen=True, slots=True)
class Comparison:
    results: dict[str, PolicyFigures]
    bounds: dict[str, float]  # "pooled" and "infinite" hit rates
    seconds: dict[str, float]  # wall time per policy
    records: dict[str, RunRecord]


def compare(
    workload: Workload,
    config: FleetConfig,
    policies: Sequence[str],
    *,
    seed: int,
    show_progress: bool = False,
    scoring: ScoringSettings | None = None,
) -> Comparison:
    # A worker holds its device cache and its CPU tier (if any).
    per_worker = config.capacity_tokens + config.cpu_offload_blocks * workload.block_tokens
    bounds = {
        "pooled": pooled_cache_hit_rate(workload, config.workers * per_worker),
        "infinite": infinite_cache_hit_rate(workload),
    }
    results, seconds, records = {}, {}, {}
    for name in policies:
        policy = make_policy(
            name,
            seed=seed,
            block_tokens=workload.block_tokens,
            capacity_tokens=config.capacity_tokens,
            scoring=scoring,
        )
        started = time.perf_counter()
        progress = _progress_bar(name, len(workload.requests)) if show_progress else None
        record = simulate(workload, policy, config, progress)
        if show_progress:
            print(file=sys.stderr)
        seconds[name] = round(time.perf_counter() - started, 2)
        results[name] = figures(record, bounds["pooled"], bounds["infinite"])
        records[name] = record
    return Comparison(results, bounds, seconds, records)


def run_description(workload: Workload, config: FleetConfig, seed: int) -> dict[str, object]:
    return {
        "workload": workload.name,
        "requests": len(workload.requests),
        "block_tokens": workload.block_tokens,
        "seed": seed,
        **{key: value for key, value in asdict(config).items() if key not in {"timing", "limits"}},
        "timing": asdict(config.timing),
        "limits": asdict(config.limits),
    }


def _progress_bar(name: str, total: int) -> Callable[[int], None]:
    step = max(1, total // 50)

    def show(done: int) -> None:
        if done % step == 0 or done == total:
            filled = 30 * done // max(total, 1)
            bar = "#" * filled + "." * (30 - filled)
            print(f"\r{name:>14} [{bar}] {done}/{total}", end="", file=sys.stderr, flush=True)

    return show
