"""The fleet API for operators (`/fleet/...`, the admin bearer token), and the one
query a tenant may make with its own key (`/fleet/tenant/locality`, its own scope).

- `GET /fleet/workers`: each worker's state, incarnation, model, labels, load, KV
  usage, ages of its last event and heartbeat, index entries, wiring checks; per model,
  whether routing is cache-aware or runs on the router's predictions only.
- `POST /fleet/check`: probe every live worker (router/probe.py) and judge its wiring:
  what `kvplane check` prints.
- `POST /fleet/locality`: where a prompt's prefix is cached and what each worker
  would score, and the pick; nothing is sent to an engine.
- `GET /fleet/index`: index statistics.
- `GET /fleet/flow`: flow control: each model's room and waiting requests by band and
  tenant (here and at the other replicas), tenants' counters, service and shedding.
- `POST /fleet/workers/{id}/drain` and `/undrain`: stop or resume routing there.
- `POST /fleet/tenants/{name}/purge`: the tenant's scope starts a new generation, so
  its index entries (and the engines' blocks) are never matched again.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at
# run time, and one names this instance's security dependency (tenant_locality's).

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any

from fastapi import Path, Query, Security
from fastapi.routing import APIRoute
from starlette.requests import Request

from kvplane.core.clock import Clock
from kvplane.core.config import NAME_PATTERN
from kvplane.core.keys import MAX_TOKEN_ID
from kvplane.core.types import Tier, WorkerInfo
from kvplane.wire.codec import WORKER_ID_PATTERN
from router.auth import ADMIN_ERRORS, UNAUTHORIZED, AdminToken, TenantKey
from router.control_plane.workers import WorkerView
from router.errors import ApiError, documented, required_header
from router.fleet_api.models import (
    CheckResult,
    Drained,
    Engine,
    FleetCheck,
    Flow,
    FlowModel,
    FlowTenant,
    Funnel,
    FunnelRow,
    HotPrefixRow,
    IndexStatistics,
    Locality,
    LocalityLegs,
    LocalityQuery,
    LocalityRow,
    ModelRouting,
    Purged,
    Wiring,
    WorkerCache,
    WorkerCheck,
    WorkerLoad,
    WorkerRow,
    Workers,
)
from router.flow_control import FlowGate
from router.index.base import (
    LocationIndex,
    LocationIndexError,
    WorkerState,
    WorkerStatus,
    index_deadline,
)
from router.lifecycle.bodies import (
    BODY_ERRORS,
    BadRequest,
    Endpoint,
    ParsedRequest,
    decode_json,
    key_scope,
    read_body,
)
from router.lifecycle.tokens import PromptLength, PromptTokens, PromptTooLong
from router.probe import WiringProbe
from router.routes import RawBodyRoute
from router.routing.accuracy import PredictionAccuracy
from router.routing.decide import Decision, RoutingPlanner
from router.routing.funnel import CacheFunnel, FunnelTotals, Loss, Stage
from router.routing.hot_prefixes import HotPrefixes
from router.routing.pool import WorkerPool
from router.routing.sight import WiringSight
from router.routing.wiring import (
    Check,
    CheckStatus,
    RoutingMode,
    is_blind,
    model_routing,
    with_probe,
)
from router.scoring.disaggregation import LegPlan, ModelLegs, model_legs
from router.tenant_limits import TenantLimiter
from router.tenants import ANONYMOUS_TENANT, Tenant, TenantDirectory

log = logging.getLogger(__name__)

_INDEX_TIMEOUT_S = 2.0

# Any other id or name is unknown (404), not malformed: no agent registers such an id
# (the control plane checks the same pattern), no configuration names such a tenant. So
# the patterns describe the parameters without being checked here.
WorkerId = Annotated[
    str,
    Path(
        description="as the worker's agent registered it; any other is unknown",
        json_schema_extra={"pattern": f"^{WORKER_ID_PATTERN.pattern}$"},
    ),
]
TenantName = Annotated[
    str,
    Path(
        description="a configured tenant; any other is unknown",
        json_schema_extra={"pattern": NAME_PATTERN},
    ),
]
_NO_TENANT = documented("no such tenant")
_NO_WORKER = documented("no such worker")
_INDEX_DOWN = "the index is unreachable"


class FleetApi:
    def __init__(
        self,
        *,
        admin_token: str | None,
        index: LocationIndex,
        view: WorkerView,
        pool: WorkerPool,
        planner: RoutingPlanner,
        accuracy: PredictionAccuracy,
        tenants: TenantDirectory,
        prompt_tokens: PromptTokens,
        sight: WiringSight,
        probe: WiringProbe,
        max_body_bytes: int,
        prompt_length: Callable[[str], PromptLength],
        limiter: TenantLimiter,
        funnel: CacheFunnel,
        gate: FlowGate | None = None,
        hot_prefixes: HotPrefixes,
        clock: Clock = time.monotonic,
    ) -> None:
        """`prompt_length(model)`: how long a query's prompt may be (as the proxy's);
        `limiter`: the tenants' request limits, which their own queries count
        against."""
        self._clock = clock  # the router's: the ages shown are measured on it
        self.admin_token = AdminToken(admin_token)
        self.tenant_key = TenantKey(tenants)
        self.index = index
        self.view = view
        self.pool = pool
        self.planner = planner
        self.accuracy = accuracy
        self.tenants = tenants
        self.prompt_tokens = prompt_tokens
        self.sight = sight
        self.probe = probe
        self.max_body_bytes = max_body_bytes
        self.prompt_length = prompt_length
        self.limiter = limiter
        self.funnel = funnel
        self.gate = gate  # None: flow control is off
        self.hot_prefixes = hot_prefixes

    def admin_routes(self) -> list[APIRoute]:
        """The operators' routes (the admin token): on the admin port when there is one."""
        admin = [Security(self.admin_token)]
        return [
            APIRoute(
                "/fleet/workers",
                self.workers,
                methods=["GET"],
                summary="every worker: state, incarnation, load, lease, index entries",
                responses=ADMIN_ERRORS,
                dependencies=admin,
            ),
            APIRoute(
                "/fleet/check",
                self.check,
                methods=["POST"],
                summary="probe every live worker and judge its wiring: each check, pass or "
                "fail, with the fix (what `kvplane check` prints)",
                description="Sends each live worker's engine one small completion (random "
                "words, one output token) and waits for its blocks to reach the index.",
                responses=ADMIN_ERRORS,
                dependencies=admin,
            ),
            RawBodyRoute(
                "/fleet/locality",
                self.locality,
                body=LocalityQuery,
                methods=["POST"],
                summary="where a prompt's prefix is cached, each score term, and the pick",
                description="Nothing is sent to an engine.",
                responses={**BODY_ERRORS, **ADMIN_ERRORS, 404: _NO_TENANT},
                dependencies=admin,
            ),
            APIRoute(
                "/fleet/funnel",
                self.cache_funnel,
                methods=["GET"],
                summary="per model and tenant: prompt, attainable, predicted and achieved "
                "cached tokens since start, and why each stage lost what it lost",
                responses=ADMIN_ERRORS,
                dependencies=admin,
            ),
            APIRoute(
                "/fleet/flow",
                self.flow,
                methods=["GET"],
                summary="flow control: waiting requests, tenants' counters, service, shedding",
                responses=ADMIN_ERRORS,
                dependencies=admin,
            ),
            APIRoute(
                "/fleet/prefixes",
                self.prefixes,
                methods=["GET"],
                summary="the cached prefixes requests reused most, as hashes and lengths "
                "(never text), with their tenants and the prompt tokens they could skip",
                responses=ADMIN_ERRORS,
                dependencies=admin,
            ),
            APIRoute(
                "/fleet/index",
                self.index_stats,
                methods=["GET"],
                summary="index statistics",
                responses={**ADMIN_ERRORS, 503: documented(_INDEX_DOWN)},
                dependencies=admin,
            ),
            APIRoute(
                "/fleet/workers/{worker_id}/drain",
                self.drain,
                methods=["POST"],
                summary="stop routing to a worker (this router only)",
                responses={**ADMIN_ERRORS, 404: _NO_WORKER},
                dependencies=admin,
            ),
            APIRoute(
                "/fleet/workers/{worker_id}/undrain",
                self.undrain,
                methods=["POST"],
                summary="resume routing to a worker (this router only)",
                responses={**ADMIN_ERRORS, 404: _NO_WORKER},
                dependencies=admin,
            ),
            APIRoute(
                "/fleet/tenants/{name}/purge",
                self.purge_tenant,
                methods=["POST"],
                summary="a new generation of the tenant's cache scope (a new salt)",
                responses={
                    400: documented("the tenant uses the shared scope, which has no salt"),
                    **ADMIN_ERRORS,
                    404: _NO_TENANT,
                    503: documented(f"{_INDEX_DOWN}: the purge may not have happened"),
                },
                dependencies=admin,
            ),
        ]

    def tenant_routes(self) -> list[APIRoute]:
        """The tenants' own routes (their API keys): on the port clients reach."""

        async def tenant_locality(
            request: Request, tenant: Annotated[Tenant, Security(self.tenant_key)]
        ) -> Locality:
            return await self.tenant_locality(request, tenant)

        return [
            RawBodyRoute(
                "/fleet/tenant/locality",
                tenant_locality,
                body=LocalityQuery,
                methods=["POST"],
                summary="the locality query in the caller's own scope: eligible workers, "
                "their cached tokens and total scores",
                description="Nothing is sent to an engine.",
                responses={
                    **BODY_ERRORS,
                    401: UNAUTHORIZED,
                    403: documented("a tenant's key queries its own scope only"),
                    429: documented(
                        "the tenant is over its request rate or its requests in progress",
                        {
                            "retry-after": required_header(
                                {"type": "integer", "minimum": 1}, "seconds"
                            )
                        },
                    ),
                },
            ),
        ]

    async def workers(self) -> Workers:
        now = self._clock()
        statuses = sorted(self.pool.statuses(), key=lambda s: s.info.worker_id)
        routable = self._routable()
        seen = self.sight.see((s.info for s in statuses), routable)
        legs = model_legs(s.info for s in statuses if s.info.worker_id in routable)
        rows = []
        for status in statuses:
            info = status.info
            record = self.view.get(info.worker_id)
            local = (
                record if record is not None and record.incarnation == info.incarnation else None
            )
            load = local.last_load if local is not None else None
            traffic = self.pool.traffic(info.worker_id)
            state = status.state
            if state is WorkerState.LIVE and info.worker_id in self.pool.drained:
                state = WorkerState.DRAINING
            rows.append(
                WorkerRow(
                    worker_id=info.worker_id,
                    state=state,
                    drained_by_operator=info.worker_id in self.pool.drained,
                    incarnation=info.incarnation,
                    model=info.model,
                    base_url=info.base_url,
                    labels=dict(info.labels),
                    engine=Engine(kind=info.engine_kind, version=info.engine_version),
                    block_size=info.block_size,
                    kv_capacity_blocks=info.kv_capacity_blocks,
                    lease_remaining_s=round(status.lease_remaining_s, 3),
                    index_entries=status.entries,
                    load=None
                    if load is None
                    else WorkerLoad(
                        running=load.running,
                        waiting=load.waiting,
                        kv_usage=load.kv_usage,
                        engine_down=load.engine_down,
                        kv_load_failures=load.kv_load_failures,
                        kv_leases_expired=load.kv_leases_expired,
                    ),
                    router_in_flight=traffic.in_flight,
                    router_prefilling=traffic.prefilling,
                    last_event_age_s=_age(now, local.last_event_at if local else None),
                    last_heartbeat_age_s=_age(now, local.last_heartbeat_at if local else None),
                    stream_on_this_router=local is not None and local.stream is not None,
                    suspect=self.accuracy.is_suspect(info.worker_id, info.incarnation),
                    credit_withdrawn_for_s=_until(
                        now, self.accuracy.withdrawn_until(info.worker_id)
                    ),
                    max_model_len=info.max_model_len or None,
                    role=info.role,
                    kv_connector=info.kv_connector or None,
                    cache=_worker_cache(self.funnel.worker_totals(info.worker_id)),
                    wiring=_wiring(seen.checks[info.worker_id]),
                )
            )
        return Workers(
            workers=rows,
            index_reachable=self.planner.index_answering,
            routing=_routing(seen.routing, legs),
        )

    async def check(
        self,
        probe: Annotated[bool, Query(description="send each live worker a probe")] = True,
        wait_s: Annotated[
            float,
            Query(gt=0, le=60, description="how long a probe's blocks may take to reach the index"),
        ] = 5.0,
    ) -> FleetCheck:
        statuses = sorted(self.pool.statuses(), key=lambda s: s.info.worker_id)
        routable = self._routable()
        live = [s.info for s in statuses if s.info.worker_id in routable]
        probes: list[list[Check]] = []
        if probe:
            probes = list(await asyncio.gather(*(self._probe(info, wait_s) for info in live)))
        probed = {info.worker_id: checks for info, checks in zip(live, probes, strict=False)}
        rows, problems = [], []
        for status in statuses:
            info = status.info
            if info.worker_id in routable:
                # After the probes: they feed the token-count comparison too.
                checks = with_probe(self.sight.checks(info), probed.get(info.worker_id, []))
            else:
                checks = [_not_routable(status)]
            failed = [c for c in checks if c.status is CheckStatus.FAIL]
            problems += [f"{info.worker_id}: {c.name}: {c.detail}" for c in failed]
            rows.append(
                WorkerCheck(
                    worker_id=info.worker_id,
                    model=info.model,
                    state=status.state,
                    ok=not failed,
                    blind=is_blind(checks),
                    checks=[_result(c) for c in checks],
                )
            )
        if not live:
            problems.append("no live worker: nothing to route to")
        index_reachable = self.planner.index_answering
        if not index_reachable:
            problems.append("the index does not answer lookups: routing on load only")
        routing = model_routing((row.model, row.blind) for row in rows if row.worker_id in routable)
        legs = model_legs(live)
        problems += [
            f"model {model}: {LEGS_PROBLEMS[state]}"
            for model, state in legs.items()
            if state in LEGS_PROBLEMS
        ]
        return FleetCheck(
            ok=not problems,
            index_reachable=index_reachable,
            workers=rows,
            routing=_routing(routing, legs),
            problems=problems,
        )

    async def _probe(self, info: WorkerInfo, wait_s: float) -> list[Check]:
        """The probe's checks; a probe that fails inside the router is logged and says so,
        and the other workers' probes go on."""
        try:
            return await self.probe.probe(info, wait_s)
        except Exception as error:  # one worker's probe must not fail the whole check
            log.exception("probing worker %s failed", info.worker_id)
            return [
                Check(
                    "probe_send",
                    CheckStatus.UNKNOWN,
                    f"the probe failed inside the router ({type(error).__name__})",
                    "see the router's log",
                )
            ]

    def _routable(self) -> set[str]:
        """The workers routing may pick now (as /readyz and /metrics judge them)."""
        return {candidate.worker_id for candidate in self.pool.candidates()}

    async def cache_funnel(self) -> Funnel:
        rows = []
        for (model, tenant), totals in sorted(self.funnel.totals().items()):
            achieved = totals.stages[Stage.ACHIEVED]
            rows.append(
                FunnelRow(
                    model=model,
                    tenant=tenant,
                    requests=totals.requests,
                    prompt_tokens=totals.stages[Stage.PROMPT],
                    attainable_tokens=totals.stages[Stage.ATTAINABLE],
                    predicted_tokens=totals.stages[Stage.PREDICTED],
                    achieved_tokens=achieved,
                    reported_requests=totals.reported_requests,
                    reported_prompt_tokens=totals.reported_prompt_tokens,
                    hit_rate=_ratio(achieved, totals.reported_prompt_tokens),
                    lost_tokens={loss.value: tokens for loss, tokens in totals.losses.items()},
                    copied_tokens=totals.copied_tokens,
                )
            )
        return Funnel(rows=rows)

    async def flow(self) -> Flow:
        gate = self.gate
        if gate is None:
            return Flow(enabled=False, replicas=1, models=[], tenants=[])
        snapshot = gate.snapshot()
        total = sum(tenant.service_tokens for tenant in snapshot.tenants)
        return Flow(
            enabled=True,
            replicas=snapshot.replicas,
            models=[
                FlowModel(
                    model=model.model,
                    room=model.room,
                    waiting={str(band): tenants for band, tenants in model.waiting.items()},
                    waiting_elsewhere={
                        str(band): tenants for band, tenants in model.waiting_elsewhere.items()
                    },
                    counters=model.counters,
                )
                for model in snapshot.models
            ],
            tenants=[
                FlowTenant(
                    tenant=tenant.tenant,
                    service_tokens=tenant.service_tokens,
                    service_share=tenant.service_tokens / total if total > 0 else None,
                    shed=tenant.shed,
                )
                for tenant in snapshot.tenants
            ],
        )

    async def prefixes(self, limit: Annotated[int, Query(ge=1, le=256)] = 20) -> list[HotPrefixRow]:
        return [
            HotPrefixRow(
                tenant=prefix.tenant,
                key=f"{prefix.key:016x}",
                tokens=prefix.tokens,
                requests=prefix.requests,
                reused_tokens=prefix.reused_tokens,
            )
            for prefix in self.hot_prefixes.top(limit)
        ]

    async def index_stats(self) -> IndexStatistics:
        try:
            async with index_deadline(_INDEX_TIMEOUT_S):
                stats = await self.index.stats()
        except LocationIndexError as error:  # reported, not raised: the operator asked about it
            raise ApiError(
                503, f"{_INDEX_DOWN} ({type(error).__name__})", kind="IndexUnavailable"
            ) from None
        return IndexStatistics(
            keys=stats.keys,
            entries=stats.entries,
            workers=stats.workers,
            bytes=stats.bytes,
            predicted_entries=len(self.planner.predicted),
            server_memory_used=stats.server_memory_used,
        )

    async def drain(self, worker_id: WorkerId) -> Drained:
        return self._set_drained(worker_id, drained=True)

    async def undrain(self, worker_id: WorkerId) -> Drained:
        return self._set_drained(worker_id, drained=False)

    def _set_drained(self, worker_id: str, *, drained: bool) -> Drained:
        if self.pool.status(worker_id) is None:
            raise ApiError(404, f"no worker {worker_id!r}", kind="NotFoundError")
        self.pool.drain(worker_id, drained=drained)
        return Drained(worker_id=worker_id, drained=drained)

    async def purge_tenant(self, name: TenantName) -> Purged:
        tenant = self.tenants.get(name)
        if tenant is None:
            raise ApiError(404, f"no tenant {name!r}", kind="NotFoundError")
        if tenant.cache_salt is None:
            raise ApiError(
                400,
                f"tenant {name!r} uses the shared scope, which has no salt to change",
                kind="BadRequestError",
            )
        try:
            async with index_deadline(_INDEX_TIMEOUT_S):
                generation = await self.index.bump_scope_generation(tenant.cache_scope)
        except LocationIndexError as error:  # the operator may try again: purging twice is harmless
            raise ApiError(
                503,
                f"{_INDEX_DOWN} ({type(error).__name__}); the purge may not have happened: "
                "try again",
                kind="IndexUnavailable",
            ) from None
        self.tenants.apply_generations({tenant.cache_scope: generation})
        return Purged(tenant=name, cache_scope=tenant.cache_scope, generation=generation)

    async def locality(self, request: Request) -> Locality:
        query = await self._query(request)
        name = query.get("tenant")
        if name is not None and not isinstance(name, str):
            raise BadRequest("'tenant' must be a string", "tenant")
        tenant = ANONYMOUS_TENANT if name is None else self.tenants.get(name)
        if tenant is None:
            raise ApiError(404, f"no tenant {name!r}", kind="NotFoundError")
        decision, model = await self._decide(query, tenant)
        return _describe(decision, model, tenant, detailed=True)

    async def tenant_locality(self, request: Request, tenant: Tenant) -> Locality:
        """Its own scope only, and nothing of other tenants: eligible workers, their
        cached tokens and total scores, not the terms (the tenant term counts other
        tenants' requests) nor the workers of other tenants' pools."""
        refused = self.limiter.admit(tenant)
        if refused is not None:
            raise refused.error()
        try:
            query = await self._query(request)
            if query.get("tenant", tenant.name) != tenant.name:
                raise ApiError(
                    403, "a tenant's key queries its own scope only", kind="PermissionDenied"
                )
            decision, model = await self._decide(query, tenant)
            return _describe(decision, model, tenant, detailed=False)
        finally:
            self.limiter.release(tenant)

    async def _query(self, request: Request) -> dict[str, Any]:
        raw = await read_body(request, self.max_body_bytes)
        query = decode_json(raw)
        if not isinstance(query, dict):
            raise BadRequest("the request body must be a JSON object")
        return query

    async def _decide(self, query: Mapping[str, Any], tenant: Tenant) -> tuple[Decision, str]:
        """The decision the proxy would make for the query, keyed and tokenised as the
        proxy would (same scope, same token cache, long prompts off the event loop)."""
        model = query.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest("'model' must be a non-empty string", "model")
        body = {key: value for key, value in query.items() if key != "token_ids"}
        if "token_ids" in query:
            token_ids = query["token_ids"]
            if not isinstance(token_ids, list) or not all(
                type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in token_ids
            ):
                raise BadRequest("'token_ids' must be an array of token ids", "token_ids")
            endpoint, body["prompt"] = Endpoint.COMPLETIONS, token_ids
        elif "messages" in query:
            endpoint = Endpoint.CHAT
        elif "prompt" in query:
            endpoint = Endpoint.COMPLETIONS
        else:
            raise BadRequest("give one of 'prompt', 'messages' or 'token_ids'")
        parsed = ParsedRequest(endpoint, model, False, body)
        scope = key_scope(tenant, parsed)
        length = self.prompt_length(model)
        try:
            tokens = await self.prompt_tokens.of(parsed, scope, length.limit)
        except PromptTooLong as too_long:
            raise BadRequest(str(too_long)) from None
        if tokens is None:
            raise BadRequest("the prompt or messages could not be tokenised")
        decision = await self.planner.decide(
            model=model,
            tenant=tenant,
            cache_scope=scope,
            tokens=tokens,
            counted_as_engines=length.per_worker,
        )
        return decision, model


