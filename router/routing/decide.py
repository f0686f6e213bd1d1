"""One routing decision: key the prompt, look it up, rank every candidate.

The ranking itself is the configured policy's (router/scoring/policy.py); this module
gathers its inputs (index lookup, predicted entries, load, tenant traffic) and records
what was decided. When the index cannot answer within its timeout the decision goes on
with load and this router's own predicted entries only, and says so.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvplane.core.clock import Clock
from kvplane.core.config import DisaggregationSettings
from kvplane.core.keys import BlockKey, KeyNamespace, chain_keys, root_key
from kvplane.core.types import Tier, WorkerInfo
from router.index.base import LocationIndex, LocationIndexError, PrefixMatch, index_deadline
from router.routing.pool import WorkerPool
from router.routing.predicted import PredictedPrefixes
from router.routing.roster import Roster, Rows
from router.scoring.disaggregation import LegPlan, LegReason, LegSide, plan_legs
from router.scoring.policy import RoutingPolicy
from router.scoring.score import TIERS, CandidateFacts, Flags, RankedWorkers, RequestFacts
from router.tenants import Tenant
from router.tracing import Tracer

log = logging.getLogger(__name__)

INDEX_PROBE_INTERVAL_S = 0.5
"""While lookups fail, how often one request tries the index again."""


_DEVICE_COLUMN = TIERS.index(Tier.DEVICE)
_NO_DEADLINE = contextlib.nullcontext()  # for an index whose lookups never wait


@dataclass(frozen=True, slots=True)
class LongestMatch:
    key: BlockKey  # of the prefix's last block
    tokens: int
    holder_eligible: bool  # whether a worker holding all of it was eligible


@dataclass(frozen=True, slots=True)
class Decision:
    ranked: RankedWorkers  # eligible workers, best first
    candidates: Sequence[str]  # every worker considered, by id
    roster: Roster  # the workers as registered when decided: see info()
    # Per candidate (rows as `candidates`): the blocks per tier (columns as TIERS)
    # believed cached there, and the part of them that the index vouched for.
    believed: npt.NDArray[np.int64]
    indexed: npt.NDArray[np.int64]
    held: npt.NDArray[np.int64]  # believed's blocks of every tier, per candidate
    candidate_of_row: npt.NDArray[np.intp]  # roster row -> candidate row, -1: none
    keys: list[BlockKey]
    root: BlockKey  # of the keys' namespace: where their chain, and a rest's, starts
    prompt_tokens: int  # the whole prompt's count, estimated while only its start is keyed
    whole_prompt: bool  # False: `keys` are its start's; the rest is not tokenised yet
    block_size: int
    index_answered: bool  # False: load-only (plus this router's predictions)
    factor: str
    seconds: float
    # Prefill/decode disaggregation: how the request is served (None: its model's
    # workers do not split requests), and the prefill workers for its prefill leg,
    # best first (None: not split).
    legs: LegPlan | None = None
    prefill_ranked: RankedWorkers | None = None

    def prefill_worker_ids(self, at_most: int) -> list[str]:
        """The prefill workers to try for a split request's prefill leg, best first."""
        ranked = self.prefill_ranked
        if ranked is None:
            return []
        return [ranked.worker_id(i) for i in range(min(len(ranked), at_most))]

    def matched(self, worker_id: str) -> Mapping[Tier, int]:
        """The blocks per tier believed cached at a candidate (empty: none, or not a
        candidate)."""
        row = self._row(worker_id)
        if row < 0:
            return {}
        believed = self.believed[row].tolist()
        return {tier: blocks for tier, blocks in zip(TIERS, believed, strict=True) if blocks}

    def predicted_tokens(self, worker_id: str) -> int:
        """The cached prefix the router expects the engine to report for this request."""
        row = self._row(worker_id)
        return 0 if row < 0 else int(self.held[row]) * self.block_size

    def indexed_tokens(self, worker_id: str) -> int:
        """The part of the prediction the worker's own events vouched for (a predicted
        entry may still be prefilling on the engine, which cannot share it yet)."""
        row = self._row(worker_id)
        return 0 if row < 0 else int(self.indexed[row]) * self.block_size

    def info(self, worker_id: str) -> WorkerInfo:
        """A candidate's registration (its address, incarnation, model)."""
        return self.roster.info(worker_id)

    def longest_match(self) -> LongestMatch | None:
        """The longest prefix any candidate was believed to hold; None when nothing
        matched."""
        held = self.held
        blocks = int(held.max()) if len(held) else 0
        if blocks == 0:
            return None
        return LongestMatch(
            key=self.keys[blocks - 1],
            tokens=blocks * self.block_size,
            holder_eligible=bool(self.ranked.scores.eligible[held == blocks].any()),
        )

    def rest_could_change_choice(self) -> bool:
        """Whether the prompt's rest, keyed too, could change the best-ranked worker.
        Blocks past the start are held only where all of the start's are, and a score
        only grows with the blocks held: so only a candidate holding the whole start
        could gain, and only one that does not rank first could overtake."""
        if self.whole_prompt or not self.ranked:
            return False
        if not self.keys:  # no block of the start: anyone could hold the rest
            return True
        holders = self.held >= len(self.keys)
        if not np.any(holders & self.ranked.scores.eligible):
            return False
        return not bool(holders[self.ranked.rows[0]])

    def off_device_tokens(self, worker_id: str) -> int:
        """The part of predicted_tokens() held on host, disk or remote tiers."""
        row = self._row(worker_id)
        if row < 0:
            return 0
        blocks = self.believed[row]
        return int(blocks.sum() - blocks[_DEVICE_COLUMN]) * self.block_size

    def _row(self, worker_id: str) -> int:
        roster_row = self.roster.position.get(worker_id)
        return -1 if roster_row is None else int(self.candidate_of_row[roster_row])


