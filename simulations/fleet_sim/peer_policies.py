"""The peers' routing policies, rebuilt from ../shared/reference/peer-routers.md and the
peers' own code, so that kvplane is compared with them on one fleet and one workload.

Each class follows one router's decision as closely as a simulated router allows: it
decides from the RouterView only (what that router would know), keeps whatever state of
its own the original keeps, and says in its docstring what it follows and where it had
to simplify. The common simplification: requests are chains of block ids, never text or
tokens, so anything the original computes over characters or token hashes is computed
over block ids and token counts here.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar, Literal

from kvplane.core.types import Tier
from router.routing.predicted import PredictedPrefixes
from simulations.fleet_sim.requests import TraceRequest
from simulations.fleet_sim.router_view import RouterView, leading_matches

__all__ = [
    "DynamoPolicy",
    "LlmdPolicy",
    "PrefixSource",
    "SglangCacheAwarePolicy",
    "VllmRouterCacheAwarePolicy",
]

PrefixSource = Literal["events", "decisions", "none"]


def _block_token_counts(request: TraceRequest, block_tokens: int) -> list[int]:
    """Tokens in each of the request's blocks (the last one usually partial)."""
    return [
        max(0, min(block_tokens, request.prompt_tokens - i * block_tokens))
        for i in range(len(request.blocks))
    ]


# -- SGLang ------------------------------------------------------------------------------


