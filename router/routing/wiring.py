"""Is each worker's wiring proven? Pure judgements, from what the router knows.

kvplane routes on what engines really hold only while each link holds: the engine
publishes, the agent hears it (the agent's own report), the agent keys blocks as the
router does (block size; the router tokenises as the engine does), and the index
entries that result vouch for the engine's hits. A worker where any link fails is
*blind*: the router sees nothing of its cache and routes there on its own predicted
entries alone, approximately, as a text tree would. A model whose every worker is
blind is routed on predictions only, and the fleet API, /metrics and /readyz say so.

Each check passes, warns (works, but weaker than it should), fails (blind, or about to
be), or is unknown (nothing has proven it either way yet), with the fix in words.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from kvplane.core.types import EventsState, ReplayState, WiringReport
from router.routing.accuracy import UNVOUCHED_AFTER_HITS
from router.routing.token_agreement import MIN_SAMPLES, Agreement


class CheckStatus(enum.Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: CheckStatus
    detail: str
    fix: str = ""


BLINDING_CHECKS = frozenset(
    {"events", "block_size", "tokenizer", "index_vouches", "probe_tokenizer", "probe_index"}
)
"""A failure of any of these leaves the router without sight of the worker's cache (a
failing replay does not: events still flow, a missed batch costs a resync)."""

RoutingMode = Literal["cache_aware", "predictions_only"]


@dataclass(frozen=True, slots=True)
class WorkerWiringFacts:
    """What the router knows of one worker's wiring."""

    report: WiringReport | None  # the agent's, with its last load; None: none here
    stream_here: bool  # this router holds the worker's stream (and so its reports)
    router_block_size: int
    agreement: Agreement
    recent_hits: int  # engine-reported hits the router had predicted, recently
    vouched_hits: int  # of which the worker's index entries foresaw part


def worker_checks(facts: WorkerWiringFacts) -> list[Check]:
    return [
        events_check(facts.report, facts.stream_here),
        replay_check(facts.report, facts.stream_here),
        block_size_check(facts.report, facts.router_block_size, facts.stream_here),
        tokenizer_check(facts.agreement),
        vouching_check(facts.recent_hits, facts.vouched_hits),
    ]


def with_probe(checks: Iterable[Check], probe: Iterable[Check]) -> list[Check]:
    """A worker's checks and its probe's. A probe whose blocks reached the index proves
    the event stream that an idle engine's agent could not yet vouch for."""
    probe = list(probe)
    proven = any(c.name == "probe_index" and c.status is CheckStatus.PASS for c in probe)
    merged = [
        Check("events", CheckStatus.PASS, "the probe's blocks arrived as KV events")
        if proven and c.name == "events" and c.status is CheckStatus.UNKNOWN
        else c
        for c in checks
    ]
    return [*merged, *probe]


def is_blind(checks: Iterable[Check]) -> bool:
    return any(c.status is CheckStatus.FAIL and c.name in BLINDING_CHECKS for c in checks)


def model_routing(workers: Iterable[tuple[str, bool]]) -> dict[str, RoutingMode]:
    """Per model, from its workers' (model, blind): predictions only when every one of
    them is blind."""
    sight: dict[str, bool] = {}
    for model, blind in workers:
        sight[model] = sight.get(model, False) or not blind
    return {
        model: "cache_aware" if seen else "predictions_only"
        for model, seen in sorted(sight.items())
    }


def _unreported(name: str, stream_here: bool) -> Check:
    if stream_here:
        return Check(
            name,
            CheckStatus.UNKNOWN,
            "the agent does not report its wiring",
            "upgrade the agent to this router's version",
        )
    return Check(
        name,
        CheckStatus.UNKNOWN,
        "the worker's agent streams to another router replica",
        "ask the router that holds its stream (stream_on_this_router in /fleet/workers)",
    )


