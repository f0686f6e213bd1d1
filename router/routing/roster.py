"""The registered live workers as columns: what routing reads of each, one row per
worker, in a fixed order until the registry changes (router/routing/pool.py builds a
new roster then, and keeps the rows current as reports, traffic and events arrive).

A decision reads a thousand workers' rows in a few numpy operations; a row is written
when something about its worker changes, which is far rarer per worker than decisions
are per fleet.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from kvplane.core.types import WorkerInfo, WorkerRole
from router.tenants import POOL_LABEL

Rows = npt.NDArray[np.intp]


class Roster:
    def __init__(self, infos: Sequence[WorkerInfo]) -> None:
        count = len(infos)
        self.infos = list(infos)
        self.position: Mapping[str, int] = {info.worker_id: row for row, info in enumerate(infos)}
        self.worker_ids = _objects([info.worker_id for info in infos])
        self.labels = _objects([info.labels for info in infos])
        self.pools = _objects([info.labels.get(POOL_LABEL) for info in infos])
        by_model: dict[str, list[int]] = {}
        for row, info in enumerate(infos):
            by_model.setdefault(info.model, []).append(row)
        self._rows_of_model = {
            model: _read_only(np.array(rows, dtype=np.intp)) for model, rows in by_model.items()
        }
        self._all_rows = _read_only(np.arange(count, dtype=np.intp))
        # Prefill/decode disaggregation (router/scoring/disaggregation.py): which legs
        # each takes. Whole requests and decode legs never go to a prefill worker while
        # another can take them; a prefill leg goes where the engine can hand its KV on.
        self.prefill_only = np.array(
            [info.role is WorkerRole.PREFILL for info in infos], dtype=np.bool_
        ).reshape(count)
        self.takes_prefill_legs = np.array(
            [info.transfers_kv and info.role is not WorkerRole.DECODE for info in infos],
            dtype=np.bool_,
        ).reshape(count)
        self.takes_decode_legs = np.array(
            [info.transfers_kv and info.role is not WorkerRole.PREFILL for info in infos],
            dtype=np.bool_,
        ).reshape(count)
        self.kv_connectors = _objects([info.kv_connector for info in infos])
        # A fleet without roles or connectors (the usual one) skips all of it per decision.
        self.has_roles = bool(self.prefill_only.any() or self.takes_decode_legs.any())
        # Each worker's longest prompt plus output; unknown (its engine does not say)
        # takes anything. A prompt over a worker's length is not routed there
        # (router/scoring/score.py eligible), so an agent that registers a short one
        # keeps long prompts from its own engine only.
        self.max_model_len = np.array(
            [info.max_model_len or np.inf for info in infos], dtype=np.float64
        ).reshape(count)
        self._longest_model_len = {
            model: float(self.max_model_len[rows].max())
            for model, rows in self._rows_of_model.items()
        }

        def zeros() -> npt.NDArray[np.float64]:
            return np.zeros(count)

        def flags() -> npt.NDArray[np.bool_]:
            return np.zeros(count, dtype=np.bool_)

        # Whether requests may go there (see WorkerPool.candidate_rows).
        self.held_back = flags()  # drained by an operator, or its engine is down
        self.gone_in_view = flags()  # this router saw it die or begin draining
        self.unreachable_until = zeros()
        # Its agent's last load report to this router.
        self.reported = flags()
        self.report_received_at = zeros()  # on the fleet's clock
        self.report_waiting = zeros()
        self.report_running = zeros()
        self.kv_usage = zeros()
        # Flow control's reading of the engine's queue (router/flow_control/saturation.py).
        # The replicas' in flight when the report came (this router's, the others' as
        # last shared; those handed off to a gateway left out).
        self.in_flight_at_report = zeros()
        self.batch_limit = np.full(count, np.inf)  # inf: not learnt
        # What other router replicas shared (router/flow_control/shared.py): their
        # requests in flight there, and the load report of one whose agent reports there.
        self.others_in_flight = zeros()
        self.others_handed_off = zeros()  # of those, handed off to a gateway
        self.shared_reported = flags()
        self.shared_running = zeros()
        self.shared_waiting = zeros()
        self.shared_kv_usage = zeros()
        self.shared_batch_limit = np.full(count, np.inf)
        self.shared_in_flight_at_report = zeros()
        # This router's traffic to it.
        self.in_flight = zeros()
        self.handed_off = zeros()  # of those, handed off to a gateway (their end unseen)
        self.prefilling = zeros()
        self.prefill_tokens = zeros()  # of the requests before their first byte
        self.sent_since_report = zeros()  # requests before their first byte, sent after it
        # Its recent evictions (router/routing/evictions.py) and index suspicion.
        self.capacity_router_blocks = zeros()  # 0: unknown
        self.evicted_blocks = zeros()
        self.evicted_as_of = zeros()
        self.suspect = flags()

    def __len__(self) -> int:
        return len(self.infos)

    def rows(self, model: str | None) -> Rows:
        """The rows of the workers serving `model`; all rows for None. (Read-only: the
        roster's own, handed out as they are.)"""
        if model is None:
            return self._all_rows
        return self._rows_of_model.get(model, self._all_rows[:0])

    def models(self) -> list[str]:
        """The models the workers register, each once."""
        return list(self._rows_of_model)

    def longest_model_len(self, model: str) -> int | None:
        """The longest prompt plus output, in tokens, that some worker serving `model`
        takes; None when one of them does not say, or none serves it under that name."""
        longest = self._longest_model_len.get(model, np.inf)
        return None if np.isinf(longest) else int(longest)

    def info(self, worker_id: str) -> WorkerInfo:
        return self.infos[self.position[worker_id]]


def _objects(values: Sequence[object]) -> npt.NDArray[np.object_]:
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column


def _read_only(rows: Rows) -> Rows:
    rows.flags.writeable = False
    return rows
