"""The engine loop: schedule a step, let its modelled time pass, apply it, publish.

One asyncio task drives the scheduler. Requests come in through `generate`, which
yields each new token as its step completes and aborts the request if the caller stops
listening (a client that went away). Events the block pool produced in a step go out as
one batch at the end of the step, as vLLM publishes once per scheduler step.

For P/D (kv_transfer.py), the engine lends a finished prefill leg's blocks, and pulls a
decode leg's prompt blocks before the request joins the scheduler. As vLLM, it counts the
pulled tokens apart from its own prefix-cache hits (`vllm:external_prefix_cache_*`,
`vllm:prompt_tokens_by_source{source="external_kv_transfer"}`), and a consumer engine
reports its decode legs by KV-fetch stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator

from simulations.engine_sim.block_hash import none_hash
from simulations.engine_sim.block_pool import BlockPool, KVBlock
from simulations.engine_sim.config import EngineSimConfig
from simulations.engine_sim.kv_cache_manager import KVCacheManager, PrefixCacheStats
from simulations.engine_sim.kv_transfer import (
    BlockLender,
    KVLoadFailed,
    PullClient,
    RemotePrefill,
)
from simulations.engine_sim.metrics import (
    EXTERNAL_KV_TRANSFER,
    KV_FETCH_COMPLETED_WAITING,
    KV_FETCH_IN_PROGRESS,
    LOCAL_CACHE_HIT,
    LOCAL_COMPUTE,
    EngineMetrics,
)
from simulations.engine_sim.publisher import EventPublisher
from simulations.engine_sim.request import RequestStatus, SimRequest
from simulations.engine_sim.scheduler import (
    RequestProgress,
    ScheduledStep,
    Scheduler,
    sampler_over,
)
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
        self.lender = BlockLender(self.pool, config.kv_lease_s, self._count_expired_lease)
        self._timing = config.timing
        self._streams: dict[SimRequest, asyncio.Queue[RequestProgress[SimRequest] | None]] = {}
        self._wakeup = asyncio.Event()
        self._stall_until = 0.0
        self._reported_queries = 0
        self._reported_hits = 0
        self._reported_preemptions = 0
        # Pulled tokens the last schedule's lookups counted as hits: not local hits.
        self._external_hits_to_deduct = 0
        # Decode legs with a KV load under way or done and not yet scheduled, by stage
        # (vLLM's KV_FETCH_STAGES; none waits to start, as a pull starts on arrival).
        self._kv_fetch_stages: dict[SimRequest, str] = {}
        self._kv_fetch_counts: dict[str, int] = {}
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
        remote_decode: bool = False,
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
            remote_decode=remote_decode,
        )

    async def generate(
        self, request: SimRequest
    ) -> AsyncGenerator[RequestProgress[SimRequest], None]:
        """Run a request; yields after every step that gave it a token."""
        queue: asyncio.Queue[RequestProgress[SimRequest] | None] = asyncio.Queue()
        self._streams[request] = queue
        self.scheduler.add(request)
        if request.remote_kv_loaded:
            self._set_kv_fetch_stage(request, KV_FETCH_COMPLETED_WAITING)
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
            self._set_kv_fetch_stage(request, None)
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
            self._count_admissions(step)
            if step.is_empty:
                # Nothing fits now; whatever frees memory (an abort) wakes us.
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            # Always yield, even at time scale 0, so requests keep arriving meanwhile.
            await asyncio.sleep(step_seconds(self._timing, step.work) * self.config.time_scale)
            now = time.monotonic()
            lending = self._blocks_to_lend(step)
            for progress in self.scheduler.finish_step(step):
                self._record(progress, now)
                if progress.finished and progress.request in lending:
                    self._lend(progress.request, lending[progress.request])
                queue = self._streams.get(progress.request)
                if queue is not None:
                    queue.put_nowait(progress)
            await self.publish_events()
            self._update_gauges()

    async def pull_remote_prefix(
        self, request: SimRequest, source: RemotePrefill, client: PullClient
    ) -> None:
        """The decode leg of a P/D pair, before it is scheduled: pull the prompt blocks
        this engine lacks from the prefill engine, wait out the transfer, and cache them,
        so the request computes only the rest. KVLoadFailed if the pull fails.

        Only the blocks a prefix-cache hit can use are pulled: every full block but one
        that ends the prompt (its last token is computed for its logits).
        """
        block_size = self.config.block_size
        wanted = request.block_digests[: (request.num_prompt_tokens - 1) // block_size]
        held = self.kv_cache.num_cached_blocks(wanted)
        missing = len(wanted) - held
        self._set_kv_fetch_stage(request, KV_FETCH_IN_PROGRESS)
        try:
            if not missing:
                # Nothing to read; the call only releases the prefill's blocks, as vLLM
                # notifies the prefill after a full local hit. Its failure costs nothing.
                with contextlib.suppress(KVLoadFailed):
                    await client.pull(source, 0)
                request.remote_kv_loaded = True
                return
            try:
                await client.pull(source, missing)
            except KVLoadFailed:
                self.metrics.kv_transfer.failed_transfers.inc()
                raise
            num_bytes = missing * block_size * self.config.kv_bytes_per_token
            seconds = num_bytes / self.config.kv_transfer_bytes_per_s * self.config.time_scale
            await asyncio.sleep(seconds)
        finally:
            self._set_kv_fetch_stage(request, None)
        cached = self.kv_cache.cache_received_blocks(request, held, missing)
        request.pulled_tokens = (held * block_size, (held + cached) * block_size)
        request.remote_kv_loaded = True
        await self.publish_events()
        transfer = self.metrics.kv_transfer
        transfer.xfer_time.observe(seconds)
        transfer.bytes_transferred.observe(num_bytes)
        transfer.pulled_blocks.inc(missing)
        if cached < missing:
            log.warning("%d pulled blocks found no free block: computed instead", missing - cached)

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
        self.lender.restart()
        self.kv_cache.stats = PrefixCacheStats()
        self.scheduler.num_preemptions = 0
        self._reported_queries = self._reported_hits = self._reported_preemptions = 0
        self._external_hits_to_deduct = 0
        self._kv_fetch_stages.clear()
        self._kv_fetch_counts.clear()
        self.metrics = self.metrics.fresh()
        if self.publisher is not None:
            self.publisher.restart()
        self._update_gauges()

    def _stop_all(self, reason: str) -> None:
        self._stop_reason = reason
        for request, queue in list(self._streams.items()):
            self.scheduler.abort(request)
            queue.put_nowait(None)

    def _blocks_to_lend(self, step: ScheduledStep[SimRequest]) -> dict[SimRequest, list[KVBlock]]:
        """The blocks of the step's prefill legs, taken before the step's end frees those
        that finish (nothing allocates in between, so the blocks are intact when lent)."""
        if self.lender.withhold:
            return {}
        return {
            request: self.kv_cache.blocks_of(request)
            for request in step.tokens
            if request.remote_decode
        }

    def _lend(self, request: SimRequest, blocks: list[KVBlock]) -> None:
        self.lender.lend(request.request_id, blocks)
        request.lent_block_ids = [block.block_id for block in blocks]

    def _count_expired_lease(self) -> None:
        self.metrics.kv_transfer.expired_leases.inc()

    async def publish_events(self) -> None:
        events = self.pool.take_events()
        if self.publisher is not None:
            await self.publisher.publish(events)

    def _count_admissions(self, step: ScheduledStep[SimRequest]) -> None:
        """The step's requests scheduled for the first time: split their cached tokens
        into local hits and pulled (external) ones, as vLLM's scheduler does at
        admission, and count the external ones (with a connector: vLLM counts external
        queries, every token its own cache missed, only where a connector is set)."""
        connector = self.config.kv_transfer_config.enabled
        for request in step.tokens:
            if request.num_external_tokens is not None or request.num_cached_tokens is None:
                continue
            cached = request.num_cached_tokens
            external = 0
            if request.pulled_tokens is not None:
                start, stop = request.pulled_tokens
                external = max(0, min(cached, stop) - start)
            request.num_external_tokens = external
            self._set_kv_fetch_stage(request, None)
            if not connector:
                continue
            metrics = self.metrics
            metrics.external_prefix_cache_queries.inc(
                request.num_prompt_tokens - (cached - external)
            )
            metrics.external_prefix_cache_hits.inc(external)
            metrics.prompt_tokens_cached_by_source["p2p"].inc(external)
            self._external_hits_to_deduct += external

    def _set_kv_fetch_stage(self, request: SimRequest, stage: str | None) -> None:
        """vLLM's `_set_kv_fetch_stage`: the request's KV-fetch stage (None: none)."""
        previous = self._kv_fetch_stages.pop(request, None)
        if stage is not None:
            self._kv_fetch_stages[request] = stage
        if previous == stage:
            return
        counts = self._kv_fetch_counts
        gauges = self.metrics.kv_fetch_by_stage
        for changed, step in ((previous, -1), (stage, 1)):
            if changed is not None:
                counts[changed] = counts.get(changed, 0) + step
                if gauges:
                    gauges[changed].set(counts[changed])

    def _record(self, progress: RequestProgress[SimRequest], now: float) -> None:
        request = progress.request
        self.metrics.generation_tokens.inc()
        if len(request.output_token_ids) == 1:
            # vLLM's PrefillStats, reported with the first output.
            cached = request.num_cached_tokens or 0
            external = request.num_external_tokens or 0
            by_source = self.metrics.prompt_tokens_by_source
            self.metrics.time_to_first_token.observe(now - request.arrival_time)
            self.metrics.prompt_tokens.inc(request.num_prompt_tokens)
            by_source[LOCAL_COMPUTE].inc(request.num_prompt_tokens - cached)
            by_source[LOCAL_CACHE_HIT].inc(cached - external)
            by_source[EXTERNAL_KV_TRANSFER].inc(external)
            self.metrics.prompt_tokens_cached.inc(cached)
        if progress.finished:
            self.metrics.e2e_latency.observe(now - request.arrival_time)

    def _update_gauges(self) -> None:
        metrics, stats = self.metrics, self.kv_cache.stats
        metrics.running.set(len(self.scheduler.running))
        metrics.waiting.set(len(self.scheduler.waiting))
        metrics.kv_cache_usage.set(self.pool.usage)
        metrics.prefix_cache_queries.inc(stats.queries - self._reported_queries)
        # The cache's lookups found the pulled blocks too; vLLM's local hits exclude them.
        local_hits = stats.hits - self._reported_hits - self._external_hits_to_deduct
        metrics.prefix_cache_hits.inc(local_hits)
        metrics.prompt_tokens_cached_by_source["device"].inc(local_hits)
        self._external_hits_to_deduct = 0
        metrics.preemptions.inc(self.scheduler.num_preemptions - self._reported_preemptions)
        self._reported_queries = stats.queries
        self._reported_hits = stats.hits
        self._reported_preemptions = self.scheduler.num_preemptions