class SglangCacheAwarePolicy:
    """SGLang model gateway, policy `cache_aware` (sgl-router / sgl-model-gateway,
    `policies/cache_aware.rs` and `policies/tree.rs`), checked against sglang-router
    0.3.2, the release `kvplane bench live` runs (its crate, sgl-model-gateway 0.3.2, is
    commit c7f9bf9f5 "[smg] release 0.3.2" of github.com/smg-project/smg, whose history
    carries the gateway's; the defaults are the Python launcher's,
    `sglang_router/router_args.py` lines 33-37 of the wheel: cache_threshold 0.3,
    balance_abs_threshold 64, balance_rel_threshold 1.5, eviction_interval_secs 60,
    max_tree_size 2**26; the Rust `CacheAwareConfig::default()` differs but the
    launcher always passes these).

    What it follows:
    - An approximate tree per worker fed only by this router's own decisions, never by
      engine events (`events` is ignored): every routed request is inserted into the
      chosen worker's tree, in the imbalanced branch too.
    - Load is the router's in-flight request count per worker (`worker.load()`, here
      `view.traffic[w].in_flight`): raised when the request is routed and lowered when
      its response body is done (`WorkerLoadGuard`, taken for `cache_aware` and
      `manual` only, `src/routers/http/router.rs` lines 294-296 at 0.3.2). Imbalanced
      when `max - min > balance_abs_threshold` AND `max > balance_rel_threshold * min`
      (`src/policies/cache_aware.rs` lines 371-372); then the least-loaded worker.
    - Otherwise match rate = the longest match over all workers' trees / prompt length;
      strictly above `cache_threshold` the best-matching worker, else the least-loaded
      worker (newer versions; older ones took the worker with the smallest tree).
    - Least loaded is Rust's `min_by_key` over the workers in order: the lowest index
      among equally loaded workers, not a random one (the real order is the worker
      registry's DashMap's: fixed but arbitrary, the same up to a relabelling).
    - Among workers that hold the longest match equally, SGLang returns the tenant cached
      on the tree node where the match ends (`last_tenant`: the worker whose insert
      created that node, inherited on splits), else the first in the node's hash map.
      Here: the first worker to have inserted the deepest matched block, if it still
      holds it; otherwise one of the holders at random (the hash-map order), which then
      becomes the cached one.
    - Every `eviction_interval_s` (60 s; of simulated time, checked when a request
      arrives) each worker's tree over `max_tree_size` is cut by evicting its least
      recently used leaves until it fits (`evict_tenant_by_size`, `src/policies/tree.rs`
      lines 718-821 at 0.3.2; the limit is per worker: `tenant_char_count` per tenant).

    Simplifications:
    - The tree is over block ids, not characters: a worker's tree is the set of block
      ids routed to it (prefix-closed, as a radix tree is), with a last-access time per
      block. Match rate = matched tokens / prompt tokens, standing for matched
      characters / text characters (the same ratio if characters per token are even).
      A radix node splits at any character; here only at block boundaries.
    - `max_tree_size` stays in characters (SGLang's unit); the tree counts tokens and
      holds at most `max_tree_size / chars_per_token` of them (default 4 characters per
      token: 67,108,864 characters = 16,777,216 tokens per worker).
    - Inserting touches every block on the path (the original sets the leaf's time and,
      in older versions, every node's); matching touches nothing (the original touches
      the matched tenant's path, in newer versions only one match in eight).
    """

    name = "sglang-cache-aware"
    # sglang-router 0.3.2's launcher defaults (`sglang_router/router_args.py`).
    default_max_tree_size: ClassVar[int] = 67_108_864
    default_eviction_interval_s: ClassVar[float] = 60.0

    def __init__(
        self,
        rng: random.Random,
        block_tokens: int,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int | None = None,
        eviction_interval_s: float | None = None,
        chars_per_token: float = 4.0,
    ) -> None:
        if max_tree_size is None:
            max_tree_size = self.default_max_tree_size
        if eviction_interval_s is None:
            eviction_interval_s = self.default_eviction_interval_s
        self.rng = rng
        self.block_tokens = block_tokens
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_tokens = int(max_tree_size / chars_per_token)
        self.eviction_interval_s = eviction_interval_s
        self._next_eviction = eviction_interval_s if eviction_interval_s > 0 else math.inf
        self._workers = 0
        self._access: list[dict[int, float]] = []  # per worker: block -> last access
        self._children: list[dict[int, int]] = []  # per worker: block -> children held
        self._size: list[int] = []  # per worker: tokens held
        self._holders: dict[int, set[int]] = {}  # block -> workers holding it
        self._parent: dict[int, int | None] = {}  # block -> the block before it
        self._tokens: dict[int, int] = {}  # block -> tokens in it (first seen)
        self._owner: dict[int, int] = {}  # block -> the tenant SGLang would name
        self.load_balanced = 0  # decisions taken in the imbalanced branch
        self.cache_hits = 0  # decisions taken by match rate
        self.evicted_blocks = 0

    # -- the policy ------------------------------------------------------------------

    def choose(self, request: TraceRequest, view: RouterView, now: float) -> int:
        self._ensure_workers(view.workers)
        while now >= self._next_eviction:
            self.evict()
            self._next_eviction += self.eviction_interval_s
        loads = [traffic.in_flight for traffic in view.traffic]
        most, fewest = max(loads), min(loads)
        least_loaded = loads.index(fewest)  # min_by_key: the first of the least loaded
        if most - fewest > self.balance_abs_threshold and most > (
            fewest * self.balance_rel_threshold
        ):
            chosen = least_loaded
            self.load_balanced += 1
        else:
            matched, holders, deepest = self._match(request)
            rate = matched / request.prompt_tokens if request.prompt_tokens > 0 else 0.0
            if rate > self.cache_threshold and deepest is not None:
                chosen = self._tenant(deepest, holders)
                self.cache_hits += 1
            else:
                chosen = least_loaded
        self._insert(chosen, request, now)
        return chosen

    def events(
        self, worker: int, removed: list[int], cleared: bool, now: float, tier: Tier = Tier.DEVICE
    ) -> None:
        """SGLang's gateway never sees engine events."""
        return None

    # -- inspection (tests, reports) -------------------------------------------------

    def tree_tokens(self, worker: int) -> int:
        return self._size[worker] if worker < self._workers else 0

    def matched_tokens(self, worker: int, request: TraceRequest) -> int:
        """How much of the request's prompt this worker's tree holds, in tokens."""
        if worker >= self._workers:
            return 0
        held = self._access[worker]
        matched = 0
        for block, tokens in zip(
            request.blocks, _block_token_counts(request, self.block_tokens), strict=True
        ):
            if block not in held:
                break
            matched += tokens
        return matched

    # -- the tree --------------------------------------------------------------------

    def _ensure_workers(self, workers: int) -> None:
        while self._workers < workers:
            self._access.append({})
            self._children.append({})
            self._size.append(0)
            self._workers += 1

    def _match(self, request: TraceRequest) -> tuple[int, set[int], int | None]:
        """Tokens of the longest match over all trees, the workers holding it, and its
        last block."""
        holders: set[int] = set()
        deepest: int | None = None
        matched = 0
        for i, (block, tokens) in enumerate(
            zip(request.blocks, _block_token_counts(request, self.block_tokens), strict=True)
        ):
            here = self._holders.get(block)
            if not here:
                break
            # Trees are prefix-closed: whoever holds this block holds all before it.
            current = here if i == 0 else here & holders
            if not current:
                break
            holders = current
            deepest = block
            matched += tokens
        return matched, holders, deepest

    def _tenant(self, deepest: int, holders: set[int]) -> int:
        owner = self._owner.get(deepest)
        if owner is not None and owner in holders:
            return owner
        owner = self.rng.choice(sorted(holders))
        self._owner[deepest] = owner
        return owner

    def _insert(self, worker: int, request: TraceRequest, now: float) -> None:
        access = self._access[worker]
        children = self._children[worker]
        parent: int | None = None
        for block, tokens in zip(
            request.blocks, _block_token_counts(request, self.block_tokens), strict=True
        ):
            if block not in access:
                size = self._tokens.setdefault(block, tokens)
                self._parent.setdefault(block, parent)
                self._size[worker] += size
                self._holders.setdefault(block, set()).add(worker)
                self._owner.setdefault(block, worker)
                if parent is not None:
                    children[parent] = children.get(parent, 0) + 1
            access[block] = now
            parent = block

    def evict(self) -> None:
        """Each worker's tree over its limit loses least recently used leaves until it
        fits (a parent left without children becomes a leaf in turn)."""
        for worker in range(self._workers):
            if self._size[worker] <= self.max_tree_tokens:
                continue
            access = self._access[worker]
            children = self._children[worker]
            heap = [
                (when, order, block)
                for order, (block, when) in enumerate(access.items())
                if not children.get(block)
            ]
            heapq.heapify(heap)
            order = len(access)
            while heap and self._size[worker] > self.max_tree_tokens:
                _, _, block = heapq.heappop(heap)
                del access[block]
                children.pop(block, None)
                self._size[worker] -= self._tokens[block]
                holders = self._holders[block]
                holders.discard(worker)
                if not holders:
                    del self._holders[block]
                    self._owner.pop(block, None)
                self.evicted_blocks += 1
                parent = self._parent[block]
                if parent is not None:
                    left = children[parent] - 1
                    if left:
                        children[parent] = left
                    else:
                        del children[parent]
                        heapq.heappush(heap, (access[parent], order, parent))
                        order += 1