LEGS_PROBLEMS: Mapping[ModelLegs, str] = {
    "no_prefill_worker": "decode workers and no live prefill worker: requests are served whole "
    "on the decode workers, or refused (disaggregation.when_no_prefill)",
    "no_decode_worker": "prefill workers only: they serve whole requests",
}


def _routing(
    routing: Mapping[str, RoutingMode], legs: Mapping[str, ModelLegs]
) -> list[ModelRouting]:
    return [
        ModelRouting(model=model, routing=mode, legs=legs.get(model, "whole"))
        for model, mode in routing.items()
    ]


def _result(check: Check) -> CheckResult:
    return CheckResult(
        name=check.name, status=check.status.value, detail=check.detail, fix=check.fix
    )


def _wiring(checks: Sequence[Check]) -> Wiring:
    return Wiring(blind=is_blind(checks), checks=[_result(c) for c in checks])


def _not_routable(status: WorkerStatus) -> Check:
    return Check(
        "state",
        CheckStatus.UNKNOWN,
        f"not routable now ({status.state.value} in the index; or drained, its engine down, "
        "or refusing connections): not probed",
    )


def _age(now: float, then: float | None) -> float | None:
    return None if then is None else round(now - then, 3)


def _until(now: float, then: float | None) -> float | None:
    return None if then is None else round(then - now, 3)


