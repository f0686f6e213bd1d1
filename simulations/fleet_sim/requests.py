"""What the fleet simulator replays: requests as chains of prefix blocks.

A request is its prompt's blocks, each named by an id that stands for the whole prefix
up to and including it (the Mooncake trace's `hash_ids` convention: two requests share
a prefix exactly as far as their ids agree), its prompt and output lengths, its
arrival time and its tenant. Token contents never matter to a cache, so none are kept.

A request may follow another (`follows`, the other's id): then it is sent `after_s`
after that request's response ends, as a chat client sends its next turn, and its
`arrival_s` is only the earliest it could arrive (the other's arrival plus `after_s`),
which orders the workload; the simulator sets the real time. A request whose parent
is refused is never sent (the conversation cannot go on without the response).
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
    follows: int | None = None  # the request whose response this one waits for
    after_s: float = 0.0  # after that response ends


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    block_tokens: int  # tokens per block id
    requests: tuple[TraceRequest, ...]  # by arrival time (followers: their earliest)

    @property
    def closed_loop(self) -> bool:
        """Whether some request waits for another's response."""
        return any(request.follows is not None for request in self.requests)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0
