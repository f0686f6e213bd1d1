"""`kvplane sim --plot DIR`: PNG charts of a comparison (matplotlib, no display)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from simulations.fleet_sim.report import PolicyFigures
from simulations.fleet_sim.simulator import RunRecord


def write_plots(
    directory: Path,
    results: Mapping[str, PolicyFigures],
    bounds: Mapping[str, float],
    records: Mapping[str, RunRecord],
) -> list[Path]:
    """ttft.png, hit_rate.png and load_<policy>.png in `directory`; their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    names = list(results)
    written = []

    figure, axes = plt.subplots(figsize=(8, 4.5))
    width = 0.27
    for offset, (label, attribute) in enumerate(
        (("p50", "ttft_p50_s"), ("p90", "ttft_p90_s"), ("p99", "ttft_p99_s"))
    ):
        values = [getattr(results[name], attribute) for name in names]
        axes.bar([i + (offset - 1) * width for i in range(len(names))], values, width, label=label)
    axes.set_xticks(range(len(names)), names)
    axes.set_ylabel("time to first token (s)")
    axes.set_title("TTFT percentiles per policy")
    axes.legend()
    written.append(_save(figure, directory / "ttft.png"))

    figure, axes = plt.subplots(figsize=(8, 4.5))
    axes.bar(names, [results[name].hit_rate for name in names], color="tab:green")
    for label, style in zip(bounds, ("--", ":"), strict=False):
        axes.axhline(bounds[label], linestyle=style, color="black", label=f"{label} bound")
    axes.set_ylabel("cache hit rate (token-weighted)")
    axes.set_ylim(0, 1)
    axes.set_title("Cache hit rate per policy")
    axes.legend()
    written.append(_save(figure, directory / "hit_rate.png"))

    for name, record in records.items():
        figure, axes = plt.subplots(figsize=(9, 4.5))
        workers = sorted({worker for _, worker, _ in record.load_samples})
        for worker in workers:
            points = [(t, load) for t, w, load in record.load_samples if w == worker]
            axes.plot([t for t, _ in points], [load for _, load in points], linewidth=0.8)
        axes.set_xlabel("simulated time (s)")
        axes.set_ylabel("requests running or waiting")
        axes.set_title(f"Per-worker load over time: {name}")
        written.append(_save(figure, directory / f"load_{name}.png"))
    return written


def _save(figure: Figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
