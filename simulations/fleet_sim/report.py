"""A run's figures, as the issue's JSON names them, and the table `kvplane sim` prints."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from simulations.fleet_sim.simulator import RunRecord
from simulations.reporting import format_table, percentile


@dataclass(frozen=True, slots=True)
class PolicyFigures:
    hit_rate: float  # cached prompt tokens / prompt tokens, over requests that started
    pooled_fraction: float  # of one pooled cache of the fleet's capacity
    ceiling_fraction: float  # of an infinite cache
    prefill_tokens_saved: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    output_tokens_per_s: float
    load_imbalance: float  # max over mean of the tokens each worker computed
    preemptions: int
    requests: int
    rejected: int
    # The engines' counters' hit rate (hits / queries over every lookup, a waiting
    # request's retries and a preempted one's included; hits on the device, plus those
    # read back from a CPU tier): what `kvplane bench live` reports as the engines' hit
    # rate (`hit_rate` is what its clients see, CPU-tier hits included too).
    engine_hit_rate: float = 0.0


def figures(record: RunRecord, pooled_hit_rate: float, ceiling_hit_rate: float) -> PolicyFigures:
    started = [o for o in record.outcomes if o.first_token_s is not None]
    finished = [o for o in started if o.finished_s is not None]
    prompt = sum(o.prompt_tokens for o in started)
    cached = sum(o.cached_tokens for o in started)
    hit_rate = cached / prompt if prompt else 0.0
    ttft = [o.first_token_s - o.arrival_s for o in started if o.first_token_s is not None]
    e2e = [o.finished_s - o.arrival_s for o in finished if o.finished_s is not None]
    first_arrival = record.outcomes[0].arrival_s if record.outcomes else 0.0
    span = max(record.end_s - first_arrival, 1e-9)
    work = record.worker_work
    mean_work = sum(work) / len(work) if work else 0.0
    return PolicyFigures(
        hit_rate=round(hit_rate, 4),
        pooled_fraction=round(hit_rate / pooled_hit_rate, 4) if pooled_hit_rate else 0.0,
        ceiling_fraction=round(hit_rate / ceiling_hit_rate, 4) if ceiling_hit_rate else 0.0,
        prefill_tokens_saved=cached,
        ttft_mean_s=round(sum(ttft) / len(ttft), 4) if ttft else 0.0,
        ttft_p50_s=round(percentile(ttft, 0.5), 4),
        ttft_p90_s=round(percentile(ttft, 0.9), 4),
        ttft_p99_s=round(percentile(ttft, 0.99), 4),
        e2e_p50_s=round(percentile(e2e, 0.5), 4),
        e2e_p99_s=round(percentile(e2e, 0.99), 4),
        output_tokens_per_s=round(sum(o.output_tokens for o in finished) / span, 1),
        load_imbalance=round(max(work) / mean_work, 4) if mean_work else 0.0,
        preemptions=record.preemptions,
        requests=len(record.outcomes),
        rejected=sum(1 for o in record.outcomes if o.rejected),
        engine_hit_rate=(
            round((record.cache_hits + record.external_hits) / record.cache_queries, 4)
            if record.cache_queries
            else 0.0
        ),
    )


def as_json(
    results: dict[str, PolicyFigures], bounds: dict[str, float], run: dict[str, Any]
) -> dict[str, Any]:
    return {
        "run": run,
        "bounds": bounds,
        "policies": {name: asdict(result) for name, result in results.items()},
    }


def render_table(results: dict[str, PolicyFigures], bounds: dict[str, float]) -> str:
    header = (
        "policy", "hit rate", "of pooled", "of ceiling", "engine hit", "TTFT mean", "p50",
        "p90", "p99", "e2e p50", "p99", "out tok/s", "imbalance", "preempt",
    )  # fmt: skip
    rows: list[tuple[str, ...]] = [header]
    for name, r in results.items():
        rows.append(
            (
                name,
                f"{r.hit_rate:.1%}",
                f"{r.pooled_fraction:.0%}",
                f"{r.ceiling_fraction:.0%}",
                f"{r.engine_hit_rate:.1%}",
                f"{r.ttft_mean_s:.2f}s",
                f"{r.ttft_p50_s:.2f}s",
                f"{r.ttft_p90_s:.2f}s",
                f"{r.ttft_p99_s:.2f}s",
                f"{r.e2e_p50_s:.1f}s",
                f"{r.e2e_p99_s:.1f}s",
                f"{r.output_tokens_per_s:,.0f}",
                f"{r.load_imbalance:.2f}",
                str(r.preemptions),
            )
        )
    for name, rate in bounds.items():
        rows.append((f"({name})", f"{rate:.1%}", *([""] * (len(header) - 2))))
    return format_table(rows)


def render_sweep(
    setting: str, values: Sequence[float], results: Sequence[dict[str, PolicyFigures]], slo: float
) -> str:
    """TTFT p90 (and hit rate) per policy at each value; a * marks meeting the SLO. The
    last lines say, per policy, which values met it (for a fleet size: the smallest
    is the answer; for a rate: the largest)."""
    policies = list(results[0])
    header = (setting, *policies)
    rows = [header]
    for value, by_policy in zip(values, results, strict=True):
        cells = [f"{value:g}"]
        for name in policies:
            figures = by_policy[name]
            mark = "*" if figures.ttft_p90_s <= slo else " "
            cells.append(f"{figures.ttft_p90_s:.2f}s{mark} {figures.hit_rate:.0%}")
        rows.append(tuple(cells))
    lines = [format_table(rows)]
    lines.append(f"cells: TTFT p90, then hit rate; * meets the TTFT p90 SLO of {slo:g} s")
    for name in policies:
        met = [f"{v:g}" for v, r in zip(values, results, strict=True) if r[name].ttft_p90_s <= slo]
        lines.append(f"{name}: meets it at {', '.join(met) if met else 'none of these'}")
    return "\n".join(lines)
