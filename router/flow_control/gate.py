"""Flow control's gate: while a model's engines are saturated (router/flow_control/
saturation.py), its requests wait here rather than in the engines' queues, and go on
in band, fairness and deadline order (router/flow_control/queue.py) as the engines
make room. A request is let through before it is routed: its worker is chosen after
its wait, on the index and load of that moment (late binding).

A request that cannot wait is shed with a 429 saying why (`x-kvplane-shed-reason`):
`queue_full` (the model's queue is full and the request is its own flood's newest, or
in the lowest band), `displaced` (a request of a higher band or a less served tenant
took its place), `queue_timeout` (it waited `max_wait_s`), `deadline` (its first byte
could not come by its deadline), `preempted` (it was sent, and a request of a higher
band took its place before its engine answered: the embedded proxy's requests only, a
gateway's are Envoy's to move).

What a tenant is served is charged to its virtual counter (router/flow_control/
counters.py): its prompt tokens at the grant, corrected at dispatch to those not
predicted cached where it went; and its answer at the grant too, as long as its
tenant's answers have lately been (no longer than its client allows), then as it
streams past that, corrected to what was generated at its end. Charged only as it is
computed, a long answer would let its tenant's counter lag for as long as it runs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np

from kvplane.core.clock import Clock
from kvplane.core.config import FlowControlSettings
from router.errors import RequestRefused
from router.flow_control.bands import Placement, engine_priority
from router.flow_control.counters import RecentDemand, ServiceCounters
from router.flow_control.queue import ModelQueue, Waiting
from router.flow_control.saturation import (
    UNBOUNDED,
    Engines,
    ReplicaTraffic,
    room,
    would_wait,
)
from router.flow_control.shared import (
    STATE_TTL_INTERVALS,
    Elsewhere,
    FlowExchange,
    SharedCounters,
)
from router.index.base import LocationIndexError, SharedFlowState, index_deadline
from router.metrics import RouterMetrics
from router.tenants import Tenant

log = logging.getLogger(__name__)

SHED_REASON_HEADER = "x-kvplane-shed-reason"
ShedReason = Literal["queue_full", "displaced", "queue_timeout", "deadline", "preempted"]
TICK_S = 0.02  # while requests wait: how often room is looked for without a request ending
LEFT_TO_ELSEWHERE_EXCHANGES = 2  # see FlowGate._left_to_elsewhere
ANSWER_MEAN_WEIGHT = 0.1  # of a tenant's latest answer, in the mean it is charged ahead by
# The most answers a request is counted for (OpenAI's API takes `n` up to 128; past it,
# its answers count as fewer and longer): a client's absurd `n` must not charge, then
# refund, a sum that rounds its tenant's counter away, or make its demand hide a flood's.
MAX_ANSWERS = 128
# The most prompts a completions batch is counted for (OpenAI's API takes up to 2,048),
# for the same reason: only the body's size bounds a batch.
MAX_PROMPTS = 2048
_RATE_SAMPLES = 64  # grants the dispatch rate (for Retry-After and deadlines) is read over
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Shed:
    """Why a request was shed, and when trying again may succeed."""

    reason: ShedReason
    retry_after_s: int
    message: str

    def error(self) -> RequestRefused:
        return RequestRefused(
            429,
            f"{self.reason}: {self.message}",
            kind="RateLimitError",
            outcome=f"shed_{self.reason}",
            headers={"retry-after": str(self.retry_after_s), SHED_REASON_HEADER: self.reason},
        )


def answer_cost(
    settings: FlowControlSettings, prompt_tokens: int, tokens: int, answers: int = 1
) -> float:
    """What `answers` answers of `tokens` in all cost (a request's `n`, each as long):
    `output_token_cost` a token, and `context_token_cost` a token of the context each
    holds as it is computed (the prompt, and its own answer before it)."""
    context = tokens * (prompt_tokens + (tokens / answers - 1) / 2)
    return tokens * settings.output_token_cost + context * settings.context_token_cost


class FlowPass:
    """A request let through the gate, until it ends: what it is charged."""

    __slots__ = (
        "_answer_charge",
        "_answer_tokens",
        "_answers",
        "_cancel",
        "_charged_ahead",
        "_gate",
        "_input_charge",
        "_prompt_tokens",
        "_prompts",
        "_tenant",
        "backlogged",
        "band",
        "closed",
        "dispatched_once",
        "generated_tokens",
        "model",
        "preempted",
        "seq",
        "waits_in_engine",
    )

    def __init__(
        self,
        gate: FlowGate,
        model: str,
        tenant: Tenant,
        prompt_tokens: int,
        band: int,
        *,
        answer_tokens: int = 0,
        answers: int = 1,
        prompts: int = 1,
        backlogged: bool = False,
    ) -> None:
        """`answer_tokens`: its `answers` answers' tokens charged for ahead; `prompts`:
        the prompts of a batch, each charged as the first (`prompt_tokens`, what routing
        reads), and each asking for its own answers."""
        self._gate = gate
        self.model = model
        self._tenant = tenant
        self.band = band
        self.backlogged = backlogged  # its tenant had more waiting as it was let through
        self.seq = gate.next_seq()
        self.dispatched_once = False
        self.closed = False
        self.preempted = False
        # Streamed and sent where its engine's batch was full: it waits in the engine's
        # queue, where preempting it costs nothing (a request running there, or one
        # whose answer says nothing until it ends, is never preempted).
        self.waits_in_engine = False
        self._cancel: Callable[[], object] | None = None
        self.generated_tokens = 0
        self._prompt_tokens = prompt_tokens
        self._answer_tokens = answer_tokens
        self._answers = answers
        self._prompts = prompts
        self._input_charge = prompt_tokens * prompts * gate.settings.input_token_cost
        gate.charge(model, tenant, self._input_charge)
        self._answer_charge = 0.0
        self._charged_ahead = 0.0  # of the answer's charge, for tokens not generated yet
        self._charge_answer(answer_tokens)
        gate.releasing[model] = gate.releasing.get(model, 0) + 1

    @property
    def engine_priority(self) -> int:
        """vLLM's `priority` for it, where its engine runs priority scheduling."""
        return engine_priority(self.band, self.backlogged)

    def dispatched(self, computed_tokens: int) -> None:
        """Sent to a worker that computes `computed_tokens` of its prompt (the first
        dispatch only: a failover's is not charged again). Its traffic counts at the
        worker from now on, so it no longer takes room as a request let through."""
        if self.dispatched_once:
            return
        self.dispatched_once = True
        gate = self._gate
        gate.releasing[self.model] -= 1
        charge = computed_tokens * self._prompts * gate.settings.input_token_cost
        gate.charge(self.model, self._tenant, charge - self._input_charge)
        gate.served(self._tenant, "input", charge)
        self._input_charge = charge

    def generated(self, tokens: int) -> None:
        """`tokens` more generated for it as it streams, or fewer (negative) where its
        usage at the end corrects the count."""
        if tokens:
            self.generated_tokens += tokens
            self._charge_answer(max(self.generated_tokens, self._answer_tokens))

    def _charge_answer(self, tokens: int) -> None:
        """Its answer charged as `tokens` long, what was charged before corrected."""
        gate, settings = self._gate, self._gate.settings
        charge = answer_cost(settings, self._prompt_tokens, tokens, self._answers)
        ahead = charge - answer_cost(
            settings, self._prompt_tokens, self.generated_tokens, self._answers
        )
        gate.charge(self.model, self._tenant, charge - self._answer_charge)
        gate.charged_ahead(self.model, self._tenant, ahead - self._charged_ahead)
        self._answer_charge, self._charged_ahead = charge, ahead

    def arm(self, cancel: Callable[[], object]) -> None:
        """Its engine has it and has not answered yet: until `disarm`, a waiting request
        of a higher band may take its place (`cancel` stops the attempt)."""
        if not self.closed:
            self._cancel = cancel
            self._gate.armed(self)

    def disarm(self) -> None:
        """Its first byte came (or its attempt ended): it is no longer preempted."""
        if self._cancel is not None:
            self._cancel = None
            self._gate.disarmed(self)

    def preempt(self) -> None:
        """Stop its attempt before its first byte: it is shed (`preempted`)."""
        cancel = self._cancel
        self.preempted = True
        self.disarm()
        if cancel is not None:
            cancel()

    def shed(self) -> Shed:
        """Its shedding, once preempted."""
        return self._gate.preempted_shed(self.model, self._tenant)

    def close(self) -> None:
        """The request has ended (idempotent): room may have been made."""
        gate = self._gate
        if self.closed:
            return
        self.closed = True
        self.disarm()
        if self.preempted:
            gate.preempting[self.model] -= 1
        if not self.dispatched_once:  # never sent: nothing was served
            self.dispatched_once = True
            gate.releasing[self.model] -= 1
            gate.charge(self.model, self._tenant, -self._input_charge)
        self.generated_tokens = max(0, self.generated_tokens)
        self._charge_answer(self.generated_tokens)  # what it was, in the end
        if self.generated_tokens > 0:
            gate.served(self._tenant, "output", self._answer_charge)
            gate.answered(self.model, self._tenant.name, self.generated_tokens / self._answers)
        gate.dispatch(self.model)


@dataclass(frozen=True, slots=True)
class ModelFlow:
    """One model's flow, as the fleet API shows it."""

    model: str
    room: int | None  # requests its engines can take now; None: no limit known
    waiting: dict[int, dict[str, int]]  # band -> tenant -> requests waiting here
    waiting_elsewhere: dict[int, dict[str, int]]  # at the other replicas
    counters: dict[str, float]  # tenant -> virtual counter


@dataclass(frozen=True, slots=True)
class TenantFlow:
    """One tenant's service and shedding since the router started."""

    tenant: str
    service_tokens: float  # in cost units (input, output and context token costs)
    shed: dict[str, int]  # reason -> requests


@dataclass(frozen=True, slots=True)
class FlowSnapshot:
    replicas: int  # router replicas sharing flow control (this one included)
    models: list[ModelFlow]
    tenants: list[TenantFlow]


@dataclass(slots=True)
class _Waiter:
    tenant: Tenant
    prompt_tokens: int
    answer_tokens: int
    answers: int
    prompts: int
    future: asyncio.Future[FlowPass | Shed]


class FlowGate:
    def __init__(
        self,
        settings: FlowControlSettings,
        engines: Engines,
        metrics: RouterMetrics,
        *,
        shared: SharedFlowState | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        """`shared`: the store router replicas exchange their state through (None: this
        router alone)."""
        self.settings = settings
        self._engines = engines
        self._exchange = None if shared is None else FlowExchange(shared, settings.shared_refresh_s)
        self.counters = ServiceCounters() if shared is None else SharedCounters()
        self._demand = RecentDemand(settings.recent_demand_window_s)
        self._elsewhere = Elsewhere()
        self._exchanged_at = -math.inf
        self._metrics = metrics
        self._clock = clock
        self._queues: dict[str, ModelQueue] = {}
        self._waiters: dict[Waiting, _Waiter] = {}
        self.releasing: dict[str, int] = {}  # per model: let through, not yet dispatched
        self._grants: dict[str, deque[float]] = {}  # per model: when the latest were let through
        self._published: set[tuple[str, int]] = set()  # (model, band) gauges set
        self._service: dict[str, float] = {}  # tenant -> cost units served
        self._shed_counts: dict[str, dict[str, int]] = {}  # tenant -> reason -> requests
        self._replicas = 1
        # Requests sent and not yet answered, which a higher band may preempt, per model;
        # and those preempted that have not ended yet.
        self._armed: dict[str, dict[FlowPass, None]] = {}
        self.preempting: dict[str, int] = {}
        # Per model: the waiting request the latest preemption made room for. It is
        # given one place: the room a load report counts late (one sampled before the
        # victim ended) must not cost a second victim.
        self._preempted_for: dict[str, Waiting] = {}
        # Per model: since when the places kept for lighter tenants have been left to
        # those waiting at other replicas without one of theirs going, and how many of
        # their requests waited there at the last look.
        self._left_since: dict[str, tuple[float, int]] = {}
        # Per (model, tenant): its answers' length lately, and what its requests here
        # were charged ahead for answers not generated yet (on its counter's scale).
        self._answer_means: dict[tuple[str, str], float] = {}
        self._ahead: dict[tuple[str, str], float] = {}
        self._seq = 0
        self._busy = asyncio.Event()

    # -- a request's way through ------------------------------------------------------

    async def enter(
        self,
        tenant: Tenant,
        model: str,
        placement: Placement,
        prompt_tokens: int,
        waiting_for: Callable[[Awaitable[FlowPass | Shed]], Awaitable[FlowPass | Shed]]
        | None = None,
        *,
        answer_limit: int = 0,
        answers: int = 1,
        prompts: int = 1,
    ) -> FlowPass | None:
        """Let through now, or once the engines make room (`waiting_for` wraps the
        wait: the proxy's ends it when the client leaves; `answer_limit`: the longest
        answer its client allows, 0 where it set none; `answers`: how many it asks
        for, its `n`, for each of the `prompts` of a batch, charged as long as the
        first, `prompt_tokens`); raises the Shed's
        RequestRefused when the request cannot wait. None: no worker can take it, and
        it is not held (routing refuses it at once)."""
        queued_as = self._engines.queue_model(model)
        if queued_as is None:
            return None
        model = queued_as
        now = self._clock()
        settings = self.settings
        prompts = min(prompts, MAX_PROMPTS)
        answers = min(answers, MAX_ANSWERS) * prompts
        answer_tokens = self._expected_answer(model, tenant.name, answer_limit) * answers
        cost = (
            prompt_tokens * prompts * settings.input_token_cost
            + answer_cost(settings, prompt_tokens, answer_tokens, answers)
        ) / tenant.share
        self._demand.asked(model, tenant.name, cost, now)
        queue = self._queue(model)
        self._lift(model, tenant, placement.band, queue)
        elsewhere = self._elsewhere
        if (
            not queue
            and not elsewhere.waiting(model, placement.band)
            and not elsewhere.higher_band_waits(model, placement.band)
            and self.room(model) > 0
        ):
            return FlowPass(
                self,
                model,
                tenant,
                prompt_tokens,
                placement.band,
                answer_tokens=answer_tokens,
                answers=answers,
                prompts=prompts,
            )
        deadline_at = None if placement.deadline_s is None else now + placement.deadline_s
        waiting = queue.new(tenant.name, placement.band, now, deadline_at, cost)
        self._admit_to_queue(model, queue, waiting, tenant, placement.deadline_s)
        future: asyncio.Future[FlowPass | Shed] = asyncio.get_running_loop().create_future()
        self._waiters[waiting] = _Waiter(
            tenant, prompt_tokens, answer_tokens, answers, prompts, future
        )
        queue.push(waiting)
        self._busy.set()
        self.dispatch(model)  # its turn may be now (another replica's requests waited)
        self._publish(model)
        limit_s = self.settings.max_wait_s
        if placement.deadline_s is not None:
            limit_s = min(limit_s, placement.deadline_s)
        outcome: FlowPass | Shed | None = None
        try:
            async with asyncio.timeout(limit_s):
                outcome = await (future if waiting_for is None else waiting_for(future))
        except TimeoutError:
            if future.done() and not future.cancelled():
                outcome = future.result()  # let through as the time ran out
            else:
                reason: ShedReason = (
                    "queue_timeout" if limit_s == self.settings.max_wait_s else "deadline"
                )
                outcome = self._shed(model, tenant, reason, f"waited {limit_s:g} s for room")
        finally:
            if queue.remove(waiting):
                self._publish(model)
            self._waiters.pop(waiting, None)
            if outcome is None and future.done() and not future.cancelled():
                late = future.result()  # let through as the wait was given up
                if isinstance(late, FlowPass):
                    late.close()
            # Every wait, a client's that left before its turn too (among the longest).
            self._metrics.flow_wait_seconds.labels(
                band=str(placement.band), tenant=tenant.name
            ).observe(self._clock() - now)
        if isinstance(outcome, Shed):
            raise outcome.error()
        return outcome

    def _admit_to_queue(
        self,
        model: str,
        queue: ModelQueue,
        waiting: Waiting,
        tenant: Tenant,
        deadline_s: float | None,
    ) -> None:
        """Raises the Shed of `waiting` where its deadline cannot be met, or the queue
        is full and it is the one to shed; sheds whom it displaces otherwise."""
        rate = self._dispatch_rate(model)
        if deadline_s is not None and rate > 0 and len(queue) / rate > deadline_s:
            ahead_s = len(queue) / rate
            raise self._shed(
                model, tenant, "deadline", f"about {ahead_s:.1f} s of requests wait ahead"
            ).error()
        if len(queue) < self.settings.max_queued_requests:
            return
        victim = queue.victim(waiting, self._counter(model))
        message = f"model {model!r} has {len(queue)} requests waiting, its limit"
        if victim is waiting:
            raise self._shed(model, tenant, "queue_full", message).error()
        queue.remove(victim)
        waiter = self._waiters.pop(victim)
        if not waiter.future.done():
            waiter.future.set_result(self._shed(model, waiter.tenant, "displaced", message))

    def _lift(self, model: str, tenant: Tenant, band: int, queue: ModelQueue) -> None:
        """A tenant that starts waiting in `band` is brought within the counters of the
        tenants waiting there: no credit for idling, no debt beyond theirs. Not one that
        waits at another replica: it has not stopped waiting (brought down each time its
        requests here had all gone through, a flood spread over replicas shed its debt)."""
        elsewhere = self._elsewhere.waiting(model, band)
        if queue.waits(tenant.name, band) or tenant.name in elsewhere:
            return
        waiting = set(queue.backlogged(band)) | elsewhere.keys()
        waiting.discard(tenant.name)
        # Counters less what was charged ahead here for answers still to come (refunded
        # where they come out shorter): a tenant lowered to a counter with its own
        # charges ahead in it would be in credit once they were refunded.
        others = [self._settled(model, name) for name in waiting]
        if others:
            ahead = self._ahead.get((model, tenant.name), 0.0)
            self.counters.clamp(model, tenant.name, min(others) + ahead, max(others) + ahead)

    def _settled(self, model: str, tenant: str) -> float:
        return self.counters.value(model, tenant) - self._ahead.get((model, tenant), 0.0)

    def _expected_answer(self, model: str, tenant: str, limit: int) -> int:
        """Each answer a request is charged for ahead: as long as its tenant's answers
        have lately been, no longer than its client allows (none before its tenant's
        first answer: it is charged as it streams). Not the client's limit alone: clients
        set it far past what they use, or set none."""
        mean = self._answer_means.get((model, tenant))
        if mean is None:
            return 0
        expected = math.ceil(mean)
        return min(expected, limit) if limit > 0 else expected

    def answered(self, model: str, tenant: str, tokens: float) -> None:
        """One of `tenant`'s requests' answers came out `tokens` long (each, where it
        asked for several)."""
        key = (model, tenant)
        mean = self._answer_means.get(key)
        self._answer_means[key] = (
            float(tokens) if mean is None else mean + ANSWER_MEAN_WEIGHT * (tokens - mean)
        )

    def charged_ahead(self, model: str, tenant: Tenant, amount: float) -> None:
        """`amount` more (less) charged to `tenant` for answers not generated yet."""
        key = (model, tenant.name)
        left = self._ahead.get(key, 0.0) + amount / tenant.share
        if left > 1e-9:
            self._ahead[key] = left
        else:
            self._ahead.pop(key, None)

    # -- letting requests through -----------------------------------------------------

    def room(self, model: str) -> int:
        """Requests `model`'s engines can take now, less those let through and not yet
        sent."""
        return self._rooms(model, self.settings.max_engine_waiting)[0]

    def _rooms(self, model: str, *depths: int) -> list[int]:
        """The room with each of `depths` waiting places per engine (a tenant with a
        backlog takes fewer), less the requests let through and not yet sent."""
        engines, settings = self._engines, self.settings
        queues = engines.engine_queues(engines.serving_rows(model))
        releasing = self.releasing.get(model, 0)
        return [room(queues, depth, settings.max_kv_usage) - releasing for depth in depths]

    def would_wait(self, worker_id: str) -> bool:
        """Whether a request sent to `worker_id` now would wait in its engine's queue."""
        row = self._engines.row_of(worker_id)
        if row is None:
            return False
        queues = self._engines.engine_queues(np.array([row], dtype=np.intp))
        return bool(would_wait(queues)[0])

    def dispatch(self, model: str) -> None:
        """Let through as many waiting requests as there is room for, in order."""
        queue = self._queues.get(model)
        if not queue:
            return
        settings = self.settings
        free, free_to_backlog = self._rooms(
            model, settings.max_engine_waiting, settings.backlogged_engine_waiting
        )
        counter = self._counter(model)
        fleet_free = free
        free = self._share_of_room(model, queue, free, counter)
        granted = 0
        while free > 0 and queue:
            waiting = queue.next(counter)
            assert waiting is not None
            backlogs = self._backlogs(model, queue, waiting.band)
            backlogged = waiting.tenant in backlogs
            if backlogged and free_to_backlog <= 0:
                # The places left are kept for tenants without a backlog: the best of
                # them waiting goes now, ahead of its turn, as it would have gone had it
                # come while the engines took the backlog's requests. With none waiting
                # here or at another replica, the backlog takes them (left empty, they
                # would idle the engines that a flood's queue elsewhere offsets in the
                # room).
                lighter = queue.next(counter, skip=backlogs)
                if lighter is not None:
                    waiting, backlogged = lighter, False
                elif self._left_to_elsewhere(model, waiting.band, backlogs):
                    break
            # Ahead of the backlogs waiting at other replicas too, for the same places.
            passed_over = backlogs if not backlogged and free_to_backlog <= 0 else ()
            if not self._its_turn(model, waiting, counter, passed_over):
                break  # the room is another replica's waiting tenant's
            queue.remove(waiting)
            waiter = self._waiters.pop(waiting)
            if waiter.future.done():  # its wait was given up
                continue
            waiter.future.set_result(
                FlowPass(
                    self,
                    model,
                    waiter.tenant,
                    waiter.prompt_tokens,
                    waiting.band,
                    answer_tokens=waiter.answer_tokens,
                    answers=waiter.answers,
                    prompts=waiter.prompts,
                    backlogged=backlogged,
                )
            )
            self._granted(model)
            free -= 1
            free_to_backlog -= 1
            granted += 1
        if granted:
            self._publish(model)
        if queue and fleet_free - granted <= 0:
            self._preempt_for(model, queue, counter)

    def _share_of_room(
        self, model: str, queue: ModelQueue, free: int, counter: Callable[[str], float]
    ) -> int:
        """Of the room every replica sees, this one's for this round: in proportion to
        the requests waiting here in the band of the next to go, of those waiting in it
        anywhere whose turn may come with it (their tenants' counters within the slack
        of its tenant's, or below), rounded up (one at least). The replica that sees
        room first (its own requests ending) would otherwise take it all, and the same
        tenant's requests would wait longer at the others."""
        if free <= 0 or not self._elsewhere.backlog:
            return free  # alone, or none waits elsewhere: all of it
        head = queue.next(counter)
        if head is None:
            return free
        within = counter(head.tenant) + self.settings.fairness_slack_tokens
        elsewhere = sum(
            count
            for tenant, count in self._elsewhere.waiting(model, head.band).items()
            if counter(tenant) <= within
        )
        here = queue.sizes()[head.band]
        return math.ceil(free * here / (here + elsewhere))

    def _preempt_for(self, model: str, queue: ModelQueue, counter: Callable[[str], float]) -> None:
        """Where the next waiting request's band is above a request sent and not yet
        answered, that request (the newest of the lowest band) gives up its place: one
        at a time per model, the next once it has ended, and one for each waiting
        request at most."""
        armed = self._armed.get(model)
        if not armed or self.preempting.get(model, 0):
            return
        head = queue.next(counter)
        if head is None or not self._its_turn(model, head, counter):
            return
        if self._preempted_for.get(model) is head:
            return
        victim = min(armed, key=lambda flow_pass: (flow_pass.band, -flow_pass.seq))
        if victim.band < head.band:
            self.preempting[model] = self.preempting.get(model, 0) + 1
            self._preempted_for[model] = head
            victim.preempt()

    def armed(self, flow_pass: FlowPass) -> None:
        self._armed.setdefault(flow_pass.model, {})[flow_pass] = None

    def disarmed(self, flow_pass: FlowPass) -> None:
        self._armed.get(flow_pass.model, {}).pop(flow_pass, None)

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def preempted_shed(self, model: str, tenant: Tenant) -> Shed:
        return self._shed(
            model,
            tenant,
            "preempted",
            "a request of a higher band took its place before its engine answered",
        )

    def _backlogs(self, model: str, queue: ModelQueue, band: int) -> set[str]:
        """The tenants waiting in `band` with a backlog: more than one request waiting
        (here and at the other replicas together), and asked here for more than their
        share lately. A tenant that asks only at other replicas is not known here."""
        elsewhere = self._elsewhere.waiting(model, band)
        here = queue.backlogged(band)
        over = self._demand.over_share(model, self._clock(), here)
        return {
            tenant
            for tenant in over & (set(here) | elsewhere.keys())
            if queue.count(tenant, band) + elsewhere.get(tenant, 0) > 1
        }

    def _left_to_elsewhere(self, model: str, band: int, backlogs: set[str]) -> bool:
        """Whether the places kept for tenants without a backlog are left to one waiting
        at another replica, which takes them once it sees them (at its next exchange):
        only to a tenant that asks here too, lighter by what this replica sees (one it
        does not know may be a flood pinned there), and only while such tenants' requests
        there keep going (fewer wait there than at the last look within two exchanges;
        a replica that leaves them waiting loses the places: two replicas must never
        leave them to each other)."""
        now = self._clock()
        asking = self._demand.asking(model, now)
        lighter = {
            tenant: count
            for tenant, count in self._elsewhere.waiting(model, band).items()
            if tenant in asking and tenant not in backlogs
        }
        if not lighter:
            self._left_since.pop(model, None)
            return False
        waiting = sum(lighter.values())
        since, before = self._left_since.get(model, (now, waiting))
        if waiting < before:  # some went there since the last look: it takes the places
            since = now
        self._left_since[model] = (since, waiting)
        return now - since < LEFT_TO_ELSEWHERE_EXCHANGES * self.settings.shared_refresh_s

    def _its_turn(
        self,
        model: str,
        waiting: Waiting,
        counter: Callable[[str], float],
        passed_over: Collection[str] = (),
    ) -> bool:
        """Whether no tenant waiting at another replica goes before `waiting`: none in
        a higher band, none in its band served less (beyond the slack) but those whose
        turn `waiting` takes (`passed_over`: backlogs, their places taken)."""
        elsewhere = self._elsewhere
        if elsewhere.higher_band_waits(model, waiting.band):
            return False
        others = [
            counter(tenant)
            for tenant in elsewhere.waiting(model, waiting.band)
            if tenant != waiting.tenant and tenant not in passed_over
        ]
        slack = self.settings.fairness_slack_tokens
        return not others or counter(waiting.tenant) <= min(others) + slack

    async def run_forever(self) -> None:
        """While requests wait: look for room every TICK_S (load reports make it as
        well as requests ending). With replicas: exchange with them every
        `shared_refresh_s`, waiting or not."""
        refresh_s = self.settings.shared_refresh_s
        while True:
            if self._exchange is None:
                await self._busy.wait()
            elif self._clock() - self._exchanged_at >= refresh_s:
                await self._share(self._exchange)
            waiting = [model for model, queue in self._queues.items() if queue]
            for model in waiting:
                self.dispatch(model)
            if waiting:
                await asyncio.sleep(TICK_S)
            elif self._exchange is None:
                self._busy.clear()
            else:
                await asyncio.sleep(refresh_s)

    async def _share(self, exchange: FlowExchange) -> None:
        """One exchange with the other replicas; on failure this router goes on with
        what it had, alone once that is older than a replica's state lives."""
        assert isinstance(self.counters, SharedCounters)
        traffic = self._engines.local_engines()
        backlog = {model: queue.tenants() for model, queue in self._queues.items() if queue}
        changes = self.counters.take_changes(backlog)
        try:
            async with index_deadline(self.settings.shared_refresh_s * STATE_TTL_INTERVALS / 2):
                exchanged, elsewhere, others = await exchange.exchange(traffic, backlog, changes)
        except LocationIndexError as error:
            self.counters.restore(changes)
            log.debug("flow control's exchange failed (%s)", type(error).__name__)
            if self._clock() - self._exchanged_at > exchange.ttl_s:
                self._elsewhere = Elsewhere()
                self._replicas = 1
                self._engines.shared_engines(ReplicaTraffic({}, {}, {}))
            return
        except Exception:  # a task's edge: a bug raised further is never seen, so log it
            self.counters.restore(changes)
            log.exception("flow control's exchange failed")
            return
        self._exchanged_at = self._clock()
        self._replicas = max(1, len(exchanged.states))
        self.counters.absorb(exchanged.counters)
        self._elsewhere = elsewhere
        self._engines.shared_engines(others)

    # -- charges, shedding, metrics ---------------------------------------------------

    def charge(self, model: str, tenant: Tenant, cost: float) -> None:
        self.counters.charge(model, tenant.name, cost / tenant.share)

    def served(self, tenant: Tenant, kind: str, cost: float) -> None:
        self._metrics.flow_service_tokens.labels(tenant=tenant.name, kind=kind).inc(cost)
        self._service[tenant.name] = self._service.get(tenant.name, 0.0) + cost

    def _counter(self, model: str) -> Callable[[str], float]:
        counters = self.counters.values(model)
        return lambda tenant: counters.get(tenant, 0.0)

    def _shed(self, model: str, tenant: Tenant, reason: ShedReason, message: str) -> Shed:
        self._metrics.flow_shed.labels(tenant=tenant.name, reason=reason).inc()
        shed = self._shed_counts.setdefault(tenant.name, {})
        shed[reason] = shed.get(reason, 0) + 1
        if reason in ("queue_full", "displaced"):
            rate = self._dispatch_rate(model)
            backlog_s = len(self._queue(model)) / rate if rate > 0 else 1.0
            retry_after_s = max(1, min(math.ceil(backlog_s), math.ceil(self.settings.max_wait_s)))
        else:
            retry_after_s = 1
        return Shed(reason, retry_after_s, message)

    def _granted(self, model: str) -> None:
        grants = self._grants.get(model)
        if grants is None:
            grants = self._grants[model] = deque(maxlen=_RATE_SAMPLES)
        grants.append(self._clock())

    def _dispatch_rate(self, model: str) -> float:
        """Requests let through from the queue a second, lately (0: not known)."""
        grants = self._grants.get(model)
        if grants is None or len(grants) < 2:
            return 0.0
        span = max(grants[-1] - grants[0], self._clock() - grants[-1])
        return (len(grants) - 1) / span if span > 0 else 0.0

    def _queue(self, model: str) -> ModelQueue:
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = ModelQueue(self.settings.order)
        return queue

    def _publish(self, model: str) -> None:
        """The model's queue gauges, per band."""
        sizes = self._queues[model].sizes()
        gauge = self._metrics.flow_queued
        for band, size in sizes.items():
            gauge.labels(model=model, band=str(band)).set(size)
            self._published.add((model, band))
        for published in [key for key in self._published if key[0] == model]:
            if published[1] not in sizes:
                gauge.labels(model=model, band=str(published[1])).set(0)
                self._published.discard(published)

    def snapshot(self) -> FlowSnapshot:
        """What the fleet API shows: each model served or waited for, each tenant."""
        elsewhere = self._elsewhere
        models = sorted(
            set(self._queues)
            | {model for model, _ in elsewhere.backlog}
            | set(self.counters.models())
        )
        flows = []
        for model in models:
            free = self.room(model)
            waiting_elsewhere: dict[int, dict[str, int]] = {}
            for (name, band), backlogged in elsewhere.backlog.items():
                if name == model and backlogged:
                    waiting_elsewhere[band] = dict(backlogged)
            flows.append(
                ModelFlow(
                    model=model,
                    room=None if free >= UNBOUNDED // 2 else max(0, free),
                    waiting=self._queues[model].tenants() if model in self._queues else {},
                    waiting_elsewhere=waiting_elsewhere,
                    counters=self.counters.values(model),
                )
            )
        names = sorted(self._service.keys() | self._shed_counts.keys())
        tenants = [
            TenantFlow(name, self._service.get(name, 0.0), dict(self._shed_counts.get(name, {})))
            for name in names
        ]
        return FlowSnapshot(self._replicas, flows, tenants)