def _leg_side(
    facts: CandidateFacts, ranked: RankedWorkers, position: int, prefill_only: Flags
) -> LegSide:
    row = int(ranked.rows[position])
    return LegSide(
        worker_id=ranked.worker_id(position),
        cached_tokens=ranked[position].cached_tokens,
        queued_prefill_tokens=float(facts.queued_prefill_tokens[row]),
        running_requests=float(facts.running_requests[row]),
        takes_whole=not bool(prefill_only[row]),
    )


def servable_blocks(prompt_tokens: int, block_size: int) -> int:
    """Blocks an engine can serve from cache: it always computes the prompt's last token,
    so a fully cached prompt hits one token short of its length."""
    return max(0, prompt_tokens - 1) // block_size


class RoutingPlanner:
    def __init__(
        self,
        *,
        index: LocationIndex,
        pool: WorkerPool,
        predicted: PredictedPrefixes,
        policy: RoutingPolicy,
        block_size: int,
        index_timeout_s: float,
        tracer: Tracer,
        disaggregation: DisaggregationSettings | None = None,
        rng: np.random.Generator | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.index = index
        self.disaggregation = disaggregation or DisaggregationSettings()
        self.pool = pool
        self.predicted = predicted
        self.policy = policy
        self.block_size = block_size
        self.index_timeout_s = index_timeout_s
        self.tracer = tracer
        self.rng = rng or np.random.default_rng()
        self._clock = clock
        self.index_answering = True
        self._next_lookup_probe = 0.0  # while the index is down: when to try it again

    def keys(self, model: str, cache_scope: str, tokens: Sequence[int]) -> list[BlockKey]:
        return chain_keys(self._root(model, cache_scope), tokens, self.block_size)

    def _root(self, model: str, cache_scope: str) -> BlockKey:
        return root_key(
            KeyNamespace(model=model, block_size=self.block_size, cache_scope=cache_scope)
        )

    async def decide(
        self,
        *,
        model: str,
        tenant: Tenant,
        cache_scope: str,
        tokens: Sequence[int],
        counted_as_engines: bool = True,
        more_tokens: int = 0,
        more_tokens_at_most: int = 0,
    ) -> Decision:
        """Rank the candidates serving `model` for a prompt of `tokens`, keyed in
        `cache_scope` (the tenant's salt, or a salt the client sent in the shared
        scope; empty for none). `counted_as_engines`: the engines count the prompt as
        `tokens` does, so a worker whose max_model_len it exceeds is no candidate.
        `more_tokens_at_most` > 0: `tokens` are the prompt's start, and its rest (an
        estimated `more_tokens`, at most `more_tokens_at_most`) is not tokenised yet:
        the costs count the estimate, max_model_len the most it can be."""
        started = time.perf_counter()
        with self.tracer.start_as_current_span("kvplane.key") as span:
            root = self._root(model, cache_scope)
            keys = chain_keys(root, tokens, self.block_size)
            span.set_attribute("kvplane.blocks", len(keys))
        # No worker at all: nothing to look up. (Working out which workers are routable
        # costs about as much as the lookup itself, and is done after it anyway.)
        index_matches, answered = await self._lookup(keys, wanted=len(self.pool.roster) > 0)
        with self.tracer.start_as_current_span("kvplane.score") as span:
            span.set_attribute("kvplane.index_answered", answered)
            now = self._clock()
            roster = self.pool.roster  # (after the lookup's await: the current one)
            rows = self.pool.serving_rows(model)
            private = tenant.isolation == "private"  # only they pay for others' company
            facts = self.pool.facts(roster, rows, tenant.name if private else None, now)
            self.predicted.prune(now)
            predicted = self.predicted.match(keys, now) if len(rows) else {}
            # Where each roster row sits among the candidates; -1: not one (and the
            # extra last row stands for workers the roster does not know).
            candidate_of_row = np.full(len(roster) + 1, -1, dtype=np.intp)
            candidate_of_row[rows] = np.arange(len(rows), dtype=np.intp)
            index_tiers = _index_tiers(index_matches, roster, candidate_of_row, len(rows))
            whole = more_tokens_at_most == 0
            # Of a prompt's start every block is servable: its last token comes later.
            limit = servable_blocks(len(tokens), self.block_size) if whole else len(keys)
            indexed = index_tiers.sum(axis=1)
            believed = believed_blocks(
                index_tiers,
                indexed,
                _predicted(predicted, roster, candidate_of_row, len(rows)),
                limit,
            )
            facts.matched_tokens[:] = believed * self.block_size
            request = RequestFacts(
                prompt_tokens=len(tokens) + more_tokens,
                prompt_tokens_at_most=len(tokens) + more_tokens_at_most,
                isolation=tenant.isolation,
                required_labels=tenant.required_labels,
                pool=tenant.pool,
                counted_as_engines=counted_as_engines,
            )
            legs, prefill_ranked = None, None
            if not roster.has_roles:
                ranked, factor = self.policy.rank(request, facts, self.rng)
            else:
                prefill_only = roster.prefill_only[rows]
                excluded = prefill_only if prefill_only.any() and not prefill_only.all() else None
                # Whole requests and decode legs go to a prefill-only worker only when
                # no other is live.
                ranked, factor = self.policy.rank(
                    request, facts._replace(excluded=excluded), self.rng
                )
                legs, prefill_ranked = self._plan_legs(request, facts, roster, rows, ranked)
            span.set_attribute("kvplane.candidates", len(rows))
            span.set_attribute("kvplane.factor", factor)
            if legs is not None:
                span.set_attribute("kvplane.legs", legs.reason.value)
                if legs.prefill_worker is not None:
                    span.set_attribute("kvplane.prefill_worker", legs.prefill_worker)
        return Decision(
            ranked=ranked,
            candidates=facts.worker_ids,
            roster=roster,
            believed=believed,
            indexed=np.minimum(indexed, limit),
            held=believed.sum(axis=1),
            candidate_of_row=candidate_of_row,
            keys=keys,
            root=root,
            prompt_tokens=len(tokens) + more_tokens,
            whole_prompt=whole,
            block_size=self.block_size,
            index_answered=answered,
            factor=factor,
            seconds=time.perf_counter() - started,
            legs=legs,
            prefill_ranked=prefill_ranked if legs is not None and legs.split else None,
        )

    def _plan_legs(
        self,
        request: RequestFacts,
        facts: CandidateFacts,
        roster: Roster,
        rows: Rows,
        ranked: RankedWorkers,
    ) -> tuple[LegPlan | None, RankedWorkers | None]:
        """Whole or split (router/scoring/disaggregation.py), for the best-ranked
        worker; (None, None) for a model none of whose workers transfers KV."""
        takes_prefill = roster.takes_prefill_legs[rows]
        takes_decode = roster.takes_decode_legs[rows]
        if not ranked or not (takes_prefill.any() or takes_decode.any()):
            return None, None
        best = int(ranked.rows[0])
        decode_id = ranked.worker_id(0)
        if roster.prefill_only[rows].all():
            return LegPlan(decode_id, None, LegReason.NO_DECODE_WORKER), None
        if not takes_prefill.any():
            return LegPlan(decode_id, None, LegReason.NO_PREFILL_WORKER), None
        if self.disaggregation.mode == "never":
            return LegPlan(decode_id, None, LegReason.NEVER), None
        peers = (
            takes_prefill
            & (roster.kv_connectors[rows] == roster.kv_connectors[rows[best]])
            & (np.arange(len(rows)) != best)
        )
        prefill_ranked = None
        if takes_decode[best] and peers.any():
            prefill_ranked, _ = self.policy.rank(request, facts._replace(excluded=~peers), self.rng)
        prefill_only = roster.prefill_only[rows]
        decode = _leg_side(facts, ranked, 0, prefill_only)
        prefill = _leg_side(facts, prefill_ranked, 0, prefill_only) if prefill_ranked else None
        plan = plan_legs(
            request.prompt_tokens, decode, prefill, self.policy.weights, self.disaggregation
        )
        return plan, prefill_ranked

    def routed(self, decision: Decision, worker_id: str) -> None:
        """The request went to `worker_id`: its prefix is predicted there from now on."""
        servable = (
            decision.keys[: servable_blocks(decision.prompt_tokens, self.block_size)]
            if decision.whole_prompt
            else decision.keys
        )
        self.predicted.record(worker_id, servable, self._clock())
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", _routed_line(decision, worker_id, servable[-1] if servable else None))

    def routed_rest(self, decision: Decision, worker_id: str, token_ids: Sequence[int]) -> None:
        """The whole prompt (`token_ids`) of a request routed on its start (`decision`,
        whose keys are the start's): its blocks past the start keyed on from the start's
        chain, in its namespace, and the whole predicted where it went (the start's
        blocks renewed)."""
        start = decision.keys
        parent = start[-1] if start else decision.root
        rest = chain_keys(parent, token_ids[len(start) * self.block_size :], self.block_size)
        servable = (start + rest)[: servable_blocks(len(token_ids), self.block_size)]
        self.predicted.record(worker_id, servable, self._clock())

    async def _lookup(
        self, keys: list[BlockKey], wanted: bool
    ) -> tuple[dict[str, PrefixMatch], bool]:
        if not keys or not wanted:
            return {}, True
        if not self.index_answering and self._clock() < self._next_lookup_probe:
            # An index that stopped answering costs each request its timeout: only one
            # request per probe interval pays it, the others route on load at once.
            return {}, False
        deadline = (
            _NO_DEADLINE if self.index.lookup_never_waits else index_deadline(self.index_timeout_s)
        )
        try:
            async with deadline:
                matches = await self.index.lookup(keys)
        except LocationIndexError as error:  # the index is down or slow: route on load alone
            if self.index_answering:
                log.warning(
                    "the index did not answer a lookup (%s): routing on load only until it does",
                    type(error).__name__,
                )
            self.index_answering = False
            self._next_lookup_probe = self._clock() + INDEX_PROBE_INTERVAL_S
            return {}, False
        if not self.index_answering:
            log.warning("the index answers lookups again: routing on cached prefixes")
        self.index_answering = True
        return matches, True


_LOGGED_CANDIDATES = 8  # a line per decision stays short in a fleet of thousands


def _routed_line(decision: Decision, worker_id: str, last_key: BlockKey | None) -> str:
    """One decision, for the debug log: numbers and hashes only, never the prompt. A
    block key names its whole prefix: where the longest match ends at an earlier
    request's `prefix` key, this request extends that one (a chat's next turn whose
    engine did not also cache the answer), and it can be told without any text."""
    candidates = "; ".join(
        f"{b.worker_id} cached={b.cached_tokens} saved={b.saved_tokens:.0f} "
        f"queue={b.queue_penalty:.0f} memory={b.memory_penalty:.0f} "
        f"copy={b.copy_penalty:.0f} tenant={b.tenant_penalty:.0f}"
        for b in decision.ranked[:_LOGGED_CANDIDATES]
    )
    longest = int(decision.held.max(initial=0))
    return (
        f"routed {decision.prompt_tokens} prompt tokens (prefix {_hex(last_key)}, longest "
        f"match ending at {_hex(decision.keys[longest - 1] if longest else None)}) to "
        f"{worker_id} by {decision.factor}; ranked: {candidates}"
    )


def _hex(key: BlockKey | None) -> str:
    return "none" if key is None else f"{key:016x}"


def _index_tiers(
    matches: Mapping[str, PrefixMatch],
    roster: Roster,
    candidate_of_row: npt.NDArray[np.intp],
    candidates: int,
) -> npt.NDArray[np.int64]:
    """The index's matched blocks per candidate and tier. (In a fleet whose workers
    share a system prompt every worker matches: one pass over the matches, the device
    tier set in bulk, the rare mixed tiers apart.)"""
    tiers = np.zeros((candidates, len(TIERS)), dtype=np.int64)
    if not matches:
        return tiers
    unknown = len(roster)
    position = roster.position
    rows: list[int] = []
    device: list[int] = []
    mixed: list[PrefixMatch] = []
    for match in matches.values():
        on_device = match.by_tier.get(Tier.DEVICE, 0)
        if on_device == match.blocks:
            rows.append(position.get(match.worker_id, unknown))
            device.append(on_device)
        else:
            mixed.append(match)
    where = candidate_of_row[rows]
    kept = where >= 0
    tiers[where[kept], 0] = np.asarray(device, dtype=np.int64)[kept]
    for match in mixed:
        row = candidate_of_row[position.get(match.worker_id, unknown)]
        if row >= 0:
            for tier, count in match.by_tier.items():
                tiers[row, tier - Tier.DEVICE] = count
    return tiers


def _predicted(
    predicted: Mapping[str, int],
    roster: Roster,
    candidate_of_row: npt.NDArray[np.intp],
    candidates: int,
) -> npt.NDArray[np.int64]:
    """This router's predicted blocks per candidate."""
    blocks = np.zeros(candidates, dtype=np.int64)
    for worker_id, count in predicted.items():
        row = candidate_of_row[roster.position.get(worker_id, len(roster))]
        if row >= 0:
            blocks[row] = count
    return blocks


def believed_blocks(
    index_tiers: npt.NDArray[np.int64],
    indexed: npt.NDArray[np.int64],
    predicted: npt.NDArray[np.int64],
    limit: int,
) -> npt.NDArray[np.int64]:
    """Blocks per tier each worker is believed to hold (rows as the arguments'): the
    index's match (`indexed`: its blocks of every tier), extended on the device tier by
    a longer prediction, cut to the `limit` the engine can serve, the slowest tiers
    giving way first."""
    longer = np.maximum(predicted - indexed, 0)
    tiers = index_tiers.copy()
    tiers[:, 0] += longer
    excess = indexed + longer - limit
    if excess.max(initial=0) <= 0:  # the usual case: nothing past what the engine can serve
        return tiers
    excess = np.maximum(excess, 0)
    for column in reversed(range(len(TIERS))):
        cut = np.minimum(excess, tiers[:, column])
        tiers[:, column] -= cut
        excess -= cut
    return tiers
