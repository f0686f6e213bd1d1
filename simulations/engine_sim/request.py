"""One request as the engine sees it: token ids in, token ids out, and its progress."""

from __future__ import annotations

import enum
import random
from dataclasses import InitVar, dataclass, field

from simulations.engine_sim.block_hash import BlockHasher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # A P/D decode leg holding its blocks while its KV arrives (vLLM's status).
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    block_size: InitVar[int]
    hash_root: InitVar[bytes]
    lora_name: str | None = None
    cache_salt: str | None = None
    arrival_time: float = 0.0
    # Lower is served first, with --scheduling-policy priority (vLLM's field).
    priority: int = 0
    sampling_seed: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache when first scheduled (usage.cached_tokens).
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    # The prefill leg of a P/D pair: its blocks are lent when it finishes (their ids
    # then), for the decode engine to pull.
    remote_decode: bool = False
    lent_block_ids: list[int] | None = None
    # The decode leg of a P/D pair: of its cached tokens when first scheduled (or when
    # its KV load started), how many the load brought (vLLM's external tokens, not local
    # prefix-cache hits; set then for every request, 0 without a load).
    num_external_tokens: int | None = None
    # What the prefill engine's answer said it found cached, which a decode leg reports
    # as its usage's cached tokens instead of its own (vLLM's output processor).
    remote_prefill_cached_tokens: int | None = None
    hasher: BlockHasher = field(init=False)
    rng: random.Random = field(init=False)

    def __post_init__(self, block_size: int, hash_root: bytes) -> None:
        self.hasher = BlockHasher(block_size, hash_root, self.lora_name, self.cache_salt)
        self.hasher.update(self.prompt_token_ids)
        self.rng = random.Random(self.sampling_seed)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def block_digests(self) -> list[bytes]:
        return self.hasher.digests

    @property
    def usage_cached_tokens(self) -> int:
        """`usage.prompt_tokens_details.cached_tokens`: the prefill engine's hits for a
        decode leg whose parameters name them, else this engine's (local and pulled)."""
        if self.remote_prefill_cached_tokens is not None:
            return self.remote_prefill_cached_tokens
        return self.num_cached_tokens or 0

    @property
    def is_finished(self) -> bool:
        return len(self.output_token_ids) >= self.max_tokens

    @property
    def scope(self) -> str:
        """Which cache scope the request's blocks belong to (LoRA and salt)."""
        return f"{self.lora_name or ''}/{self.cache_salt or ''}"

    def block_extra_keys(self, index: int) -> tuple[str, ...] | None:
        return self.hasher.extra_keys(index)

    def token_ids_between(self, start: int, stop: int) -> list[int]:
        prompt = self.prompt_token_ids
        if stop <= len(prompt):
            return prompt[start:stop]
        return (prompt + self.output_token_ids)[start:stop]

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if self.num_tokens % self.hasher.block_size == 0:
            self.hasher.update(self.prompt_token_ids + self.output_token_ids)


def priority_order(request: SimRequest) -> tuple[int, float]:
    """Where a request waits with --scheduling-policy priority: by its priority (lower
    first), then by its arrival, as vLLM orders them."""
    return request.priority, request.arrival_time
