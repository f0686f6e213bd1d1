"""What kvplane's commands print their figures with: percentiles and aligned tables
(`kvplane demo`, `kvplane sim`, the benchmarks)."""

from __future__ import annotations

from collections.abc import Sequence


def percentile(samples: Sequence[float], share: float) -> float:
    """The nearest-rank percentile (`share` in 0..1); NaN without samples."""
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells as aligned columns, the first row a header with a rule under it:
    the first column left-aligned (names), the others right-aligned (figures)."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = []
    for number, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
        if number == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)
