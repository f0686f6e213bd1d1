"""`kvplane bench policies`: kvplane's routing policy against every other policy in
the fleet simulator, over a grid of workloads and arrival rates.

At each point every policy routes the same requests on the same fleet; the question
asked (issue 7): wherever any policy meets the TTFT p90 objective (2 s by default),
does kvplane have the lowest TTFT p90? `--scoring KEY=VALUE` changes one of kvplane's
weights (a field of [scoring]) for the whole grid, which is how its defaults were
chosen. Points run two at a time, one per core of the machines this project runs on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvplane.core.config import ScoringSettings
from simulations.engine_sim.timing import TimingModel
from simulations.fleet_sim.policies import POLICIES
from simulations.fleet_sim.report import PolicyFigures
from simulations.fleet_sim.requests import Workload
from simulations.fleet_sim.roofline import read_roofline_timing
from simulations.fleet_sim.run import compare
from simulations.fleet_sim.simulator import FleetConfig
from simulations.fleet_sim.workloads import WORKLOADS, load_trace
from simulations.reporting import format_table

_ROOT = Path(__file__).resolve().parents[1]
_MOONCAKE = _ROOT / "simulations" / "traces" / "mooncake" / "conversation_trace.jsonl"
_AZURE_CODE = _ROOT / "simulations" / "traces" / "azure2023" / "AzureLLMInferenceTrace_code.csv"
_QWEN3_32B = _ROOT / "simulations" / "models" / "qwen3-32b.json"


@dataclass(frozen=True, slots=True)
class Series:
    """One workload at several arrival rates, on one fleet."""

    workload: str  # a generator's name, or `trace:<path>`
    rate_setting: str  # the generator's rate argument, or `speedup` for a trace
    rates: tuple[float, ...]
    workers: int
    capacity_tokens: int
    workload_args: dict[str, float] = field(default_factory=dict)
    model_config: Path | None = None  # time steps by this model's roofline (2 x H100)

    @property
    def name(self) -> str:
        return Path(self.workload.removeprefix("trace:")).stem

    def build(self, rate: float) -> tuple[Workload, FleetConfig]:
        if self.workload.startswith("trace:"):
            workload = load_trace(Path(self.workload.removeprefix("trace:")), speedup=rate)
        else:
            args = {**self.workload_args, self.rate_setting: rate}
            workload = WORKLOADS[self.workload](seed=0, **args)
        timing = TimingModel()
        if self.model_config is not None:
            timing = read_roofline_timing(self.model_config, "h100", tensor_parallel=2)
        return workload, FleetConfig(self.workers, self.capacity_tokens, timing=timing)


GRID = (
    Series("shared-prefix", "rate_per_s", (10, 20, 40, 80), 8, 400_000),
    Series("multi-turn", "rate_per_s", (1, 2, 4), 8, 400_000),
    Series("agent-tree", "rate_per_s", (1, 2, 4), 8, 400_000),
    Series("multi-tenant", "rate_per_s", (10, 20, 40), 8, 400_000),
    Series(
        "llmd-prefix",
        "rate_end",
        (10, 20),
        8,
        307_328,
        workload_args={"rate_start": 1.0, "duration_s": 300.0},
        model_config=_QWEN3_32B,
    ),
    Series(f"trace:{_MOONCAKE}", "speedup", (1.0, 1.5), 10, 3_000_000),
    Series(f"trace:{_AZURE_CODE}", "speedup", (1.0, 2.0), 4, 400_000),
)


def _run_point(
    series: Series, rate: float, scoring: ScoringSettings
) -> tuple[str, float, dict[str, PolicyFigures], float]:
    started = time.perf_counter()
    workload, config = series.build(rate)
    comparison = compare(workload, config, POLICIES, seed=0, scoring=scoring)
    return series.name, rate, comparison.results, time.perf_counter() - started


def _verdict(results: dict[str, PolicyFigures], slo_s: float) -> tuple[str, str, str]:
    """The best other policy and its TTFT p90, and kvplane's standing."""
    others = {name: f.ttft_p90_s for name, f in results.items() if name != "kvplane"}
    rival = min(others, key=lambda name: others[name])
    ours = results["kvplane"].ttft_p90_s
    if min(ours, others[rival]) > slo_s:
        standing = "none meets the SLO"
    elif ours <= others[rival]:
        standing = "kvplane best"
    else:
        standing = f"{rival} best, kvplane +{100 * (ours / others[rival] - 1):.0f}%"
    return rival, f"{others[rival]:.2f}", standing


def run_policy_grid(
    *,
    json_path: Path | None,
    scoring_overrides: dict[str, float],
    only: Sequence[str] = (),
    grid: Sequence[Series] = GRID,
    slo_ttft_p90_s: float = 2.0,
    processes: int = 2,
    report: Callable[[str], None] = print,
) -> int:
    scoring = ScoringSettings.model_validate(scoring_overrides)
    series = [s for s in grid if not only or s.name in only]
    if not series:
        raise ValueError(f"no workload called {', '.join(only)} (known: {_names(grid)})")
    points = [(s, rate) for s in series for rate in s.rates]
    with ProcessPoolExecutor(max_workers=processes) as pool:
        runs = list(pool.map(_run_point, *zip(*points, strict=True), [scoring] * len(points)))
    rows = [["workload", "rate", "kvplane p90 s", "best other", "its p90 s", "hit kvplane/best",
             "standing", "wall s"]]  # fmt: skip
    document = []
    for name, rate, results, seconds in runs:
        rival, rival_p90, standing = _verdict(results, slo_ttft_p90_s)
        hits = f"{results['kvplane'].hit_rate:.1%}/{results[rival].hit_rate:.1%}"
        ours = f"{results['kvplane'].ttft_p90_s:.2f}"
        rows.append([name, f"{rate:g}", ours, rival, rival_p90, hits, standing, f"{seconds:.0f}"])
        document.append(
            {
                "workload": name,
                "rate": rate,
                "standing": standing,
                "policies": {policy: asdict(f) for policy, f in results.items()},
            }
        )
    report(f"kvplane's scoring: {scoring_overrides or 'defaults'}; TTFT p90 SLO {slo_ttft_p90_s} s")
    report(format_table(rows))
    if json_path is not None:
        scores = {"scoring": scoring.model_dump(), "points": document}
        json_path.write_text(json.dumps(scores, indent=2) + "\n")
    return 0


def _names(grid: Sequence[Series]) -> str:
    return ", ".join(series.name for series in grid)
