"""The fleet API for operators (`/fleet/...`, the admin bearer token), and the one
query a tenant may make with its own key (`/fleet/tenant/locality`, its own scope).

- `GET /fleet/workers`: each worker's state, incarnation, model, labels, load, KV
  usage, ages of its last event and heartbeat, index entries.
- `POST /fleet/locality`: where a prompt's prefix is cached and what each worker
  would score, and the pick; nothing is sent to an engine.
- `GET /fleet/index`: index statistics.
- `POST /fleet/workers/{id}/drain` and `/undrain`: stop or resume routing there.
- `POST /fleet/tenants/{name}/purge`: the tenant's scope starts a new generation, so
  its index entries (and the engines' blocks) are never matched again.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvplane.core.types import Tier
from router.control_plane.workers import WorkerView
from router.index.base import LocationIndex, LocationIndexError, WorkerState, index_deadline
from router.proxy.bodies import (
    BadRequest,
    Endpoint,
    ParsedRequest,
    decode_json,
    key_scope,
    read_body,
)
from router.proxy.service import error_response
from router.proxy.tokens import PromptTokens
from router.routing.accuracy import PredictionAccuracy
from router.routing.decide import Decision, RoutingPlanner
from router.routing.fleet import Fleet
from router.tenants import ANONYMOUS_TENANT, Tenant, TenantDirectory

_INDEX_TIMEOUT_S = 2.0
_Handler = Callable[[Request], Awaitable[Response]]


class FleetApi:
    def __init__(
        self,
        *,
        admin_token: str | None,
        index: LocationIndex,
        view: WorkerView,
        fleet: Fleet,
        planner: RoutingPlanner,
        accuracy: PredictionAccuracy,
        tenants: TenantDirectory,
        prompt_tokens: PromptTokens,
        max_body_bytes: int,
    ) -> None:
        self._admin_token = admin_token
        self.index = index
        self.view = view
        self.fleet = fleet
        self.planner = planner
        self.accuracy = accuracy
        self.tenants = tenants
        self.prompt_tokens = prompt_tokens
        self.max_body_bytes = max_body_bytes

    def routes(self) -> list[Route]:
        admin = self._admin_only
        return [
            Route("/fleet/workers", admin(self.workers), methods=["GET"]),
            Route("/fleet/locality", admin(self.locality), methods=["POST"]),
            Route("/fleet/index", admin(self.index_stats), methods=["GET"]),
            Route("/fleet/workers/{worker_id}/drain", admin(self.drain), methods=["POST"]),
            Route("/fleet/workers/{worker_id}/undrain", admin(self.undrain), methods=["POST"]),
            Route("/fleet/tenants/{name}/purge", admin(self.purge_tenant), methods=["POST"]),
            Route("/fleet/tenant/locality", self.tenant_locality, methods=["POST"]),
        ]

    def _admin_only(self, handler: _Handler) -> _Handler:
        async def guarded(request: Request) -> Response:
            if self._admin_token is None:
                return error_response(
                    403, "the fleet API is off: set http.admin_token", kind="PermissionDenied"
                )
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self._admin_token.encode()
            ):
                return error_response(
                    401,
                    "the fleet API needs the admin token (Authorization: Bearer TOKEN)",
                    kind="AuthenticationError",
                    headers={"www-authenticate": "Bearer"},
                )
            return await handler(request)

        return guarded

    async def workers(self, request: Request) -> Response:
        now = time.monotonic()
        rows = []
        for status in sorted(self.fleet.statuses(), key=lambda s: s.info.worker_id):
            info = status.info
            record = self.view.get(info.worker_id)
            local = (
                record if record is not None and record.incarnation == info.incarnation else None
            )
            load = local.last_load if local is not None else None
            traffic = self.fleet.traffic(info.worker_id)
            state = status.state.value
            if status.state is WorkerState.LIVE and info.worker_id in self.fleet.drained:
                state = WorkerState.DRAINING.value
            rows.append(
                {
                    "worker_id": info.worker_id,
                    "state": state,
                    "drained_by_operator": info.worker_id in self.fleet.drained,
                    "incarnation": info.incarnation,
                    "model": info.model,
                    "base_url": info.base_url,
                    "labels": dict(info.labels),
                    "engine": {"kind": info.engine_kind, "version": info.engine_version},
                    "block_size": info.block_size,
                    "kv_capacity_blocks": info.kv_capacity_blocks,
                    "lease_remaining_s": round(status.lease_remaining_s, 3),
                    "index_entries": status.entries,
                    "load": None
                    if load is None
                    else {
                        "running": load.running,
                        "waiting": load.waiting,
                        "kv_usage": load.kv_usage,
                        "engine_down": load.engine_down,
                    },
                    "router_in_flight": traffic.in_flight,
                    "router_prefilling": traffic.prefilling,
                    "last_event_age_s": _age(now, local.last_event_at if local else None),
                    "last_heartbeat_age_s": _age(now, local.last_heartbeat_at if local else None),
                    "stream_on_this_router": local is not None and local.stream is not None,
                    "suspect": self.accuracy.is_suspect(info.worker_id, info.incarnation),
                }
            )
        return JSONResponse({"workers": rows, "index_reachable": self.planner.index_answering})

    async def index_stats(self, request: Request) -> Response:
        try:
            async with index_deadline(_INDEX_TIMEOUT_S):
                stats = await self.index.stats()
        except LocationIndexError as error:  # reported, not raised: the operator asked about it
            return error_response(
                503, f"the index is unreachable ({type(error).__name__})", kind="IndexUnavailable"
            )
        return JSONResponse(
            {
                "keys": stats.keys,
                "entries": stats.entries,
                "workers": stats.workers,
                "bytes": stats.bytes,
                "predicted_entries": len(self.planner.predicted),
            }
        )

    async def drain(self, request: Request) -> Response:
        return self._set_drained(request, drained=True)

    async def undrain(self, request: Request) -> Response:
        return self._set_drained(request, drained=False)

    def _set_drained(self, request: Request, *, drained: bool) -> Response:
        worker_id = request.path_params["worker_id"]
        if self.fleet.status(worker_id) is None:
            return error_response(404, f"no worker {worker_id!r}", kind="NotFoundError")
        if drained:
            self.fleet.drained.add(worker_id)
        else:
            self.fleet.drained.discard(worker_id)
        return JSONResponse({"worker_id": worker_id, "drained": drained})

    async def purge_tenant(self, request: Request) -> Response:
        name = request.path_params["name"]
        tenant = self.tenants.get(name)
        if tenant is None:
            return error_response(404, f"no tenant {name!r}", kind="NotFoundError")
        if tenant.cache_salt is None:
            return error_response(
                400,
                f"tenant {name!r} uses the shared scope, which has no salt to change",
                kind="BadRequestError",
            )
        try:
            async with index_deadline(_INDEX_TIMEOUT_S):
                generation = await self.index.bump_scope_generation(tenant.cache_scope)
        except LocationIndexError as error:  # the operator may try again: purging twice is harmless
            return error_response(
                503,
                f"the index is unreachable ({type(error).__name__}); the purge may not have "
                "happened: try again",
                kind="IndexUnavailable",
            )
        self.tenants.apply_generations({tenant.cache_scope: generation})
        return JSONResponse(
            {"tenant": name, "cache_scope": tenant.cache_scope, "generation": generation}
        )

    async def locality(self, request: Request) -> Response:
        try:
            query, body_bytes = await self._query(request)
            name = query.get("tenant")
            if name is not None and not isinstance(name, str):
                raise BadRequest("'tenant' must be a string", "tenant")
            tenant = ANONYMOUS_TENANT if name is None else self.tenants.get(name)
            if tenant is None:
                return error_response(404, f"no tenant {name!r}", kind="NotFoundError")
            decision, model = await self._decide(query, body_bytes, tenant)
            return JSONResponse(_describe(decision, model, tenant, detailed=True))
        except BadRequest as error:
            return error_response(error.status, str(error), kind="BadRequestError")

    async def tenant_locality(self, request: Request) -> Response:
        """Its own scope only, and nothing of other tenants: eligible workers, their
        cached tokens and total scores, not the terms (the tenant term counts other
        tenants' requests) nor the workers of other tenants' pools."""
        tenant = self.tenants.authenticate(request.headers.get("authorization"))
        if tenant is None:
            return error_response(
                401,
                "a valid API key is required (Authorization: Bearer KEY)",
                kind="AuthenticationError",
                headers={"www-authenticate": "Bearer"},
            )
        try:
            query, body_bytes = await self._query(request)
            if query.get("tenant", tenant.name) != tenant.name:
                return error_response(
                    403, "a tenant's key queries its own scope only", kind="PermissionDenied"
                )
            decision, model = await self._decide(query, body_bytes, tenant)
            return JSONResponse(_describe(decision, model, tenant, detailed=False))
        except BadRequest as error:
            return error_response(error.status, str(error), kind="BadRequestError")

    async def _query(self, request: Request) -> tuple[dict[str, Any], int]:
        raw = await read_body(request, self.max_body_bytes)
        query = decode_json(raw)
        if not isinstance(query, dict):
            raise BadRequest("the request body must be a JSON object")
        return query, len(raw)

    async def _decide(
        self, query: Mapping[str, Any], body_bytes: int, tenant: Tenant
    ) -> tuple[Decision, str]:
        """The decision the proxy would make for the query, keyed and tokenised as the
        proxy would (same scope, same token cache, long prompts off the event loop)."""
        model = query.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest("'model' must be a non-empty string", "model")
        body = {key: value for key, value in query.items() if key != "token_ids"}
        if "token_ids" in query:
            token_ids = query["token_ids"]
            if not isinstance(token_ids, list) or not all(
                type(t) is int and 0 <= t < 2**32 for t in token_ids
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
        tokens = await self.prompt_tokens.of(parsed, body_bytes, scope)
        if tokens is None:
            raise BadRequest("the prompt or messages could not be tokenised")
        decision = await self.planner.decide(
            model=model, tenant=tenant, cache_scope=scope, tokens=tokens
        )
        return decision, model


def _age(now: float, then: float | None) -> float | None:
    return None if then is None else round(now - then, 3)


def _tiers(blocks: Mapping[Tier, int], block_size: int) -> dict[str, int]:
    return {tier.name.lower(): count * block_size for tier, count in blocks.items()}


def _describe(decision: Decision, model: str, tenant: Tenant, *, detailed: bool) -> dict[str, Any]:
    """The decision for the fleet API; not `detailed`, for a tenant: only the workers
    it may use, and their total scores."""
    scores = {breakdown.worker_id: breakdown for breakdown in decision.ranked}
    rows = []
    for worker_id in sorted(decision.candidates if detailed else scores):
        blocks = decision.matched_blocks.get(worker_id, {})
        row: dict[str, Any] = {
            "worker_id": worker_id,
            "eligible": worker_id in scores,
            "matched_blocks": {tier.name.lower(): count for tier, count in blocks.items()},
            "matched_tokens": _tiers(blocks, decision.block_size),
            "cached_tokens": decision.predicted_tokens(worker_id),
        }
        breakdown = scores.get(worker_id)
        if breakdown is not None and not detailed:
            row["score"] = breakdown.score
        elif breakdown is not None:
            row.update(
                score=breakdown.score,
                saved_tokens=breakdown.saved_tokens,
                queue_penalty=breakdown.queue_penalty,
                memory_penalty=breakdown.memory_penalty,
                tenant_penalty=breakdown.tenant_penalty,
            )
        rows.append(row)
    return {
        "model": model,
        "tenant": tenant.name,
        "cache_scope": tenant.cache_scope,
        "prompt_tokens": decision.prompt_tokens,
        "blocks": len(decision.keys),
        "index_answered": decision.index_answered,
        "chosen": decision.ranked[0].worker_id if decision.ranked else None,
        "factor": decision.factor,
        "workers": rows,
    }
