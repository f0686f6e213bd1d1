"""Continuous batching, as vLLM v1's scheduler does it (first come, first served).

Each step has a budget of `max_num_batched_tokens`. Running requests are served first:
one token each while decoding, the next chunk while still reading a long prompt. When a
running request cannot get a block, the most recently admitted running request is
preempted: its blocks are freed and it goes back to the front of the waiting queue, to be
recomputed later (its blocks may still be in the prefix cache then). Waiting requests are
admitted while there is budget, fewer than `max_num_seqs` run and their blocks fit; the
first one that does not fit waits, and so does everyone behind it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from simulations.engine_sim.kv_cache_manager import CacheRequest, KVCacheManager
from simulations.engine_sim.request import RequestStatus, SimRequest
from simulations.engine_sim.timing import StepWork


class ScheduledRequest(CacheRequest, Protocol):
    """What the scheduler reads and changes of a request (besides the cache's part)."""

    status: RequestStatus
    num_computed_tokens: int
    num_cached_tokens: int | None
    num_preemptions: int

    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def is_finished(self) -> bool: ...
    def append_output(self, token_id: int) -> None: ...


R = TypeVar("R", bound=ScheduledRequest)


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192


@dataclass(slots=True)
class ScheduledStep(Generic[R]):
    tokens: dict[R, int] = field(default_factory=dict)
    work: StepWork = field(default_factory=StepWork)
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.tokens


@dataclass(frozen=True, slots=True)
class RequestProgress(Generic[R]):
    """What a step did for one request: its new token (if any) and whether it is done."""

    request: R
    new_token_id: int
    finished: bool


class RequestTooLarge(ValueError):
    """The request could never run: even alone it needs more blocks than the cache has."""


class Scheduler(Generic[R]):
    def __init__(
        self,
        kv_cache: KVCacheManager,
        limits: SchedulerLimits,
        sample_token: Callable[[R], int],
    ) -> None:
        self.kv_cache = kv_cache
        self.limits = limits
        self._sample_token = sample_token
        self.waiting: deque[R] = deque()
        self.running: list[R] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def check_fits(self, num_tokens: int) -> None:
        """RequestTooLarge if a request of `num_tokens` (prompt and output) could never
        run. A real engine sizes its context length to its cache; a simulator may be given
        a tiny cache on purpose, and such a request would wait for ever."""
        needed = self.kv_cache.blocks_needed(num_tokens)
        if needed > self.kv_cache.pool.num_blocks:
            raise RequestTooLarge(
                f"The request needs {needed} KV blocks but the cache has "
                f"{self.kv_cache.pool.num_blocks}."
            )

    def add(self, request: R) -> None:
        """Queue a request; RequestTooLarge (and nothing queued) if it can never fit."""
        self.check_fits(request.num_prompt_tokens + request.max_tokens)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def abort(self, request: R) -> None:
        """Drop a request wherever it is (client gone, engine restarting)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.ABORTED

    def schedule(self) -> ScheduledStep[R]:
        step: ScheduledStep[R] = ScheduledStep()
        budget = self.limits.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            count = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, count, step):
                break  # the request itself was preempted
            step.tokens[request] = count
            budget -= count
            index += 1

        # vLLM admits nobody in a step that had to preempt: memory is short.
        while (
            not step.num_preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.limits.max_num_seqs
        ):
            request = self.waiting[0]
            hits = self.kv_cache.cached_prefix(request)
            cached_tokens = len(hits) * self.kv_cache.block_size
            count = min(request.num_tokens - cached_tokens, budget)
            if not self.kv_cache.allocate_slots(request, count, hits):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = cached_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = min(cached_tokens, request.num_prompt_tokens)
            self.running.append(request)
            step.tokens[request] = count
            budget -= count

        step.work = self._work(step)
        return step

    def finish_step(self, step: ScheduledStep[R]) -> list[RequestProgress[R]]:
        """Apply a step's computation: advance requests, sample tokens, retire the done."""
        progress = []
        for request, count in step.tokens.items():
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += count
            if request.num_computed_tokens < request.num_tokens:
                continue  # a chunk of a long prompt: no token yet
            token_id = self._sample_token(request)
            request.append_output(token_id)
            finished = request.is_finished
            if finished:
                self.running.remove(request)
                self.kv_cache.free(request)
                request.status = RequestStatus.FINISHED
            progress.append(RequestProgress(request, token_id, finished))
        return progress

    def _allocate_or_preempt(self, request: R, count: int, step: ScheduledStep[R]) -> bool:
        while not self.kv_cache.allocate_slots(request, count):
            victim = self.running.pop()
            self.kv_cache.free(victim)
            victim.status = RequestStatus.PREEMPTED
            victim.num_computed_tokens = 0
            victim.num_preemptions += 1
            self.waiting.appendleft(victim)
            step.num_preempted += 1
            self.num_preemptions += 1
            if victim is request:
                return False
        return True

    @staticmethod
    def _work(step: ScheduledStep[R]) -> StepWork:
        prefill = decode_requests = decode_context = 0
        for request, count in step.tokens.items():
            # Decoding: the prompt (and any recomputed output) is in the cache, and the
            # step computes the one newest token.
            if count == 1 and request.num_computed_tokens >= request.num_prompt_tokens:
                decode_requests += 1
                decode_context += request.num_tokens
            else:
                prefill += count
        return StepWork(prefill, decode_requests, decode_context)


def sampler_over(token_ids: list[int]) -> Callable[[SimRequest], int]:
    """Deterministic output: each request draws from its own generator (seeded by the
    server), over tokens that decode cleanly one at a time."""

    def sample(request: SimRequest) -> int:
        return request.rng.choice(token_ids)

    return sample