def events_check(report: WiringReport | None, stream_here: bool) -> Check:
    if report is None:
        return _unreported("events", stream_here)
    state = report.events
    if state is EventsState.FLOWING:
        return Check("events", CheckStatus.PASS, "KV events arrive at the agent")
    if state is EventsState.NEVER_SEEN:
        return Check(
            "events",
            CheckStatus.UNKNOWN,
            "the agent's event socket is connected, but no event has arrived yet (nor do the "
            "engine's counters show that it cached a block)",
            "send it a request (kvplane check does)",
        )
    if state is EventsState.UNKNOWN:  # not judged yet, or a state newer than this router
        return Check(
            "events", CheckStatus.UNKNOWN, report.events_detail or "the agent has not judged yet"
        )
    section = "no KV events" if state is EventsState.NOT_CONNECTED else "silent"
    return Check(
        "events",
        CheckStatus.FAIL,
        f"events {state.value}: {report.events_detail}",
        f"the detail says how; more in docs/troubleshooting.md, 'events: {section}'",
    )


def replay_check(report: WiringReport | None, stream_here: bool) -> Check:
    if report is None:
        return _unreported("replay", stream_here)
    state = report.replay
    if state is ReplayState.OK:
        return Check("replay", CheckStatus.PASS, "the engine's replay endpoint answers")
    if state is ReplayState.NOT_CONFIGURED:
        return Check(
            "replay",
            CheckStatus.WARN,
            "no replay endpoint: each batch the agent misses costs it its whole picture",
            'set "replay_endpoint": "tcp://*:PORT" in the engine\'s --kv-events-config and '
            "--kv-events-replay-endpoint on the agent",
        )
    if state is ReplayState.FAILING:
        return Check(
            "replay",
            CheckStatus.FAIL,
            report.replay_detail or "the replay endpoint does not answer",
            "the detail says how; more in docs/troubleshooting.md, 'replay: failing'",
        )
    return Check(
        "replay",
        CheckStatus.UNKNOWN,
        report.replay_detail or "the agent has not asked for a replay yet",
    )


def block_size_check(
    report: WiringReport | None, router_block_size: int, stream_here: bool
) -> Check:
    if report is None:
        return _unreported("block_size", stream_here)
    engine = report.engine_block_size
    if engine is None:
        return Check("block_size", CheckStatus.UNKNOWN, "the engine does not say its block size")
    if router_block_size % engine == 0:
        return Check(
            "block_size",
            CheckStatus.PASS,
            f"the router's block size {router_block_size} is a multiple of the engine's {engine}",
        )
    return Check(
        "block_size",
        CheckStatus.FAIL,
        f"the engine's block size {engine} does not divide the router's {router_block_size}: "
        "no block can be keyed",
        f"set control_plane.block_size to a multiple of {engine} on the router and agents",
    )


def tokenizer_check(agreement: Agreement) -> Check:
    if agreement.disagrees:
        return Check(
            "tokenizer",
            CheckStatus.FAIL,
            f"prompt token counts differ on {agreement.mismatches} of the last "
            f"{agreement.samples} requests (last: the router counted "
            f"{agreement.last_router_tokens}, the engine {agreement.last_engine_tokens}): "
            "no block key the router computes matches the engine's",
            "give the router the engine's tokenizer and chat template (proxy.tokenizer_dirs "
            "or proxy.tokenizer_dir)",
        )
    if agreement.agrees:
        differ = f" ({agreement.mismatches} differ)" if agreement.mismatches else ""
        return Check(
            "tokenizer",
            CheckStatus.PASS,
            f"prompt token counts agree on the last {agreement.samples} requests{differ}",
        )
    return Check(
        "tokenizer",
        CheckStatus.UNKNOWN,
        f"requests whose token counts were compared: {agreement.samples} of the "
        f"{MIN_SAMPLES} needed",
    )


def vouching_check(recent_hits: int, vouched_hits: int) -> Check:
    if vouched_hits:
        return Check(
            "index_vouches",
            CheckStatus.PASS,
            f"the worker's index entries foresaw {vouched_hits} of its last {recent_hits} "
            "predicted hits",
        )
    if recent_hits >= UNVOUCHED_AFTER_HITS:
        return Check(
            "index_vouches",
            CheckStatus.FAIL,
            f"the engine's last {recent_hits} predicted hits were foreseen only by this "
            "router's own predicted entries, never by the worker's index entries",
            "check events and tokenizer above; if both pass, the agent keys blocks under "
            "another model name or reads another engine",
        )
    return Check(
        "index_vouches",
        CheckStatus.UNKNOWN,
        f"predicted hits the engine reported: {recent_hits} of the {UNVOUCHED_AFTER_HITS} needed",
    )