class VllmRouterCacheAwarePolicy(SglangCacheAwarePolicy):
    """vllm-router, policy `cache_aware` (github.com/vllm-project/router,
    `src/policies/cache_aware.rs`, `src/tree.rs`): a fork of SGLang's, with the same
    decision (imbalance by in-flight counts, 64 and 1.5; else the approximate tree's
    best match above 0.3, else the least loaded; every routed request inserted into
    the chosen worker's tree) and the same tree. The in-flight count is raised for
    `cache_aware` requests and lowered at the stream's `data: [DONE]` or the body's end
    (`src/routers/http/router.rs`). Its defaults differ: the installed 0.1.17's launcher
    (`vllm_router/router_args.py` lines 40-44) evicts every 120 s and caps each tree at
    2**25 characters.

    Newer versions also key chat requests by a session id from the request headers
    (`x-session-id` and the like) in an exact-match map; `kvplane bench live` sends no
    such header, so the text path above is the one it exercises, and the one followed.
    """

    name = "vllm-router-cache-aware"
    default_max_tree_size = 33_554_432
    default_eviction_interval_s = 120.0


# -- llm-d -------------------------------------------------------------------------------


class LlmdPolicy:
    """llm-d inference scheduler with the precise prefix-cache scorer (llm-d-inference-
    scheduler `precise_prefix_cache.go`, the gateway-api-inference-extension `queue` and
    `kv-cache-utilization` scorers and max-score picker), and the two other schedulers of
    llm-d's published comparison by `prefix_source`:
    - "events" (`llm-d-precise`): the prefix scorer reads the engines' KV events;
    - "decisions" (`llm-d-approximate`): it reads an estimate built from this router's
      own decisions (the gateway's estimating `prefix-cache-scorer`): per worker an LRU
      of the block ids routed there, as many as the worker's cache holds (the scorer's
      auto-tuned capacity), never told of evictions;
    - "none" (`llm-d-load`): no prefix scorer, queue and KV utilisation only.

    What it follows:
    - Prefix-cache scorer (weight 3) over the index fed by the engines' KV events (the
      view's `matched_blocks`): per worker the longest consecutive prefix of the prompt's
      full blocks (the partial last block has no key), all on the GPU tier (weight 1).
    - Speculative entries: the chosen worker is believed to hold the prompt's full blocks
      for `speculative_ttl_s` (2 s, per the reference; the newest code defaults to 30 s
      and has them off unless configured), until the engine's own events arrive. Kept in
      the router's PredictedPrefixes (keys are block ids, workers are their str index);
      a worker's prefix is the longer of its confirmed and speculative ones.
    - Queue scorer (weight 2): waiting queue from the last load report, min-max
      normalised and inverted, `(max - q) / (max - min)`; 1.0 for all when all are equal.
    - KV-cache-utilisation scorer (weight 2): `1 - kv_usage`.
    - A worker with no report yet has zero metrics (queue 0, usage 0), as a pod whose
      metrics were never scraped. Scores clamped to [0, 1], weighted sum, highest wins,
      ties at random.
    - Stale metrics: in llm-d the staleness threshold (2 s) feeds only the saturation
      detector (admission control, which sheds or holds requests; not modelled here);
      the scorers read the latest metrics whatever their age. So do these: reports older
      than `metrics_stale_s` are still used, and counted in `stale_reports`.

    Where the reference and the code differ (`prefix_normalisation`):
    - "fraction" (default, the reference's wording): matched blocks / total full blocks.
    - "min-max" (the precise scorer's code, `indexedScoresToNormalizedScoredPods`): over
      the workers holding at least the first block, `(s - min) / (max - min)`, 1.0 for
      all when they are equal (so a sole holder of one block scores 1.0); 0 elsewhere.

    Simplifications: block ids stand for llm-d's own chained block keys (no hashing, no
    tokenizer); metrics arrive on the simulator's load-report schedule (llm-d refreshes
    every 50 ms: set the fleet's `load_interval_s` to match); a real removal reported by
    the events also removes the speculative entry for that block (llm-d's speculative
    entries carry their own annotation and otherwise last until their TTL).
    """

    NAMES: ClassVar[dict[PrefixSource, str]] = {
        "events": "llm-d-precise",
        "decisions": "llm-d-approximate",
        "none": "llm-d-load",
    }

    def __init__(
        self,
        rng: random.Random,
        block_tokens: int,
        prefix_source: PrefixSource = "events",
        capacity_blocks: int = 0,  # per worker, for "decisions"
        prefix_weight: float = 3.0,
        queue_weight: float = 2.0,
        kv_weight: float = 2.0,
        speculative_ttl_s: float = 2.0,
        metrics_stale_s: float = 2.0,
        prefix_normalisation: Literal["fraction", "min-max"] = "fraction",
    ) -> None:
        if prefix_source == "decisions" and capacity_blocks < 1:
            raise ValueError("an estimated prefix index needs the workers' capacity_blocks")
        self.name = self.NAMES[prefix_source]
        self.rng = rng
        self.block_tokens = block_tokens
        self.prefix_source = prefix_source
        self.capacity_blocks = capacity_blocks
        self.estimated: list[OrderedDict[int, None]] = []  # per worker, least recent first
        self.prefix_weight = 0.0 if prefix_source == "none" else prefix_weight
        self.queue_weight = queue_weight
        self.kv_weight = kv_weight
        self.metrics_stale_s = metrics_stale_s
        self.prefix_normalisation = prefix_normalisation
        self.speculative = PredictedPrefixes(speculative_ttl_s)
        self.stale_reports = 0  # reports scored on although older than metrics_stale_s

    def choose(self, request: TraceRequest, view: RouterView, now: float) -> int:
        totals = self.scores(request, view, now)
        best = max(totals)
        chosen = self.rng.choice([w for w, s in enumerate(totals) if s >= best - 1e-9])
        full = request.prompt_tokens // self.block_tokens
        if self.prefix_source == "events":
            self.speculative.record(str(chosen), request.blocks[:full], now)
        elif self.prefix_source == "decisions":
            self._estimate(chosen, request.blocks[:full])
        return chosen

    def _estimate(self, worker: int, blocks: Sequence[int]) -> None:
        estimated = self.estimated[worker]
        for block in blocks:
            estimated[block] = None
            estimated.move_to_end(block)
        while len(estimated) > self.capacity_blocks:
            estimated.popitem(last=False)

    def events(
        self, worker: int, removed: list[int], cleared: bool, now: float, tier: Tier = Tier.DEVICE
    ) -> None:
        """Its prefix scorer reads the view's device blocks only, so only the device's
        removals take its speculative entries."""
        if tier is not Tier.DEVICE:
            return
        if cleared:
            self.speculative.forget_worker(str(worker))
        elif removed:
            self.speculative.removed(str(worker), removed)

    def scores(self, request: TraceRequest, view: RouterView, now: float) -> list[float]:
        """Each worker's weighted total (what the max-score picker compares)."""
        prefix = self.prefix_scores(request, view, now)
        queue = self.queue_scores(view, now)
        kv = self.kv_scores(view)
        return [
            self.prefix_weight * p + self.queue_weight * q + self.kv_weight * k
            for p, q, k in zip(prefix, queue, kv, strict=True)
        ]

    def prefix_scores(self, request: TraceRequest, view: RouterView, now: float) -> list[float]:
        full = request.prompt_tokens // self.block_tokens
        blocks = request.blocks[:full]
        if not blocks or self.prefix_source == "none":
            return [0.0] * view.workers
        if self.prefix_source == "decisions":
            while len(self.estimated) < view.workers:
                self.estimated.append(OrderedDict())
            matched = [leading_matches(self.estimated[w], blocks) for w in range(view.workers)]
        else:
            self.speculative.prune(now)
            speculative = self.speculative.match(blocks, now)
            matched = [
                max(view.matched_blocks(w, blocks), speculative.get(str(w), 0))
                for w in range(view.workers)
            ]
        if self.prefix_normalisation == "fraction":
            return [_clamp(m / len(blocks)) for m in matched]
        held = [m for m in matched if m > 0]
        if not held:
            return [0.0] * view.workers
        low, high = min(held), max(held)
        if low == high:
            return [1.0 if m > 0 else 0.0 for m in matched]
        return [_clamp((m - low) / (high - low)) if m > 0 else 0.0 for m in matched]

    def queue_scores(self, view: RouterView, now: float) -> list[float]:
        waiting = []
        for report in view.reports:
            if report is None:
                waiting.append(0)
                continue
            if now - report.taken_at > self.metrics_stale_s:
                self.stale_reports += 1
            waiting.append(report.load.waiting)
        low, high = min(waiting), max(waiting)
        if high == low:
            return [1.0] * view.workers
        return [_clamp((high - q) / (high - low)) for q in waiting]

    def kv_scores(self, view: RouterView) -> list[float]:
        return [
            1.0 if report is None else _clamp(1.0 - report.load.kv_usage) for report in view.reports
        ]


