"""What the fleet simulator replays: requests as chains of prefix blocks.

A request is its prompt's blocks, each named by an id that stands for the whole prefix
up to and including it (the Mooncake trace's `hash_ids` convention: two requests share
a prefix exactly as far as their ids agree), its prompt and output lengths, its
arrival time and its tenant. Token contents never matter to a cache, so none are kept.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_id: int
    arrival_s: float
    blocks: tuple[int, ...]  # prefix-chain ids, one per (possibly partial) prompt block
    prompt_tokens: int  # len(blocks) == ceil(prompt_tokens / block_tokens)
    output_tokens: int
    tenant: str = ""


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    block_tokens: int  # tokens per block id
    requests: tuple[TraceRequest, ...]  # by arrival time

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0