def _ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def _worker_cache(totals: FunnelTotals | None) -> WorkerCache:
    totals = totals or FunnelTotals()
    achieved = totals.stages[Stage.ACHIEVED]
    return WorkerCache(
        requests=totals.requests,
        reported_requests=totals.reported_requests,
        reported_prompt_tokens=totals.reported_prompt_tokens,
        predicted_tokens=totals.reported_predicted_tokens,
        achieved_tokens=achieved,
        hit_rate=_ratio(achieved, totals.reported_prompt_tokens),
        agreement=_ratio(achieved, totals.reported_predicted_tokens),
        evicted_from_fleet_tokens=totals.losses[Loss.EVICTED_FROM_FLEET],
        copied_tokens=totals.copied_tokens,
    )


def _tiers(blocks: Mapping[Tier, int], block_size: int) -> dict[str, int]:
    return {tier.name.lower(): count * block_size for tier, count in blocks.items()}


def _describe(decision: Decision, model: str, tenant: Tenant, *, detailed: bool) -> Locality:
    """The decision for the fleet API; not `detailed`, for a tenant: only the workers
    it may use, and their total scores."""
    scores = {breakdown.worker_id: breakdown for breakdown in decision.ranked}
    rows = []
    for worker_id in sorted(decision.candidates if detailed else scores):
        blocks = decision.matched(worker_id)
        row = LocalityRow(
            worker_id=worker_id,
            eligible=worker_id in scores,
            matched_blocks={tier.name.lower(): count for tier, count in blocks.items()},
            matched_tokens=_tiers(blocks, decision.block_size),
            cached_tokens=decision.predicted_tokens(worker_id),
        )
        breakdown = scores.get(worker_id)
        if breakdown is not None:
            row["score"] = breakdown.score
        if breakdown is not None and detailed:
            row["saved_tokens"] = breakdown.saved_tokens
            row["queue_penalty"] = breakdown.queue_penalty
            row["memory_penalty"] = breakdown.memory_penalty
            row["copy_penalty"] = breakdown.copy_penalty
            row["copied_tokens"] = breakdown.copied_tokens
            row["tenant_penalty"] = breakdown.tenant_penalty
            row["spilled"] = breakdown.spilled
        rows.append(row)
    return Locality(
        model=model,
        tenant=tenant.name,
        cache_scope=tenant.cache_scope,
        prompt_tokens=decision.prompt_tokens,
        blocks=len(decision.keys),
        index_answered=decision.index_answered,
        chosen=decision.ranked[0].worker_id if decision.ranked else None,
        factor=decision.factor,
        legs=None if decision.legs is None else _legs(decision.legs, detailed=detailed),
        workers=rows,
    )


def _legs(plan: LegPlan, *, detailed: bool) -> LocalityLegs:
    legs = LocalityLegs(
        split=plan.split,
        reason=plan.reason.value,
        decode_worker=plan.decode_worker,
        prefill_worker=plan.prefill_worker,
    )
    if detailed:
        legs.whole_s, legs.split_s = plan.whole_s, plan.split_s
        legs.transfer_bytes = plan.transfer_bytes
    return legs
