"""The engine loop: schedule a step, let its modelled time pass, apply it, publish.

One asyncio task drives the scheduler. Requests come in through `generate`, which
yields each new token as its step completes and aborts the request if the caller stops
listening (a client that went away). Events the block pool produced in a step go out as
one batch at the end of the step, as vLLM publishes once per scheduler step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator

from simulations.engine_sim.block_hash import none_hash
from simulations.engine_sim.block_pool import BlockPool
from simulations.engine_sim.config import EngineSimConfig
from simulations.engine_sim.kv_cache_manager import KVCacheManager, PrefixCacheStats
from simulations.engine_sim.metrics import EngineMetrics
from simulations.engine_sim.publisher import EventPublisher
from simulations.engine_sim.request import RequestStatus, SimRequest
from simulations.engine_sim.scheduler import RequestProgress, Scheduler, sampler_over
from simulations.engine_sim.timing import step_seconds

log = logging.getLogger(__name__)


class EngineStopped(Exception):
    """The engine restarted (a fault) or failed while the request was in it."""


class SimEngine:
    def __init__(
        self,
        config: EngineSimConfig,
        output_token_ids: list[int],
        metrics: EngineMetrics,
        publisher: EventPublisher | None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.publisher = publisher
        self.hash_root = none_hash(config.hash_seed)
        self.pool = BlockPool(config.num_blocks, enable_caching=config.enable_prefix_caching)
        self.kv_cache = KVCacheManager(self.pool, config.block_size)
        self.scheduler = Scheduler(self.kv_cache, config.limits, sampler_over(output_token_ids))
        self._timing = config.timing
        self._streams: dict[SimRequest, asyncio.Queue[RequestProgress[SimRequest] | None]] = {}
        self._wakeup = asyncio.Event()
        self._stall_until = 0.0
        self._reported_queries = 0
        self._reported_hits = 0
        self._reported_preemptions = 0
        self.alive = True  # False once the loop has failed: /health reports it
        self._stop_reason = ""

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        lora_name: str | None,
        cache_salt: str | None,
        sampling_seed: int,
    ) -> SimRequest:
        return SimRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            max_tokens=max_tokens,
            block_size=self.config.block_size,
            hash_root=self.hash_root,
            lora_name=lora_name,
            cache_salt=cache_salt,
            arrival_time=time.monotonic(),
            sampling_seed=sampling_seed,
        )

    async def generate(
        self, request: SimRequest
    ) -> AsyncGenerator[RequestProgress[SimRequest], None]:
        """Run a request; yields after every step that gave it a token."""
        queue: asyncio.Queue[RequestProgress[SimRequest] | None] = asyncio.Queue()
        self._streams[request] = queue
        self.scheduler.add(request)
        self._wakeup.set()
        self._update_gauges()
        try:
            while True:
                progress = await queue.get()
                if progress is None:
                    raise EngineStopped(self._stop_reason)
                yield progress
                if progress.finished:
                    return
        finally:
            del self._streams[request]
            if request.status in (
                RequestStatus.WAITING,
                RequestStatus.RUNNING,
                RequestStatus.PREEMPTED,
            ):
                self.scheduler.abort(request)
                self._wakeup.set()
                self._update_gauges()

    async def run(self) -> None:
        """The engine loop, until cancelled. If it fails, every request in the engine
        fails with it and the engine stays dead (as a crashed engine core would)."""
        try:
            await self._run_steps()
        except Exception:
            log.exception("the engine loop failed; the simulator no longer serves")
            self.alive = False
            self._stop_all("the engine failed")
            raise

    async def _run_steps(self) -> None:
        while True:
            if not self.scheduler.has_work:
                self._wakeup.clear()
                await self._wakeup.wait()
            stall = self._stall_until - time.monotonic()
            if stall > 0:
                await asyncio.sleep(stall)
                continue
            step = self.scheduler.schedule()
            if step.is_empty:
                # Nothing fits now; whatever frees memory (an abort) wakes us.
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            # Always yield, even at time scale 0, so requests keep arriving meanwhile.
            await asyncio.sleep(step_seconds(self._timing, step.work) * self.config.time_scale)
            now = time.monotonic()
            for progress in self.scheduler.finish_step(step):
                self._record(progress, now)
                queue = self._streams.get(progress.request)
                if queue is not None:
                    queue.put_nowait(progress)
            await self.publish_events()
            self._update_gauges()

    def stall(self, seconds: float) -> None:
        """Fault: take no step for `seconds` (requests and events stop)."""
        self._stall_until = time.monotonic() + seconds
        self._wakeup.set()

    def reset_prefix_cache(self) -> bool:
        """vLLM's `reset_prefix_cache`; refused while requests hold blocks."""
        return self.pool.reset_prefix_cache()

    def restart(self) -> None:
        """Fault: what a crash and restart does to the engine's state, in-process: every
        request in it fails, the cache is gone (no events: a new process sends none), and
        the event sequence starts again from 0, and so do the metrics."""
        self._stop_all("the engine restarted")
        self._stall_until = 0.0
        self.pool.forget_everything()
        self.kv_cache.stats = PrefixCacheStats()
        self.scheduler.num_preemptions = 0
        self._reported_queries = self._reported_hits = self._reported_preemptions = 0
        self.metrics = self.metrics.fresh()
        if self.publisher is not None:
            self.publisher.restart()
        self._update_gauges()

    def _stop_all(self, reason: str) -> None:
        self._stop_reason = reason
        for request, queue in list(self._streams.items()):
            self.scheduler.abort(request)
            queue.put_nowait(None)

    async def publish_events(self) -> None:
        events = self.pool.take_events()
        if self.publisher is not None:
            await self.publisher.publish(events)

    def _record(self, progress: RequestProgress[SimRequest], now: float) -> None:
        request = progress.request
        self.metrics.generation_tokens.inc()
        if len(request.output_token_ids) == 1:
            self.metrics.time_to_first_token.observe(now - request.arrival_time)
            self.metrics.prompt_tokens.inc(request.num_prompt_tokens)
            self.metrics.prompt_tokens_cached.inc(request.num_cached_tokens or 0)
        if progress.finished:
            self.metrics.e2e_latency.observe(now - request.arrival_time)

    def _update_gauges(self) -> None:
        metrics, stats = self.metrics, self.kv_cache.stats
        metrics.running.set(len(self.scheduler.running))
        metrics.waiting.set(len(self.scheduler.waiting))
        metrics.kv_cache_usage.set(self.pool.usage)
        metrics.prefix_cache_queries.inc(stats.queries - self._reported_queries)
        metrics.prefix_cache_hits.inc(stats.hits - self._reported_hits)
        metrics.preemptions.inc(self.scheduler.num_preemptions - self._reported_preemptions)
        self._reported_queries = stats.queries
        self._reported_hits = stats.hits
        self._reported_preemptions = self.scheduler.num_preemptions
