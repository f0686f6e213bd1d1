"""Hit-rate bounds of a workload, token-weighted: what no router can beat.

Both bounds replay the requests in arrival order through one cache shared by the whole
fleet, as if every request could be served where every earlier request's blocks are.

- `infinite_cache_hit_rate`: nothing is ever evicted. The reuse ceiling of the workload.
- `pooled_cache_hit_rate`: one LRU cache of a given size (a pooled cache of the fleet's
  total capacity, as in Mooncake's global cache). The reference for a fleet of separate
  caches of that total size: they hold no more distinct blocks, and any copies hold
  fewer. LRU is not an optimal replacement policy, though, so this is a yardstick, not a
  strict bound: a fleet whose routing partitions the traffic can now and then beat it.

A request hits the longest run of its leading blocks that the cache holds; a block after
a miss never counts (its id names a prefix whose earlier part must be recomputed).
Token weight: a full block counts `block_tokens`, the last partial block its actual
tokens. Like vLLM, which always computes the last prompt token to get the first output
token's logits, a fully cached prompt still recomputes one token: with
`cap_last_token` (the default) a request's hit is at most `prompt_tokens - 1`. The
figures published for the Mooncake trace (../shared/traces/README.md) don't cap:
with `cap_last_token=False` these functions reproduce them (infinite 37.36% of tokens;
LRU of 1e5, 1e6, 3e6, 1e7, 5e7 tokens: 0.042, 0.054, 0.138, 0.291, 0.371).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from simulations.fleet_sim.requests import TraceRequest, Workload


def _in_order(workload: Workload) -> list[TraceRequest]:
    return sorted(workload.requests, key=lambda r: r.arrival_s)


def _leading_hits(blocks: tuple[int, ...], cache: Container[int]) -> int:
    hits = 0
    for block in blocks:
        if block not in cache:
            break
        hits += 1
    return hits


def _hit_tokens(request: TraceRequest, hits: int, block_tokens: int, cap: bool) -> int:
    tokens = request.prompt_tokens if hits == len(request.blocks) else hits * block_tokens
    return min(tokens, request.prompt_tokens - 1) if cap else tokens


def _rate(hit: int, total: int) -> float:
    return hit / total if total else 0.0


def infinite_cache_hit_rate(workload: Workload, *, cap_last_token: bool = True) -> float:
    """Share of prompt tokens an infinite cache shared by the fleet could serve."""
    seen: set[int] = set()
    hit = total = 0
    for request in _in_order(workload):
        hits = _leading_hits(request.blocks, seen)
        hit += _hit_tokens(request, hits, workload.block_tokens, cap_last_token)
        total += request.prompt_tokens
        seen.update(request.blocks)
    return _rate(hit, total)


def pooled_cache_hit_rate(
    workload: Workload, capacity_tokens: int, *, cap_last_token: bool = True
) -> float:
    """Share of prompt tokens one shared LRU cache of `capacity_tokens` could serve.

    The capacity is whole blocks (`capacity_tokens // block_tokens`); a partial block
    takes a whole block's room, as in a paged KV cache. Per request, in arrival order:
    look up the longest cached prefix, then insert or refresh all of the request's
    blocks in order (the most recently used block being the request's last), evicting
    the least recently used blocks beyond capacity. A request longer than the cache
    evicts its own first blocks.
    """
    if capacity_tokens < 0:
        raise ValueError("capacity_tokens must be non-negative")
    capacity = capacity_tokens // workload.block_tokens
    lru: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for request in _in_order(workload):
        hits = _leading_hits(request.blocks, lru)
        hit += _hit_tokens(request, hits, workload.block_tokens, cap_last_token)
        total += request.prompt_tokens
        if capacity == 0:
            continue
        for block in request.blocks:
            if block in lru:
                lru.move_to_end(block)
            else:
                lru[block] = None
                if len(lru) > capacity:
                    lru.popitem(last=False)
    return _rate(hit, total)
