"""What the fleet API takes and gives, as typed models: its handlers build the answers
from them and the OpenAPI document describes both with them.

The locality query's body is read by the handler itself (the size limit, the JSON and
its nesting are checked as for the proxy's bodies), so LocalityQuery only describes it.
"""

from __future__ import annotations

from typing import Annotated, Literal, NotRequired

from pydantic import BaseModel, ConfigDict, Field, RootModel
from typing_extensions import TypedDict

from kvplane.core.types import WorkerRole
from router.index.base import WorkerState
from router.proxy.schema import ModelName, RoutedPrompt, TokenId
from router.routing.wiring import RoutingMode
from router.scoring.disaggregation import ModelLegs

# -- the locality query --------------------------------------------------------------


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class RenderedMessage(BaseModel):
    """A message as kvplane's default chat template renders it."""

    role: str
    content: str | list[TextPart]


class _Query(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: ModelName
    tenant: str | None = Field(default=None, description="whose scope; default: anonymous")


class ByTokenIds(_Query):
    token_ids: list[TokenId]


class ByMessages(_Query):
    model_config = ConfigDict(json_schema_extra={"not": {"required": ["token_ids"]}})

    messages: Annotated[list[RenderedMessage], Field(min_length=1)]


class ByPrompt(_Query):
    model_config = ConfigDict(
        json_schema_extra={
            "not": {"anyOf": [{"required": ["token_ids"]}, {"required": ["messages"]}]}
        }
    )

    prompt: RoutedPrompt


class LocalityQuery(RootModel[ByTokenIds | ByMessages | ByPrompt]):
    """`token_ids` if given, else `messages`, else `prompt`; the others are ignored.
    Messages must render with the model's chat template (the shape here is what
    kvplane's default template accepts)."""


# -- the answers ---------------------------------------------------------------------


class LocalityRow(TypedDict):
    """A worker's part in a decision. The score and its terms are there only for an
    eligible worker; the terms (saved_tokens and the penalties) only for an operator."""

    worker_id: str
    eligible: bool
    matched_blocks: dict[str, int]  # per tier
    matched_tokens: dict[str, int]
    cached_tokens: Annotated[int, Field(ge=0)]
    score: NotRequired[float]
    saved_tokens: NotRequired[float]
    queue_penalty: NotRequired[float]
    memory_penalty: NotRequired[float]
    # Of its new tokens, those another eligible worker holds (a copy), and their cost.
    copy_penalty: NotRequired[float]
    copied_tokens: NotRequired[int]
    tenant_penalty: NotRequired[float]
    spilled: NotRequired[bool]  # far busier than its peers: its queue penalty has the spill


class LocalityLegs(BaseModel):
    """How the request would be served, for a model with prefill/decode workers
    (docs/pd-disaggregation.md); the costs compared, in seconds, for an operator only."""

    split: bool
    reason: str = Field(description="why split or whole (kvplane_legs_decided's reason)")
    decode_worker: str
    prefill_worker: str | None
    whole_s: float | None = None
    split_s: float | None = None
    transfer_bytes: int | None = None


class Locality(BaseModel):
    model: str
    tenant: str
    cache_scope: str
    prompt_tokens: Annotated[int, Field(ge=0)]
    blocks: Annotated[int, Field(ge=0)]
    index_answered: bool
    chosen: str | None
    factor: str
    legs: LocalityLegs | None = Field(
        default=None, description="null for a model none of whose workers transfers KV"
    )
    workers: list[LocalityRow]


class Engine(BaseModel):
    kind: str
    version: str


class WorkerLoad(BaseModel):
    running: int
    waiting: int
    kv_usage: float
    engine_down: bool
    kv_load_failures: int = Field(
        description="pulls of a disaggregated request's KV its engine could not complete, "
        "since it started (it failed or recomputed them: vLLM's kv_load_failure_policy)"
    )
    kv_leases_expired: int = Field(
        description="prompts it prefilled whose KV no decode worker pulled in time, since "
        "it started"
    )


CheckStatusName = Literal["pass", "warn", "fail", "unknown"]


class CheckResult(BaseModel):
    """One link of a worker's wiring (docs/troubleshooting.md): pass, warn (works, but
    weaker than it should), fail, or unknown (not proven either way yet)."""

    name: str
    status: CheckStatusName
    detail: str
    fix: str


class Wiring(BaseModel):
    blind: bool = Field(
        description="a check that the router's sight of the worker's cache depends on "
        "fails: routing there runs on the router's own predictions only"
    )
    checks: list[CheckResult]


class ModelRouting(BaseModel):
    model: str
    routing: RoutingMode = Field(
        description="predictions_only: every worker of the model is blind, and routing "
        "runs on the router's own predicted entries alone (approximate, like a text tree)"
    )
    legs: ModelLegs = Field(
        description="split: its requests may be split into a prefill and a decode leg "
        "(disaggregation.mode decides each); whole: none of its workers transfers KV; "
        "no_prefill_worker: decode workers and no live prefill worker (whole on decode, or "
        "refused: disaggregation.when_no_prefill); no_decode_worker: prefill workers only "
        "(they serve whole requests)"
    )


class WorkerCache(BaseModel):
    """The requests this router sent the worker while it has been in the fleet (its
    restarts included), and what its engine reported cached of them."""

    requests: int
    reported_requests: int = Field(description="those whose engine reported cached tokens")
    reported_prompt_tokens: int = Field(description="their prompt tokens")
    predicted_tokens: int = Field(description="the cached tokens predicted for them")
    achieved_tokens: int = Field(description="the cached tokens the engine reported")
    hit_rate: float | None = Field(
        description="achieved / reported_prompt_tokens; null before any report"
    )
    agreement: float | None = Field(
        description="achieved / predicted: below 1, the engine held less than the router "
        "believed (see prediction_verdicts in the metrics); null while nothing was predicted"
    )
    evicted_from_fleet_tokens: int = Field(
        description="of these requests' prompt tokens, ones the fleet had held and evicted "
        "lately (on any worker)"
    )
    copied_tokens: int = Field(
        description="duplication: prompt tokens prefilled here while another worker held "
        "them (it was passed over for its load, or ineligible)"
    )


class WorkerRow(BaseModel):
    worker_id: str
    state: WorkerState
    drained_by_operator: bool
    incarnation: Annotated[int, Field(ge=1)]
    model: str
    base_url: str
    labels: dict[str, str]
    role: WorkerRole = Field(
        description="the legs of a disaggregated request it takes: prefill, decode, or both "
        "(and whole requests)"
    )
    kv_connector: str | None = Field(description="its engine's KV transfer connector")
    engine: Engine
    block_size: int
    kv_capacity_blocks: int
    lease_remaining_s: float
    index_entries: int
    load: WorkerLoad | None
    router_in_flight: int
    router_prefilling: int
    last_event_age_s: float | None
    last_heartbeat_age_s: float | None
    stream_on_this_router: bool
    suspect: bool
    credit_withdrawn_for_s: float | None = Field(
        description="seconds until the cache credit of a worker that turned suspect again "
        "and again comes back; null while it stands"
    )
    max_model_len: int | None = Field(description="the engine's, as its agent registered it")
    cache: WorkerCache
    wiring: Wiring


class Workers(BaseModel):
    workers: list[WorkerRow]
    index_reachable: bool
    routing: list[ModelRouting]


class WorkerCheck(BaseModel):
    worker_id: str
    model: str
    state: WorkerState
    ok: bool = Field(description="no check failed")
    blind: bool
    checks: list[CheckResult]


class FleetCheck(BaseModel):
    ok: bool = Field(
        description="every live worker passed (no check failed), and at least one is live"
    )
    index_reachable: bool
    workers: list[WorkerCheck]
    routing: list[ModelRouting]
    problems: list[str] = Field(description="each failure, as one line: worker, check, detail")


class IndexStatistics(BaseModel):
    keys: Annotated[int, Field(ge=0)]
    entries: Annotated[int, Field(ge=0)]
    workers: Annotated[int, Field(ge=0)]
    bytes: Annotated[int, Field(ge=0)]
    predicted_entries: Annotated[int, Field(ge=0)]
    server_memory_used: float | None = Field(
        description="the fullest Redis server's used_memory over its maxmemory; null: no "
        "limit set, or the index is in the router's memory"
    )


class Drained(BaseModel):
    worker_id: str
    drained: bool


class Purged(BaseModel):
    tenant: str
    cache_scope: str
    generation: Annotated[int, Field(ge=1)]


# -- the cache-loss funnel -----------------------------------------------------------


class FunnelRow(BaseModel):
    """One model and tenant's answered requests since the router started, through the
    cache-loss funnel (router/routing/funnel.py), in tokens."""

    model: str
    tenant: str
    requests: int
    prompt_tokens: int
    attainable_tokens: int = Field(description="the longest prefix any candidate held")
    predicted_tokens: int = Field(description="the prefix held where the requests went")
    achieved_tokens: int = Field(description="what the engines reported cached")
    reported_requests: int = Field(description="requests whose engine reported cached tokens")
    reported_prompt_tokens: int = Field(description="their prompt tokens")
    hit_rate: float | None = Field(
        description="achieved / reported_prompt_tokens: the share of prompt tokens the "
        "engines did not prefill; null before any report"
    )
    lost_tokens: dict[str, int] = Field(
        description="per reason: evicted_from_fleet (prompt, not attainable: the fleet had "
        "held them and evicted them lately); routed_for_load, holder_unavailable "
        "(attainable, not predicted); tier_restore, evicted_before_arrival, "
        "prediction_wrong, unreported (predicted, not achieved)"
    )
    copied_tokens: int = Field(
        description="duplication: tokens prefilled on a worker while another held them "
        "(routed_for_load + holder_unavailable), which the fleet then holds twice"
    )


class Funnel(BaseModel):
    rows: list[FunnelRow]


# -- flow control ------------------------------------------------------------------


class FlowModel(BaseModel):
    """One model's requests waiting for room in its engines (router/flow_control)."""

    model: str
    room: int | None = Field(
        description="requests its engines can take now before each has "
        "flow_control.max_engine_waiting waiting; null: some engine's limit is not known "
        "yet (it never queued a request), so nothing is held"
    )
    waiting: dict[str, dict[str, int]] = Field(
        description="band -> tenant -> requests waiting in this router"
    )
    waiting_elsewhere: dict[str, dict[str, int]] = Field(
        description="band -> tenant -> requests waiting in the other router replicas"
    )
    counters: dict[str, float] = Field(
        description="tenant -> virtual counter: its service, weighted by cost and divided "
        "by its share (the least served backlogged tenant goes next)"
    )


class FlowTenant(BaseModel):
    tenant: str
    service_tokens: float = Field(
        description="service through this router since it started, in cost units "
        "(computed prompt tokens x input_token_cost + generated x output_token_cost + "
        "their context x context_token_cost)"
    )
    service_share: float | None = Field(description="its share of all tenants' service")
    shed: dict[str, int] = Field(
        description="requests shed with a 429, per reason: queue_full, displaced, "
        "queue_timeout, deadline"
    )


class Flow(BaseModel):
    enabled: bool
    replicas: int = Field(description="router replicas sharing flow control, this one included")
    models: list[FlowModel]
    tenants: list[FlowTenant]


class HotPrefixRow(BaseModel):
    """A cached prefix requests reused (router/routing/hot_prefixes.py)."""

    tenant: str
    key: str = Field(description="the hash of the prefix's last block, 16 hex digits")
    tokens: int = Field(description="the prefix's length")
    requests: int = Field(description="requests whose prompt matched all of it")
    reused_tokens: int = Field(description="requests x tokens: prompt tokens it could save")
