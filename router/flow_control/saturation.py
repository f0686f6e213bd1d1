"""Pure: how many more requests a model's workers can take now without queueing in
their engines beyond `max_engine_waiting` each (0: the model is saturated, and its
requests wait in the router).

A worker's engine holds what its last load report counted (running and waiting) plus
what the router replicas' traffic to it has changed since (requests sent less requests
ended: this router's at once, the others' as of their last exchange), or what the
router replicas have in flight there, whichever is more (reports lag; the replicas'
traffic is all of it but what reaches the engine around them).
Of those, the engine runs up to its batch limit, learnt from its reports: the most it
ran in two reports in a row that also had requests waiting (the batch was full then; in
one report alone, the requests waiting may only have arrived since the engine's last
step), raised when a later report runs more. A worker whose engine has not queued
requests so has no known limit and never saturates; nor does one whose load no report
has told this router of, its own agent's or another replica's through the exchange.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

Column = npt.NDArray[np.float64]
Flags = npt.NDArray[np.bool_]
Rows = npt.NDArray[np.intp]

UNBOUNDED = 1 << 30
"""The room of a model none of whose workers has a known limit."""

ANY_MODEL = "*"
"""The queue of requests for names no worker registers, where the workers serve several
models (their serving rows are all workers)."""


@dataclass(frozen=True, slots=True)
class EngineQueues:
    """What the router knows of each of a model's candidate workers (one row each)."""

    reported: Flags  # a load report reached this router, or another replica shared one
    running: Column  # as last reported
    waiting: Column
    # The replicas' requests in flight now less at the report (those handed off left
    # out: a gateway's request ends unseen, and ending it by a timer would make room the
    # engine may not have yet).
    traffic_since_report: Column
    batch_limit: Column  # inf: not learnt
    kv_usage: Column
    in_flight: Column  # the requests router replicas have there now: this one's, and the
    # others' as last shared (router/flow_control/shared.py)


@dataclass(frozen=True, slots=True)
class SharedReport:
    """A worker's load as the replica its agent reports to shares it."""

    # The engine the report is of: a replica that still has an older incarnation of the
    # worker in its roster (it reads the registry once a second) must not apply it there.
    incarnation: int
    running: float
    waiting: float
    kv_usage: float
    batch_limit: float  # inf: not learnt
    # The router replicas' requests in flight there when the report came, as the replica
    # that received it knew them (those handed off to a gateway left out: their end is
    # not seen): what they have sent and seen end since offsets it (reports come every
    # `load_interval_s`; the exchange, far more often).
    in_flight_at_report: float


@dataclass(frozen=True, slots=True)
class ReplicaTraffic:
    """What a router replica shares of the engines: its requests in flight at each
    worker (and of those, the ones handed off to a gateway, whose end it does not see),
    and the load reports its agents send."""

    in_flight: dict[str, int]
    handed_off: dict[str, int]
    reports: dict[str, SharedReport]


class Engines(Protocol):
    """Where flow control reads the engines (router/routing/pool.py's WorkerPool)."""

    def serving_rows(self, model: str) -> Rows: ...

    def queue_model(self, model: str) -> str | None: ...

    def engine_queues(self, rows: Rows) -> EngineQueues: ...

    def row_of(self, worker_id: str) -> int | None: ...

    def local_engines(self) -> ReplicaTraffic: ...

    def shared_engines(self, others: ReplicaTraffic) -> None: ...


def would_wait(queues: EngineQueues) -> Flags:
    """Whether a request sent to each worker now would wait in its engine's queue (its
    batch full; False where its limit is not known)."""
    reported = queues.running + queues.waiting + queues.traffic_since_report
    held = np.maximum(reported, queues.in_flight)
    return queues.reported & np.isfinite(queues.batch_limit) & (held >= queues.batch_limit)


def room(queues: EngineQueues, max_engine_waiting: int, max_kv_usage: float) -> int:
    """Requests the workers can take, all together, before `max_engine_waiting` wait in
    each engine on average (UNBOUNDED where one has no known limit). Net of the workers
    over theirs: routing sends a request where its prefix is, even to an engine that
    queues it, and that takes room the others had (so the engines together never queue
    more than `max_engine_waiting` each, wherever the requests went)."""
    known = queues.reported & np.isfinite(queues.batch_limit)
    full = (
        queues.reported & (queues.kv_usage >= max_kv_usage)
        if max_kv_usage < 1
        else np.zeros(len(known), dtype=np.bool_)
    )
    if not (known | full).all():
        return UNBOUNDED if len(known) else 0
    reported = queues.running + queues.waiting + queues.traffic_since_report
    held = np.maximum(reported, queues.in_flight)
    free = np.where(full, 0.0, np.floor(queues.batch_limit + max_engine_waiting - held))
    return max(0, int(free.sum()))


@dataclass(frozen=True, slots=True)
class BatchLimit:
    """A worker's batch limit as its reports taught it."""

    limit: float = math.inf  # inf: not learnt
    # The previous report's running requests, where it had requests waiting too (NaN:
    # none waited then).
    queued_running: float = math.nan


def learnt_batch_limit(previous: BatchLimit, running: int, waiting: int) -> BatchLimit:
    """A worker's batch limit after a report of `running` and `waiting` requests: the
    most it ran with requests waiting in this report and the one before, or more since.
    A single report proves nothing: a request that arrived after the engine's last step
    waits for its next one, whatever room the batch has (caught often where steps are
    slow and arrivals frequent, it would set the limit far below the engine's). It never
    falls: a batch held back by KV memory or a prefill's token budget leaves requests
    waiting, and those count as held (a limit lowered by a moment's budget would keep
    the engine below its batch)."""
    known = not math.isinf(previous.limit)
    queued = waiting > 0 and running > 0
    limit = previous.limit
    if known:
        limit = max(limit, float(running))
    elif queued and not math.isnan(previous.queued_running):
        limit = max(previous.queued_running, float(running))
    return BatchLimit(limit, float(running) if queued else math.nan)
