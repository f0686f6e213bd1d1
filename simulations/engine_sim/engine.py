"""The engine loop: schedule a step, let its modelled time pass, apply it, publish.

One asyncio task drives the scheduler. Requests come in through `generate`, which
yields each new token as its step completes and aborts the request if the caller stops
listening (a client that went away). Events the block pool produced in a step go out as
one batch at the end of the step, as vLLM publishes once per scheduler step.

For P/D (kv_transfer.py), the engine lends a finished prefill leg's blocks, and pulls a
decode leg's prompt blocks into blocks the scheduler gave the request (as vLLM's
NixlConnector reads them into the blocks `allocate_slots` gave it): the request waits
for them like any other, holds them while the transfer runs, and they enter the prefix
cache when the scheduler takes the arrived KV. As vLLM, it counts the pulled tokens
apart from its own prefix-cache hits (`vllm:external_prefix_cache_*`,
`vllm:prompt_tokens_by_source{source="external_kv_transfer"}`), and a consumer engine
reports its decode legs by KV-fetch stage.

With CPU offloading (offload.py), blocks read back from the CPU tier load the same way,
counted as the host tier's (`vllm:prompt_tokens_cached_by_source{source="host"}`). The
copies take their bytes over `--kv-offload-bytes-per-s`: a read before the request
computes, a step's writes once the step has computed their blocks (vLLM starts them
with the next step); offload_copies.py says which, and how long, for this loop and the
fleet simulator's. A completed write is announced in the next batch, even with no
request to run, as vLLM steps while its connector has copies in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Coroutine
from typing import Any

from simulations.engine_sim.block_hash import none_hash
from simulations.engine_sim.block_pool import BlockPool, KVBlock
from simulations.engine_sim.config import EngineSimConfig
from simulations.engine_sim.kv_cache_manager import KVCacheManager, PrefixCacheStats
from simulations.engine_sim.kv_events import KVEvent
from simulations.engine_sim.kv_transfer import (
    BlockLender,
    KVLoadFailed,
    PullClient,
    RemotePrefill,
)
from simulations.engine_sim.metrics import (
    EXTERNAL_KV_TRANSFER,
    LOCAL_CACHE_HIT,
    LOCAL_COMPUTE,
    EngineMetrics,
)
from simulations.engine_sim.offload import CPUTier, OffloadingConnector
from simulations.engine_sim.offload_copies import OffloadCopies, TierCopy, counted_loads
from simulations.engine_sim.publisher import EventPublisher
from simulations.engine_sim.request import RequestStatus, SimRequest, priority_order
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
        offloading = config.cpu_offloading
        self.offload = None
        if offloading is not None:
            self.offload = OffloadingConnector(
                CPUTier(offloading.num_blocks),
                config.block_size,
                prompt_only=offloading.offload_prompt_only,
                prefix_caching=config.enable_prefix_caching,
            )
        self.scheduler: Scheduler[SimRequest] = Scheduler(
            self.kv_cache,
            config.limits,
            sampler_over(output_token_ids),
            self.offload,
            priority_order if config.scheduling_policy == "priority" else None,
        )
        self.copies: OffloadCopies[SimRequest] | None = None
        if self.offload is not None:
            self.copies = OffloadCopies(
                self.offload,
                self.scheduler,
                kv_bytes_per_token=config.kv_bytes_per_token,
                bytes_per_s=config.kv_offload_bytes_per_s,
                time_scale=config.time_scale,
            )
        self.lender = BlockLender(
            self.pool, config.kv_lease_s, self._count_expired_lease, self._wake
        )
        self._timing = config.timing
        self._streams: dict[SimRequest, asyncio.Queue[RequestProgress[SimRequest] | Exception]] = {}
        self._wakeup = asyncio.Event()
        self._stall_until = 0.0
        self._reported_queries = 0
        self._reported_hits = 0
        self._reported_preemptions = 0
        # Decode legs whose pull has not started: where to pull from, and how.
        self._remote: dict[SimRequest, tuple[RemotePrefill, PullClient]] = {}
        self._transfers: set[asyncio.Task[None]] = set()
        self.alive = True  # False once the loop has failed: /health reports it

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        lora_name: str | None,
        cache_salt: str | None,
        sampling_seed: int,
        priority: int = 0,
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
            priority=priority,
            sampling_seed=sampling_seed,
            remote_decode=remote_decode,
        )

    async def generate(
        self,
        request: SimRequest,
        remote: RemotePrefill | None = None,
        client: PullClient | None = None,
    ) -> AsyncGenerator[RequestProgress[SimRequest], None]:
        """Run a request; yields after every step that gave it a token. With `remote`
        (and the `client` to reach it), the request is a decode leg: the prompt blocks
        its cache lacks are pulled from there first (those a cache hit could use: every
        full block but one that ends the prompt). KVLoadFailed if the pull fails and
        the failure policy is `fail`."""
        queue: asyncio.Queue[RequestProgress[SimRequest] | Exception] = asyncio.Queue()
        remote_blocks = None
        if remote is not None and client is not None:
            remote_blocks = (request.num_prompt_tokens - 1) // self.config.block_size
        self.scheduler.add(request, remote_blocks)
        self._streams[request] = queue
        if remote is not None and client is not None:
            self._remote[request] = (remote, client)
        self._wakeup.set()
        self._update_gauges()
        try:
            while True:
                progress = await queue.get()
                if isinstance(progress, Exception):
                    raise progress
                yield progress
                if progress.finished:
                    return
        finally:
            del self._streams[request]
            self._remote.pop(request, None)
            if request.status in (
                RequestStatus.WAITING,
                RequestStatus.WAITING_FOR_REMOTE_KVS,
                RequestStatus.RUNNING,
                RequestStatus.PREEMPTED,
            ):
                self.scheduler.abort(request)
                self._ended(request)
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
        finally:
            for transfer in self._transfers:
                transfer.cancel()

    async def _run_steps(self) -> None:
        while True:
            if not self.scheduler.has_work:
                self._wakeup.clear()
                await self.publish_events()  # copies to the CPU tier that completed since
                await self._wakeup.wait()
            stall = self._stall_until - time.monotonic()
            if stall > 0:
                await asyncio.sleep(stall)
                continue
            step = self.scheduler.schedule()
            self._count_admissions(step)
            self._start_transfers(step)
            writes = self._offer_writes(step)
            if step.is_empty:
                if step.num_preempted:
                    continue  # the preempted request freed blocks: schedule again
                # Nothing fits now; whatever frees memory (an abort, a request that
                # finished, a loan that ended) or ends a KV load wakes us.
                self._wakeup.clear()
                await self.publish_events()  # a load's blocks, cached at its turn
                self._update_gauges()
                await self._wakeup.wait()
                continue
            # Always yield, even at time scale 0, so requests keep arriving meanwhile.
            await asyncio.sleep(step_seconds(self._timing, step.work) * self.config.time_scale)
            now = time.monotonic()
            lending = self._blocks_to_lend(step)
            for progress in self.scheduler.finish_step(step):
                self._record(progress, now)
                if progress.finished:
                    self._ended(progress.request)
                if progress.finished and progress.request in lending:
                    self._lend(progress.request, lending[progress.request])
                queue = self._streams.get(progress.request)
                if queue is not None:
                    queue.put_nowait(progress)
            for write in writes:
                self._spawn(self._copy(write))
            await self.publish_events()
            self._update_gauges()

    def _start_transfers(self, step: ScheduledStep[SimRequest]) -> None:
        """Start the KV loads the step admitted, each into its request's blocks."""
        if self.copies is not None:
            for read in self.copies.reads(step):
                self._spawn(self._copy(read))
            return
        for request, num_blocks in step.kv_loads.items():
            remote = self._remote.pop(request, None)
            if remote is None:
                continue
            self._spawn(self._transfer(request, *remote, num_blocks))

    def _spawn(self, copy: Coroutine[Any, Any, None]) -> None:
        transfer = asyncio.create_task(copy)
        self._transfers.add(transfer)
        transfer.add_done_callback(self._transfers.discard)

    def _kv_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.config.block_size * self.config.kv_bytes_per_token

    def _offer_writes(self, step: ScheduledStep[SimRequest]) -> list[TierCopy[SimRequest]]:
        """The step's writes to the CPU tier (room made for them now)."""
        if self.copies is None:
            return []
        writes, refused = self.copies.writes(step)
        for request in refused:
            log.warning("request %s: no room for its blocks on the CPU", request.request_id)
            self.metrics.kv_offload.allocation_failures.inc()
        return writes

    async def _copy(self, copy: TierCopy[SimRequest]) -> None:
        """Wait out a copy between the device and the CPU tier, then end it: a read hands
        its request back to the scheduler, a write's blocks are announced (and requests
        waiting for them look again)."""
        assert self.copies is not None
        await asyncio.sleep(copy.seconds)
        self.copies.done(copy)
        self.metrics.kv_offload.copied(copy.transfer_type, copy.num_bytes, copy.seconds)
        self._wakeup.set()
        self._update_gauges()

    def _ended(self, request: SimRequest) -> None:
        if self.copies is not None:
            self.copies.ended(request)

    async def _transfer(
        self, request: SimRequest, source: RemotePrefill, client: PullClient, num_blocks: int
    ) -> None:
        """Pull `num_blocks` of the decode leg's prompt blocks from the prefill engine and
        wait out the transfer, then hand the request back to the scheduler. With none to
        read, the call only frees the prefill's blocks, as vLLM notifies the prefill
        after a full local hit; its failure then costs nothing."""
        if not num_blocks:
            with contextlib.suppress(KVLoadFailed):
                await client.pull(source, 0)
            return
        num_bytes = self._kv_bytes(num_blocks)
        seconds = num_bytes / self.config.kv_transfer_bytes_per_s * self.config.time_scale
        try:
            await client.pull(source, num_blocks)
            await asyncio.sleep(seconds)
        except KVLoadFailed as failure:
            self.metrics.kv_transfer.failed_transfers.inc()
            self._load_failed(request, failure)
        else:
            transfer = self.metrics.kv_transfer
            transfer.xfer_time.observe(seconds)
            transfer.bytes_transferred.observe(num_bytes)
            transfer.pulled_blocks.inc(num_blocks)
            self.scheduler.finish_load(request)
        self._wakeup.set()
        self._update_gauges()

    def _load_failed(self, request: SimRequest, failure: KVLoadFailed) -> None:
        """As vLLM's `kv_load_failure_policy`: `fail` fails the request, `recompute`
        schedules it again, to compute what its cache lacks."""
        message = f"KV load failed for request {request.request_id}: {failure}"
        if self.config.kv_transfer_config.kv_load_failure_policy == "fail":
            log.warning("%s; the request fails", message)
            self.scheduler.fail_load(request)
            queue = self._streams.get(request)
            if queue is not None:
                queue.put_nowait(failure)
            return
        log.warning("%s; computing the prompt instead", message)
        request.num_external_tokens = None  # counted again when scheduled
        self.scheduler.finish_load(request, failed=True)

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
        for transfer in self._transfers:
            transfer.cancel()  # the process and its transfers are gone
        self._transfers.clear()
        self._remote.clear()
        self._stop_all("the engine restarted")
        self.scheduler.free_aborted_loads()
        self._stall_until = 0.0
        self.pool.forget_everything()
        if self.offload is not None:
            self.offload.forget_everything()
        self.lender.restart()
        self.kv_cache.stats = PrefixCacheStats()
        self.scheduler.num_preemptions = 0
        self._reported_queries = self._reported_hits = self._reported_preemptions = 0
        self.metrics = self.metrics.fresh()
        if self.publisher is not None:
            self.publisher.restart()
        self._update_gauges()

    def _stop_all(self, reason: str) -> None:
        for request, queue in list(self._streams.items()):
            self.scheduler.abort(request)
            queue.put_nowait(EngineStopped(reason))

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

    def _wake(self) -> None:
        self._wakeup.set()

    def _count_expired_lease(self) -> None:
        self.metrics.kv_transfer.expired_leases.inc()

    async def publish_events(self) -> None:
        events: list[KVEvent] = [*self.pool.take_events()]
        if self.offload is not None:  # after the device's, as vLLM adds its connector's
            events += self.offload.tier.take_events()
        if self.publisher is not None:
            await self.publisher.publish(events)

    def _count_admissions(self, step: ScheduledStep[SimRequest]) -> None:
        """Count the external tokens of the step's admissions as vLLM's scheduler does
        when it allocates: a KV load's, and 0 for a request scheduled for the first time
        without one. With a connector, vLLM counts external queries (every token its own
        cache missed) and hits (the loaded ones, by the tier they came from). A load
        after a preemption is not counted, as vLLM counts preempted requests apart."""
        admitted = counted_loads(step, self.config.block_size)
        admitted += [
            (request, 0)
            for request in step.tokens
            if request.num_external_tokens is None and request.num_cached_tokens is not None
        ]
        connector = self.config.kv_connector is not None
        source = "p2p" if self.config.pd else "host"
        for request, external in admitted:
            request.num_external_tokens = external
            if not connector:
                continue
            local = (request.num_cached_tokens or 0) - external
            metrics = self.metrics
            metrics.external_prefix_cache_queries.inc(request.num_prompt_tokens - local)
            metrics.external_prefix_cache_hits.inc(external)
            metrics.prompt_tokens_cached_by_source[source].inc(external)

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
        metrics.waiting.set(self.scheduler.num_waiting)
        metrics.kv_cache_usage.set(self.pool.usage)
        metrics.prefix_cache_queries.inc(stats.queries - self._reported_queries)
        # Lookups come before a load: their hits are local ones only.
        local_hits = stats.hits - self._reported_hits
        metrics.prefix_cache_hits.inc(local_hits)
        metrics.prompt_tokens_cached_by_source["device"].inc(local_hits)
        if metrics.kv_fetch_by_stage:
            stages = Counter(self.scheduler.kv_fetch_stages.values())
            for stage, gauge in metrics.kv_fetch_by_stage.items():
                gauge.set(stages[stage])
        if self.offload is not None:
            tier, offload = self.offload.tier, metrics.kv_offload
            offload.cpu_cache_write_usage.set(tier.num_writing / tier.num_blocks)
            offload.cpu_cache_read_usage.set(tier.num_reading / tier.num_blocks)
            offload.cpu_cache_usage.set((tier.num_writing + tier.num_reading) / tier.num_blocks)
        metrics.preemptions.inc(self.scheduler.num_preemptions - self._reported_preemptions)
        self._reported_queries = stats.queries
        self._reported_hits = stats.hits
        self._reported_preemptions = self.scheduler.num_preemptions
