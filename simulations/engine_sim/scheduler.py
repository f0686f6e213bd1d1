"""Continuous batching, as vLLM v1's scheduler does it (vLLM 0.32's
`v1/core/sched/scheduler.py`), first come, first served or by priority.

Each step has a budget of `max_num_batched_tokens`. Running requests are served first:
one token each while decoding, the next chunk while still reading a long prompt. When a
running request cannot get a block, the most recently admitted running request is
preempted: its blocks are freed and it goes back to the front of the waiting queue, to be
recomputed later (its blocks may still be in the prefix cache then). Waiting requests are
admitted while there is budget, fewer than `max_num_seqs` run and their blocks fit; the
first one that does not fit waits, and so does everyone behind it.

P/D decode legs load their prompt's KV from the prefill engine as vLLM's scheduler loads
a connector's asynchronous KV: when such a request's turn comes, it is given blocks for
its local hits and for the blocks it will receive (nothing to compute yet), or, if they
do not fit, it waits like any request; it then holds them, waiting for its KV
(`WAITING_FOR_REMOTE_KVS`, neither running nor preemptible), while the engine transfers
it. When the load ends, the received blocks enter the prefix cache the next time the
scheduler reaches the request, and it is scheduled for the rest of its prompt before
anyone still waiting.

A connector that holds KV of its own (a `KVLoader`: the CPU tier of offload.py) is asked,
as vLLM asks its connector, how many blocks past a new request's local hit it can load;
those load the same way. While it cannot tell yet, the request is passed over this step
(vLLM's `skip_request`) and keeps its place.

With a priority order (vLLM's `--scheduling-policy priority`), both waiting queues are
kept in (priority, arrival) order, lowest first, preempted requests included (vLLM's
`PriorityRequestQueue`); and when a running request cannot get a block, the running
request with the largest (priority, arrival) is preempted instead of the latest admitted,
even one the step had scheduled already, which gives its tokens back. As in vLLM, a
waiting request never preempts a running one: with `max_num_seqs` running or its blocks
short, it waits, whatever its priority.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from simulations.engine_sim.block_pool import KVBlock
from simulations.engine_sim.kv_cache_manager import CacheRequest, KVCacheManager
from simulations.engine_sim.metrics import (
    KV_FETCH_COMPLETED_WAITING,
    KV_FETCH_IN_PROGRESS,
    KV_FETCH_WAITING_TO_START,
)
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
R_contra = TypeVar("R_contra", contravariant=True)


class KVLoader(Protocol[R_contra]):
    """A connector's answers, in blocks (vLLM's `get_num_new_matched_tokens` and
    `update_state_after_alloc`)."""

    def blocks_to_load(self, request: R_contra, num_local_blocks: int) -> int | None:
        """Blocks after the local hit the connector can load; None: ask again later."""
        ...

    def load_started(self, request: R_contra, num_local_blocks: int, num_blocks: int) -> None: ...


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192


@dataclass(slots=True)
class ScheduledStep(Generic[R]):
    tokens: dict[R, int] = field(default_factory=dict)
    work: StepWork = field(default_factory=StepWork)
    num_preempted: int = 0
    # Decode legs whose KV load the step started, with the blocks to read (0: a full
    # local hit, nothing to read; the request is scheduled as any other).
    kv_loads: dict[R, int] = field(default_factory=dict)

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


# A request's place in priority scheduling: its (priority, arrival time), as vLLM's
# `Request.__lt__` orders them (it then breaks ties by request id; the simulator by
# arrival in the queue).
PriorityOrder = Callable[[R], tuple[int, float]]


class Scheduler(Generic[R]):
    def __init__(
        self,
        kv_cache: KVCacheManager,
        limits: SchedulerLimits,
        sample_token: Callable[[R], int],
        loader: KVLoader[R] | None = None,
        priority_order: PriorityOrder[R] | None = None,
    ) -> None:
        """`priority_order`: schedule by priority (vLLM's `--scheduling-policy
        priority`) in this order; None: first come, first served (vLLM's default)."""
        self.kv_cache = kv_cache
        self.limits = limits
        self._sample_token = sample_token
        self._loader = loader
        self._priority_order = priority_order
        self.waiting: deque[R] = deque()
        self.running: list[R] = []
        self.num_preemptions = 0
        # P/D decode legs: loading their KV (holding blocks), and done loading, which are
        # served before `waiting` (vLLM's kv_holding_waiting); their KV-fetch stages.
        self.loading: list[R] = []
        self.loaded: deque[R] = deque()
        self.kv_fetch_stages: dict[R, str] = {}
        # Waiting requests with a load to start: how many prompt blocks it can bring.
        self._remote_blocks: dict[R, int] = {}
        # Aborted while loading: their blocks are freed when the transfer ends.
        self._aborted_loads: set[R] = set()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loaded)

    @property
    def num_waiting(self) -> int:
        """vLLM's waiting count: every request not running, loading ones included."""
        return len(self.waiting) + len(self.loading) + len(self.loaded)

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

    def add(self, request: R, remote_blocks: int | None = None) -> None:
        """Queue a request; RequestTooLarge (and nothing queued) if it can never fit.
        `remote_blocks`: a P/D decode leg, whose first `remote_blocks` prompt blocks a
        KV load can bring (those it does not hold when its turn comes)."""
        self.check_fits(request.num_prompt_tokens + request.max_tokens)
        request.status = RequestStatus.WAITING
        self._enqueue(self.waiting, request)
        if remote_blocks is not None:
            self._remote_blocks[request] = remote_blocks

    def abort(self, request: R) -> None:
        """Drop a request wherever it is (client gone, engine restarting). One whose KV
        is still arriving keeps its blocks until the transfer ends (`finish_load`), as
        vLLM frees them only then."""
        self._remote_blocks.pop(request, None)
        self.kv_fetch_stages.pop(request, None)
        request.status = RequestStatus.ABORTED
        if request in self.loading:
            self.loading.remove(request)
            self._aborted_loads.add(request)
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.loaded:
            self.loaded.remove(request)
        self.kv_cache.free(request)

    def finish_load(self, request: R, *, failed: bool = False) -> None:
        """A decode leg's KV load ended. It waits to be scheduled, before the waiting
        queue; the received blocks are cached when the scheduler reaches it. A `failed`
        load (vLLM's recompute policy) gives up its blocks then, and the request is
        scheduled anew, with no load, computing what its own cache lacks."""
        if self._end_aborted_load(request):
            return
        self.loading.remove(request)
        if failed:
            request.num_computed_tokens = 0
        self.kv_fetch_stages[request] = KV_FETCH_COMPLETED_WAITING
        self._enqueue(self.loaded, request)

    def fail_load(self, request: R) -> None:
        """A decode leg's KV load failed and so does the request (vLLM's fail policy):
        its blocks are freed."""
        if self._end_aborted_load(request):
            return
        self.loading.remove(request)
        self.kv_fetch_stages.pop(request, None)
        self.kv_cache.free(request)
        request.status = RequestStatus.FINISHED

    def free_aborted_loads(self) -> None:
        """Free the blocks of aborted requests whose transfer will not end (a restart)."""
        for request in self._aborted_loads:
            self.kv_cache.free(request)
        self._aborted_loads.clear()

    def schedule(self) -> ScheduledStep[R]:
        step: ScheduledStep[R] = ScheduledStep()
        budget = self.limits.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            count = min(request.num_tokens - request.num_computed_tokens, budget)
            given_back = self._allocate_or_preempt(request, count, step)
            if given_back is None:
                break  # the request itself was preempted
            step.tokens[request] = count
            # Requests scheduled earlier in the step and then preempted (priority mode)
            # give back their tokens, and their places before this one.
            budget += sum(given_back) - count
            index += 1 - len(given_back)

        passed_over: list[R] = []
        # vLLM admits nobody in a step that had to preempt: memory is short.
        while (
            not step.num_preempted
            and budget > 0
            and len(self.running) < self.limits.max_num_seqs
            and (self.loaded or self.waiting)
        ):
            queue = self.loaded or self.waiting
            request = queue[0]
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                self._take_loaded_kv(request)
            hits: Sequence[KVBlock] = ()
            computed = request.num_computed_tokens  # > 0: a decode leg's arrived KV
            if not computed:
                hits = self.kv_cache.cached_prefix(request)
                computed = len(hits) * self.kv_cache.block_size
                to_load = self._blocks_to_load(request, len(hits))
                if to_load is None:
                    passed_over.append(queue.popleft())
                    continue
                self.kv_cache.record_lookup(request, hits)
                if to_load:
                    if not self._start_load(request, hits, to_load, step):
                        break
                    queue.popleft()
                    continue
            count = min(request.num_tokens - computed, budget)
            if not self.kv_cache.allocate_slots(request, count, hits):
                break
            queue.popleft()
            if self._remote_blocks.pop(request, None) is not None:
                step.kv_loads[request] = 0  # held every block: nothing to read
            self.kv_fetch_stages.pop(request, None)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = computed
            if request.num_cached_tokens is None:
                request.num_cached_tokens = min(computed, request.num_prompt_tokens)
            self.running.append(request)
            step.tokens[request] = count
            budget -= count

        self.waiting.extendleft(reversed(passed_over))
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

    def _blocks_to_load(self, request: R, num_hits: int) -> int | None:
        remote_blocks = self._remote_blocks.get(request)
        if remote_blocks is not None:
            return max(remote_blocks - num_hits, 0)
        return 0 if self._loader is None else self._loader.blocks_to_load(request, num_hits)

    def _start_load(
        self, request: R, hits: Sequence[KVBlock], num_blocks: int, step: ScheduledStep[R]
    ) -> bool:
        """Give a decode leg blocks for its hits and the `num_blocks` it will receive,
        left out of the prefix cache until they arrive; False (it waits for blocks to
        free) if they do not fit beside what loading requests, this one included, still
        need to run the prompt. vLLM reserves that much for the others (lest loads fill
        the cache and none can run); the simulator reserves this one's share too, so a
        load that ends first never waits on one that ends later."""
        block_size = self.kv_cache.block_size
        num_tokens = num_blocks * block_size
        reserved = self.kv_cache.blocks_needed(request.num_tokens) - len(hits) - num_blocks
        for parked in (*self.loading, *self.loaded):
            held = self.kv_cache.held_tokens(parked) // block_size
            reserved += max(0, self.kv_cache.blocks_needed(parked.num_tokens) - held)
        if not self.kv_cache.allocate_slots(
            request,
            0,
            hits,
            num_external_tokens=num_tokens,
            delay_caching=True,
            reserved_blocks=reserved,
        ):
            self.kv_fetch_stages[request] = KV_FETCH_WAITING_TO_START
            return False
        if self._remote_blocks.pop(request, None) is None and self._loader is not None:
            self._loader.load_started(request, len(hits), num_blocks)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = len(hits) * block_size + num_tokens
        if request.num_cached_tokens is None:  # not after a preemption, as vLLM counts
            request.num_cached_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        self.kv_fetch_stages[request] = KV_FETCH_IN_PROGRESS
        self.loading.append(request)
        step.kv_loads[request] = num_blocks
        return True

    def _take_loaded_kv(self, request: R) -> None:
        """vLLM's `_update_waiting_for_remote_kv`: cache the blocks a load brought (their
        `BlocksStored` now), or free them all after a failed one, and let the request
        wait to be scheduled."""
        if request.num_computed_tokens:
            self.kv_cache.cache_blocks(request, request.num_computed_tokens)
            # A load of the whole prompt leaves its last token to compute (its logits).
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        else:
            self.kv_cache.free(request)
            request.num_cached_tokens = None  # counted again when scheduled
        request.status = RequestStatus.WAITING

    def _end_aborted_load(self, request: R) -> bool:
        if request not in self._aborted_loads:
            return False
        self._aborted_loads.remove(request)
        self.kv_cache.free(request)
        return True

    def _enqueue(self, queue: deque[R], request: R, *, front: bool = False) -> None:
        """Put a request in a waiting queue: at the back, or at the front (a preempted
        request, first served again); in priority mode at its place in the order (vLLM's
        heap), preempted or not."""
        if self._priority_order is not None:
            bisect.insort(queue, request, key=self._priority_order)
        elif front:
            queue.appendleft(request)
        else:
            queue.append(request)

    def _allocate_or_preempt(
        self, request: R, count: int, step: ScheduledStep[R]
    ) -> list[int] | None:
        """Blocks for `count` more tokens of a running request, preempting others until
        they fit. Returns the tokens the step had scheduled for the requests preempted
        (priority mode can preempt one it scheduled already), or None if the request
        itself was preempted."""
        given_back = []
        while not self.kv_cache.allocate_slots(request, count):
            victim = self._preempt(step)
            if victim is request:
                return None
            scheduled = step.tokens.pop(victim, None)
            if scheduled is not None:
                given_back.append(scheduled)
        return given_back

    def _preempt(self, step: ScheduledStep[R]) -> R:
        """Preempt vLLM's victim: the latest admitted running request, or in priority
        mode the one with the largest (priority, arrival) (the first of equals). Its
        blocks are freed; it waits, to be computed again."""
        order = self._priority_order
        if order is None:
            victim = self.running.pop()
        else:
            victim = max(self.running, key=order)
            self.running.remove(victim)
        self.kv_cache.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self._enqueue(self.waiting, victim, front=True)
        step.num_preempted += 1
        self.num_preemptions += 1
        return victim

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
