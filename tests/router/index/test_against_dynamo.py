"""The in-memory index against NVIDIA Dynamo's own RadixTree (its Python bindings, from
`make dynamo-env`): the same stores, evictions and lookups through both, and every
lookup's per-worker prefix must agree. Dynamo keys its tree by each block's token hash
under its parent, kvplane by chained keys: agreement means both describe the same
fleet. (The benchmark, `kvplane bench index --against dynamo`, runs the same check on a
fleet of 1.5 million entries.)"""

from __future__ import annotations

import pytest

from benchmarks.index import (
    BLOCK_SIZE,
    DYNAMO_HINT,
    DynamoIndex,
    DynamoUnavailable,
    KvplaneIndex,
    build_fleet,
    compare,
)
from router.index.base import LocationIndex
from router.index.memory import MemoryLocationIndex
from tests import heavy

pytestmark = pytest.mark.heavy("dynamo")


def _dynamo() -> DynamoIndex:
    heavy.require("dynamo")
    try:
        return DynamoIndex()
    except DynamoUnavailable:
        pytest.fail(f"Dynamo's bindings are missing: {DYNAMO_HINT}")


async def _memory() -> LocationIndex:
    return MemoryLocationIndex()


@pytest.mark.parametrize("workers", [3, 16])
async def test_every_lookup_agrees_with_dynamos_radix_tree(workers: int) -> None:
    dynamo = _dynamo()
    fleet = build_fleet(
        workers=workers, entries=40_000, lookups=150, seed=workers, token_hashes=True
    )
    assert fleet.removed_blocks > 0  # removals are compared too
    sides: list[KvplaneIndex | DynamoIndex] = [KvplaneIndex("memory", _memory), dynamo]
    for side in sides:
        side.prepare(fleet)
    report = await compare(fleet, sides, {"memory": 0, "dynamo": 0}, repeats=1)
    assert report.agreed_lookups == len(fleet.lookups)
    # Not a vacuous agreement: lookups found deep prefixes on several workers.
    memory = next(row for row in report.indexes if row.index == "memory")
    assert memory.entries == fleet.entries > 30_000
    longest = 0
    side = KvplaneIndex("memory", _memory)
    side.prepare(fleet)
    await side.fill(fleet)
    for tokens in fleet.lookups[:30]:
        matched, _, _ = await side.lookup(tokens)
        longest = max(longest, *matched.values(), 0)
    assert longest * BLOCK_SIZE >= 8192
    await side.close()