def _clamp(value: float) -> float:
    return min(1.0, max(0.0, value))


# -- Dynamo ------------------------------------------------------------------------------


class DynamoPolicy:
    """NVIDIA Dynamo KV router with engine events (`kv_router/scheduler.rs`,
    `sequence.rs`; the 2025 documentation's cost).

    What it follows:
    - Cost, lowest wins: `overlap_score_weight * prefill_blocks + decode_blocks`.
    - prefill_blocks = (the request's tokens not cached on the worker, i.e. prompt tokens
      - overlap blocks * block_tokens, + the prefill tokens already queued there by this
      router) / block_tokens. Overlap is the longest prefix of the prompt's full blocks in
      the index fed by engine events (the view's `matched_blocks`). The queued prefill is
      the view's `traffic[w].prefill_tokens`: what this router sent there whose first
      token has not come back (Dynamo's `active_tokens`, dropped at prefill completion),
      each counted as its uncached tokens at sending time.
    - decode_blocks = the distinct blocks of the requests this router has active on the
      worker + those of the new request's blocks not among them (Dynamo's
      `new_blocks + active_blocks`: a prefix shared by active requests counts once).
      Prompt blocks only: Dynamo's active-sequence tracking does not grow with output.
    - Temperature 0: every worker with the lowest cost is a candidate; ties go to the
      worker whose index holds the fewest blocks (`tree_sizes`), then at random (Dynamo:
      hash-map order). Temperature T > 0: costs normalised by their range, negated,
      divided by T, softmax, sampled; uniform if all costs are equal.

    Simplification: Dynamo learns of a request's end from its response stream; the
    policy interface has no such call, so active requests are reconciled from the view
    when the next request arrives: when a worker's in-flight count is below the number
    of requests believed active there, the excess is retired among the requests past
    their first token (no longer in `traffic[w].prefilling`), oldest sent first (equal
    decode rates make the earliest the likeliest to finish). A request the worker
    rejected outright (prompt over its capacity) is retired the same way, possibly in
    place of another.
    """

    name = "dynamo"

    def __init__(
        self,
        rng: random.Random,
        block_tokens: int,
        overlap_score_weight: float = 1.0,
        temperature: float = 0.0,
    ) -> None:
        self.rng = rng
        self.block_tokens = block_tokens
        self.overlap_score_weight = overlap_score_weight
        self.temperature = temperature
        self._active: list[OrderedDict[int, tuple[int, ...]]] = []  # worker: id -> blocks
        self._block_refs: list[dict[int, int]] = []  # worker: block -> active requests

    def choose(self, request: TraceRequest, view: RouterView, now: float) -> int:
        costs = self.costs(request, view)
        if self.temperature <= 0.0:
            lowest = min(costs)
            candidates = [w for w, c in enumerate(costs) if c == lowest]
            if len(candidates) > 1:
                smallest = min(len(view.cached[w]) for w in candidates)
                candidates = [w for w in candidates if len(view.cached[w]) == smallest]
            chosen = candidates[0] if len(candidates) == 1 else self.rng.choice(candidates)
        else:
            chosen = self._sample(costs)
        self._activate(chosen, request)
        return chosen

    def events(
        self, worker: int, removed: list[int], cleared: bool, now: float, tier: Tier = Tier.DEVICE
    ) -> None:
        """The index is the view's; nothing of the policy's own to correct."""
        return None

    def costs(self, request: TraceRequest, view: RouterView) -> list[float]:
        """Each worker's cost for this request (reconciling active requests first)."""
        self._reconcile(view)
        full = request.prompt_tokens // self.block_tokens
        blocks = request.blocks[:full]
        costs = []
        for w in range(view.workers):
            overlap = view.matched_blocks(w, blocks)
            new_tokens = max(0, request.prompt_tokens - overlap * self.block_tokens)
            prefill_blocks = (view.traffic[w].prefill_tokens + new_tokens) / self.block_tokens
            refs = self._block_refs[w]
            decode_blocks = len(refs) + sum(1 for b in set(request.blocks) if b not in refs)
            costs.append(self.overlap_score_weight * prefill_blocks + decode_blocks)
        return costs

    def active_blocks(self, worker: int) -> int:
        return len(self._block_refs[worker]) if worker < len(self._block_refs) else 0

    def _sample(self, costs: Sequence[float]) -> int:
        low, high = min(costs), max(costs)
        if high == low:
            return self.rng.randrange(len(costs))
        scaled = [-c / (high - low) / self.temperature for c in costs]
        top = max(scaled)
        weights = [math.exp(s - top) for s in scaled]
        total = sum(weights)
        sample = self.rng.random()
        cumulative = 0.0
        for w, weight in enumerate(weights):
            cumulative += weight / total
            if sample <= cumulative:
                return w
        return len(costs) - 1

    def _ensure_workers(self, workers: int) -> None:
        while len(self._active) < workers:
            self._active.append(OrderedDict())
            self._block_refs.append({})

    def _activate(self, worker: int, request: TraceRequest) -> None:
        blocks = tuple(dict.fromkeys(request.blocks))
        self._active[worker][request.request_id] = blocks
        refs = self._block_refs[worker]
        for block in blocks:
            refs[block] = refs.get(block, 0) + 1

    def _retire(self, worker: int, request_id: int) -> None:
        refs = self._block_refs[worker]
        for block in self._active[worker].pop(request_id):
            left = refs[block] - 1
            if left:
                refs[block] = left
            else:
                del refs[block]

    def _reconcile(self, view: RouterView) -> None:
        self._ensure_workers(view.workers)
        for w in range(view.workers):
            active = self._active[w]
            excess = len(active) - view.traffic[w].in_flight
            if excess <= 0:
                continue
            prefilling = view.traffic[w].prefilling
            done = [rid for rid in active if rid not in prefilling][:excess]
            if len(done) < excess:  # not expected: fall back to the oldest
                done += [rid for rid in active if rid not in done][: excess - len(done)]
            for rid in done:
                self._retire(w, rid)
