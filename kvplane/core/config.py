"""kvplane's configuration: one typed model, read from a TOML file, the environment and
command-line flags, in rising priority.

Environment variables are `KVPLANE_<SECTION>__<FIELD>`, for example
`KVPLANE_INDEX__BACKEND=redis` or `KVPLANE_CONTROL_PLANE__LEASE_S=3`. The defaults run a
single router on one machine with nothing else installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from kvplane.core.keys import SCHEME_VERSION
from kvplane.core.kv_transfer import parse_kv_transfer_config
from kvplane.core.worker_credentials import MIN_SECRET_CHARS


class ConfigError(ValueError):
    """Configuration that passed validation field by field but does not hold together
    (checked where it is used, e.g. the tenants); the CLI reports it in one line."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class IndexSettings(_Section):
    backend: Literal["memory", "redis", "redis-cluster"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = Field(default="kvp", pattern=r"^[A-Za-z0-9._-]{1,32}$")
    # The layout (docs/redis-layout.md), the same on every router of a fleet: groups the
    # workers are placed in, and whether each keeps a directory (cheaper lookups in a
    # large fleet, for dearer writes and more memory).
    redis_groups: int = Field(default=16, ge=1, le=256)
    redis_directory: bool = False
    max_entries: int = Field(default=20_000_000, ge=1)

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str) -> str:
        # Checked here, where a wrong one is one line of "invalid configuration", not
        # where redis-py would raise it from deep inside the router's start-up.
        if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return url


class ControlPlaneSettings(_Section):
    grpc_host: str = "127.0.0.1"
    grpc_port: int = Field(default=50051, ge=0, le=65535)
    block_size: int = Field(default=16, ge=1, le=65536)
    key_scheme_version: int = SCHEME_VERSION
    lease_s: float = Field(default=5.0, gt=0)
    max_batch_events: int = Field(default=4096, ge=1)
    max_batch_blocks: int = Field(default=65536, ge=1)
    max_message_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    agent_token: SecretStr | None = None
    # A file holding agent_token, read at start (a worker's own token, written by an
    # init container running `kvplane worker-token`, or a mounted Secret).
    agent_token_file: Path | None = None
    # Set: each agent proves its worker id at Register with its own token (`kvplane
    # worker-token`, docs/wire-contract.md); agent_token alone is then not enough.
    worker_credential_secret: SecretStr | None = None
    # A worker's base_url must name the address its agent connects from, or a host or
    # network listed here (a Service name, an ingress): a Register naming any other is
    # refused, so that no agent can send a worker's requests somewhere else.
    bind_engines_to_agents: bool = True
    allowed_engine_hosts: list[str] = Field(default_factory=list)
    # Incarnations are the agent's wall clock in ns: one further ahead of this router's
    # clock is refused, so that a forged one (2**64 - 1) cannot fence the real agent out
    # for longer than this.
    max_incarnation_ahead_s: float = Field(default=60.0, gt=0)
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None  # set: agents must present a certificate (mTLS)
    # With mTLS, a worker id must be its agent's certificate's common name or one of its
    # subject alternative names: a certificate speaks for the workers it names only.
    bind_worker_ids_to_certificates: bool = True

    @model_validator(mode="before")
    @classmethod
    def _token_from_file(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("agent_token_file") is None:
            return data
        if data.get("agent_token") is not None:
            raise ValueError("set agent_token or agent_token_file, not both")
        path = Path(data["agent_token_file"])
        try:
            token = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"agent_token_file {path} cannot be read ({error})") from None
        if not token:
            raise ValueError(f"agent_token_file {path} is empty")
        return {**data, "agent_token": token}

    @field_validator("worker_credential_secret")
    @classmethod
    def _long_enough(cls, secret: SecretStr | None) -> SecretStr | None:
        if secret is not None and len(secret.get_secret_value()) < MIN_SECRET_CHARS:
            raise ValueError(f"must be at least {MIN_SECRET_CHARS} characters")
        return secret

    @model_validator(mode="after")
    def _tls_pairs(self) -> ControlPlaneSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file (mTLS) needs tls_cert_file and tls_key_file")
        return self


class ScoringSettings(_Section):
    """Weights of the routing score (router/scoring), every term in prefill tokens."""

    # `round-robin` ignores the scores (they are still computed and reported): a
    # baseline to compare against, as `kvplane demo` does.
    policy: Literal["kvplane", "round-robin"] = "kvplane"

    # Queue: each waiting request costs its fixed overhead (its prefill work is in
    # queued_prefill_tokens when this router sent it, unknown when the engine reports it).
    # The queue weights were chosen with `kvplane bench policies` (docs/simulation.md):
    # lighter ones than 256 and 1.0 keep prefixes together under load, which cut TTFT p90
    # most where the fleet is busiest (queued tokens often hit the cache too).
    waiting_request_tokens: float = Field(default=64.0, ge=0)
    # Per prefill token queued ahead.
    queued_prefill_weight: float = Field(default=0.25, ge=0)
    # Decoding requests slow every step a little: a light tie-breaker towards idle workers.
    running_request_tokens: float = Field(default=32.0, ge=0)
    # Memory pressure: past this KV usage, a request's new blocks evict cached ones.
    memory_pressure_start: float = Field(default=0.9, ge=0, lt=1)
    memory_pressure_weight: float = Field(default=1.0, ge=0)  # per new token, at full pressure
    # Of those new tokens, the ones another eligible worker already holds make a copy:
    # the fleet then keeps that prefix twice, in room another prefix needed. They cost
    # this instead (per token, at full pressure), so that a copy is made where load
    # outweighs it, and the breakdown says when avoiding one decided.
    copy_pressure_weight: float = Field(default=1.0, ge=0)
    # Spill: past a gate (its requests waiting and running over the eligible workers'
    # mean by spill_margin_requests and by spill_load_ratio times), each of a worker's
    # requests over that mean costs spill_request_tokens more (margin 0: off). The queue
    # terms alone never outweigh a shared system prompt, so without it every new chat
    # piles onto the engines that hold it (docs/benchmarks.md); the gate is relative, so
    # a fleet busy everywhere keeps its prefixes where they are cached.
    spill_margin_requests: float = Field(default=4.0, ge=0)
    spill_load_ratio: float = Field(default=1.5, ge=1.0)
    spill_request_tokens: float = Field(default=256.0, ge=0)
    # The most the spill adds to a worker's penalty: a request whose prefix is cached
    # there and nowhere else by more than this stays (an agent's own long context,
    # which moving would prefill again), while a chat with a short history of its own
    # still moves. Chosen on `kvplane sim --live agent-tree` and `multi-turn`.
    spill_max_tokens: float = Field(default=1536.0, ge=0)
    # Engines count only running requests' blocks as used, so a cache full of prefixes
    # reads as empty: a worker that evicted its whole cache within about this many
    # seconds is under full pressure too (0: off).
    eviction_horizon_s: float = Field(default=10.0, ge=0)
    # The latest device-tier removals remembered, in keys (about 80 bytes each: 500,000
    # take at most 40 MB): the prompt tokens the fleet had held and evicted, for the
    # cache-loss funnel (0: none remembered, so none told apart).
    recent_removals_keys: int = Field(default=500_000, ge=0)
    # Tenant risk, for the `private` isolation class.
    co_residence_tokens: float = Field(default=2048.0, ge=0)  # per other tenant's request
    missing_label_tokens: float = Field(default=8192.0, ge=0)  # per required label missing
    # What a hit on a slower tier is worth: restoring a token's KV (bytes / bandwidth)
    # against recomputing it (1 / prefill rate). Defaults: an 8B model on one H100.
    prefill_tokens_per_s: float = Field(default=12_500.0, gt=0)
    kv_bytes_per_token: int = Field(default=131_072, gt=0)  # 32 layers x 8 KV heads x 128 x 2 x 2
    host_bandwidth_bytes_per_s: float = Field(default=25e9, ge=0)  # PCIe 5 x16, half of peak
    disk_bandwidth_bytes_per_s: float = Field(default=5e9, ge=0)  # a local NVMe drive
    remote_bandwidth_bytes_per_s: float = Field(default=1.25e9, ge=0)  # 10 Gbit/s


class HttpSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    # The fleet API (/fleet/...) answers only this bearer token; without one it is off.
    admin_token: SecretStr | None = None
    # Set: the fleet API and /metrics move to this port, so that the port clients reach
    # serves only the OpenAI API and the probes.
    admin_port: int | None = Field(default=None, ge=0, le=65535)
    # On SIGTERM /readyz fails at once; new requests are still served for drain_delay_s
    # (a Kubernetes Service takes a few seconds to stop sending them), then the ports
    # close and the requests in progress, streams included, have drain_timeout_s to
    # finish before they are cut.
    drain_delay_s: float = Field(default=0.0, ge=0, le=300)
    drain_timeout_s: float = Field(default=30.0, ge=0, le=3600)


class ProxySettings(_Section):
    """The OpenAI-compatible proxy: tokenisation, upstream timeouts, failover."""

    # The served models' Hugging Face tokenizers (local directories): one per model
    # name, else tokenizer_dir for every model, else kvplane's shipped tiny tokenizer.
    tokenizer_dir: Path | None = None
    tokenizer_dirs: dict[str, Path] = Field(default_factory=dict)
    max_attempts: int = Field(default=3, ge=1, le=16)  # workers tried before the first byte
    connect_timeout_s: float = Field(default=2.0, gt=0)
    first_byte_timeout_s: float = Field(default=120.0, gt=0)  # includes queueing and prefill
    idle_timeout_s: float = Field(default=60.0, gt=0)  # longest gap inside a response
    retry_after_s: int = Field(default=1, ge=0)  # the Retry-After of a 503
    unreachable_backoff_s: float = Field(default=2.0, ge=0)  # a refused worker sits out
    index_timeout_s: float = Field(default=0.25, gt=0)  # past it, route on load alone
    predicted_ttl_s: float = Field(default=3.0, ge=0)  # routed prefixes, before events
    suspect_after_misses: int = Field(default=5, ge=1)  # predictions in a row the engine
    # did not confirm before a worker's index entries count as suspect
    # A worker that turns suspect this many times within suspicion_window_s, with most
    # of its recent predictions stale, loses its cache credit for credit_withdrawal_s,
    # new incarnations included (router/routing/accuracy.py).
    withdraw_credit_after_suspicions: int = Field(default=3, ge=1)
    suspicion_window_s: float = Field(default=3600.0, gt=0)
    credit_withdrawal_s: float = Field(default=900.0, ge=0)
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    # A prompt's tokens are capped at its model's max_model_len, as the engines register
    # it, and at this, the lower. Over the cap a request is refused before a long prompt
    # is tokenised whole. The default bounds what an agent's registered length can lift
    # the cap to (what a prompt may cost the router: ~1.3 s of CPU at 2^20 tokens, where
    # a 32 MiB body tokenised whole costs tens of seconds); raise it for longer contexts.
    max_prompt_tokens: int = Field(default=1 << 20, ge=1)
    max_connections: int = Field(default=1024, ge=1)  # upstream connections, all workers
    # Each of the two token caches (whole prompts, prompt pieces) holds this many (4 B each).
    token_cache_tokens: int = Field(default=2_000_000, ge=0)


class FlowControlSettings(_Section):
    """Requests wait in the router while a model's engines are saturated, in priority
    bands, tenants sharing each band by what they cost (docs/router.md "Flow control")."""

    enabled: bool = False
    # A worker can take a request while fewer than this wait in its engine's queue (as
    # its engine reports it, plus what was sent since); a model whose every worker is at
    # it is saturated, and its requests wait here. 0: a worker whose engine queues any.
    max_engine_waiting: int = Field(default=2, ge=0)
    # Of those places, what a tenant with a backlog (more requests waiting here, or at
    # another replica) takes before a waiting tenant without one: that tenant's request
    # then goes first, ahead of its turn, and starts at its engine's next free batch
    # slot instead of behind the backlog's. More than max_engine_waiting is read as
    # max_engine_waiting.
    max_engine_waiting_backlogged: int = Field(default=1, ge=0)
    # A tenant counts as having a backlog where it also asked for more than its share
    # lately: what its requests would cost (prompts, and answers as long as its answers
    # lately), decayed with this time constant, over twice the other tenants'
    # mean (a lighter tenant whose requests bunch up keeps its place).
    recent_demand_window_s: float = Field(default=10.0, gt=0)
    # A worker whose KV cache is this full takes no more (a new request would evict or
    # preempt there); 1.0 leaves it to the queue alone.
    max_kv_usage: float = Field(default=1.0, gt=0, le=1)
    max_queued_requests: int = Field(default=1024, ge=0)  # waiting here, per model
    max_wait_s: float = Field(default=60.0, gt=0)  # past it, shed (queue_timeout)
    # What a tenant's service costs, per token, on its virtual counter: prompt tokens
    # not predicted cached at dispatch; generated tokens at the grant, as many as the
    # tenant's answers lately had (no more than the client allows), corrected to those
    # generated at the end.
    input_token_cost: float = Field(default=1.0, ge=0)
    output_token_cost: float = Field(default=2.0, ge=0)
    # And what a generated token holds in the KV cache while it is computed: this much a
    # token of its request's context (the whole prompt, cached or not, and the answer so
    # far). A long request's answer holds an engine's cache longer and more of it: where
    # the cache is what runs out, its tokens cost more than a short one's.
    context_token_cost: float = Field(default=0.01, ge=0)
    # Within a tenant: first come first served, or earliest deadline first (requests
    # without a deadline last, in arrival order).
    order: Literal["fcfs", "deadline"] = "fcfs"
    # Shared by router replicas on a Redis index: tenants' counters, which tenants wait
    # where, the router's traffic at each worker. Re-read this often while any waits.
    shared_refresh_s: float = Field(default=0.05, gt=0)
    # Tenants' counters are read as this much service apart before one's turn is
    # another's: a request's worth, so that two routers do not trade turns every token.
    fairness_slack_tokens: float = Field(default=2048.0, ge=0)

    @property
    def backlogged_engine_waiting(self) -> int:
        """The places a tenant with a backlog may take (never more than anyone may)."""
        return min(self.max_engine_waiting_backlogged, self.max_engine_waiting)


class DisaggregationSettings(_Section):
    """Prefill/decode disaggregation, for models whose workers register a KV connector
    (docs/pd-disaggregation.md). The costs are in seconds, with the prefill rate and KV
    size of `[scoring]`."""

    mode: Literal["conditional", "always", "never"] = Field(
        default="conditional",
        description="conditional: split a request into a prefill and a decode leg only where "
        "that costs less than computing its uncached tokens on the decode worker; always: "
        "every request the fleet can split; never: whole requests only",
    )
    when_no_prefill: Literal["aggregate", "refuse"] = Field(
        default="aggregate",
        description="a model with decode workers and no live prefill worker: serve whole "
        "requests on the decode workers (counted, and reported on the fleet API) or "
        "refuse them (503)",
    )
    link_bytes_per_s: float = Field(
        default=25e9, gt=0, description="KV transfer bandwidth between two workers"
    )
    leg_overhead_s: float = Field(
        default=0.003,
        ge=0,
        description="what a prefill leg costs besides its compute: the extra round trip, "
        "the decode's pull set-up",
    )
    decode_stall_weight: float = Field(
        default=0.05,
        ge=0,
        description="what a running stream's stall counts, against the request's own wait, "
        "when its decode worker computes a prompt (0: streams' inter-token latency is free)",
    )


class PickerSettings(_Section):
    """The gateway's endpoint picker: Envoy's ext_proc service, speaking the Gateway API
    Inference Extension's protocol (docs/picker.md). Off unless `port` is set."""

    host: str = "127.0.0.1"
    port: int | None = Field(default=None, ge=0, le=65535)
    tls_cert_file: Path | None = None  # set with tls_key_file: the picker serves TLS
    tls_key_file: Path | None = None
    # A request the picker hands to Envoy weighs on its worker until the worker's next
    # load report, and this long at most (a replica that no agent reports to gets none).
    hand_off_s: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _tls_pair(self) -> PickerSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        return self


IsolationClass = Literal["shared", "private", "dedicated"]


class RequestLimits(_Section):
    """How much one tenant may ask of the fleet; past it, a 429 with Retry-After."""

    requests_per_s: float | None = Field(default=None, gt=0)  # sustained
    burst: int | None = Field(default=None, ge=1)  # above the rate; default: 1 s of it
    concurrent_requests: int | None = Field(default=None, ge=1)  # streams until they end


NAME_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"


class TenantSpec(_Section):
    """One tenant: its API keys (SHA-256 hex digests, never the keys) and isolation."""

    name: str = Field(pattern=NAME_PATTERN)
    api_key_sha256: list[str] = Field(default_factory=list)
    # Tenants naming the same scope share cached blocks (an explicit opt-in); without
    # one a tenant's scope is its own ("tenant:<name>", which no name can match). The
    # scope "shared" is the unsalted cache that requests without a cache_salt use.
    cache_scope: str | None = Field(default=None, pattern=NAME_PATTERN)
    isolation: IsolationClass = "shared"
    required_labels: dict[str, str] = Field(default_factory=dict)  # `private`: soft
    pool: str | None = None  # `dedicated`: only workers labelled kvplane.io/pool=<pool>
    limits: RequestLimits = Field(default_factory=RequestLimits)
    # Flow control (FlowControlSettings): the band its requests wait in (higher first;
    # below 0, shed first), the highest a request's `x-kvplane-priority` may ask (None:
    # the header is ignored), and its share of a band against the band's other tenants.
    priority: int = Field(default=0, ge=-1000, le=1000)
    max_priority: int | None = Field(default=None, ge=-1000, le=1000)
    share: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> TenantSpec:
        for digest in self.api_key_sha256:
            if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
                raise ValueError(f"tenant {self.name}: api_key_sha256 entries are 64 hex digits")
        if self.isolation == "dedicated" and not self.pool:
            raise ValueError(f"tenant {self.name}: the dedicated class needs a pool")
        return self


class TenantSettings(_Section):
    tenants: list[TenantSpec] = Field(default_factory=list)
    # A TOML file of [[tenants]] tables, read at start (mounted from a secret, say).
    tenants_file: Path | None = None
    # Derives each scope's cache salt; routers sharing an index need the same one.
    # Unset: a random secret per process (salts, and so tenants' hits, die with it).
    cache_salt_secret: SecretStr | None = None
    # Requests without a key: None allows them only while no tenant is configured.
    allow_anonymous: bool | None = None
    anonymous_limits: RequestLimits = Field(default_factory=RequestLimits)  # all together


class AgentSettings(_Section):
    """`kvplane agent`: the engine it sits beside and the control plane it reports to.
    The agent keys blocks with `control_plane.block_size` and authenticates with
    `control_plane.agent_token`, the same settings the router reads."""

    worker_id: str = Field(
        default="worker-0",
        pattern=r"^[A-Za-z0-9._:-]{1,128}$",
        description="stable name of this worker (engine replica)",
    )
    engine: Literal["vllm", "sglang"] = Field(
        default="vllm", description="which engine's wire forms and metrics to expect"
    )
    engine_url: str = Field(
        default="http://127.0.0.1:8000",
        description="the engine's HTTP base URL, as the agent reaches it (health, metrics)",
    )
    advertise_url: str | None = Field(
        default=None,
        description="the engine's base URL as routers reach it (default: --engine-url)",
    )
    model: str | None = Field(
        default=None,
        description="model name to key blocks with (default: the engine's first model)",
    )
    kv_events_endpoint: str = Field(
        default="tcp://127.0.0.1:5557", description="the engine's ZMQ PUB endpoint"
    )
    kv_events_replay_endpoint: str | None = Field(
        default=None,
        description="the engine's ZMQ replay endpoint (without it, a missed batch costs "
        "the agent its whole picture)",
    )
    kv_events_topic: str = Field(default="", description="ZMQ topic the engine publishes under")
    control_plane_address: str = Field(
        default="127.0.0.1:50051",
        pattern=r"^[^,\s]+(,[^,\s]+)*$",
        description="host:port of the control plane's gRPC server; several, separated by "
        "commas (router replicas sharing an index), are tried in turn when a stream ends",
    )
    tls_ca_file: Path | None = Field(
        default=None, description="CA to verify the control plane with (turns TLS on)"
    )
    tls_cert_file: Path | None = Field(
        default=None, description="the agent's certificate, for mutual TLS"
    )
    tls_key_file: Path | None = Field(default=None, description="its private key")
    load_interval_s: float = Field(
        default=1.0, gt=0, description="seconds between health probes and load reports"
    )
    # Reading an engine's metrics is most of what an idle agent costs (docs/benchmarks.md).
    idle_metrics_interval_s: float = Field(
        default=3.0,
        gt=0,
        description="seconds between reads of the engine's metrics while it is idle "
        "(nothing running or waiting, no KV event since the last read; an event ends the "
        "wait); /health is still probed, and the last load reported, every load interval",
    )
    engine_down_after_failures: int = Field(
        default=2, ge=1, description="failed health probes before the engine counts as down"
    )
    reconnect_min_s: float = Field(
        default=0.1, gt=0, description="first reconnect delay (it doubles, with jitter)"
    )
    reconnect_max_s: float = Field(default=5.0, gt=0, description="longest reconnect delay")
    replay_timeout_s: float = Field(
        default=2.0, gt=0, description="how long to wait for each replay reply"
    )
    events_connect_grace_s: float = Field(
        default=3.0,
        gt=0,
        description="how long the event socket may go without a publisher on its other "
        "end before the agent reports it not connected (docs/troubleshooting.md)",
    )
    events_silent_after_s: float = Field(
        default=10.0,
        gt=0,
        description="how long after the engine's counters prove that it cached a new "
        "block no KV event may arrive before the agent reports its events silent",
    )
    # 50 ms: measured on the live bake-off (docs/benchmarks.md): 20 ms sent 1.3x the
    # batches for the same traffic; 100 ms sent fewer still but held evictions back long
    # enough to cost hit rate where caches turn over.
    batch_linger_s: float = Field(
        default=0.05,
        ge=0,
        le=1,
        description="how long the engine's first event batch after a quiet spell waits "
        "for its next steps, which are then read with it and sent as one batch: engines "
        "publish every step, each wake-up costs the agent more than a batch's own work, "
        "and each batch costs the control plane a message, a parse and an acknowledgement",
    )
    # 8: the control plane's Ack write was a third of its CPU for an agent's batches, and
    # the agent's read of it a third of the agent's (docs/benchmarks.md).
    ack_every_batches: int = Field(
        default=8,
        ge=1,
        le=1024,
        description="batches sent before one asks the control plane for its Ack (1: every "
        "batch); unacknowledged batches are kept and sent again after a reconnect, and a "
        "load interval after the last batch an agent with nothing more to send asks for the "
        "Ack of what it sent",
    )
    max_pending_blocks: int = Field(
        default=2_000_000,
        ge=1,
        description="blocks of events kept while the control plane is unreachable; past "
        "it, a new incarnation sends the current picture instead",
    )
    max_tracked_blocks: int = Field(
        default=4_000_000, ge=1, description="engine blocks tracked; past it, start over"
    )
    labels: dict[str, str] = Field(
        default_factory=dict, description="labels registered with the worker (JSON object)"
    )
    role: Literal["auto", "both", "prefill", "decode"] = Field(
        default="auto",
        description="which legs of a disaggregated request the worker takes; auto: from "
        "the engine's kv_transfer_config (kv_producer: prefill, kv_consumer: decode, "
        "kv_both or none: both). NixlConnector deployments give every engine kv_both, so "
        "set prefill or decode here to split the fleet into pools",
    )
    kv_transfer_config: str | None = Field(
        default=None,
        description="the engine's --kv-transfer-config JSON, where its metrics do not say "
        "it (only kv_connector and kv_role are read)",
    )

    @field_validator("kv_transfer_config")
    @classmethod
    def _vllm_kv_transfer_config(cls, value: str | None) -> str | None:
        if value is not None:
            parse_kv_transfer_config(value)  # its ValueError says what is wrong
        return value

    @model_validator(mode="after")
    def _tls_pairs(self) -> AgentSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_cert_file is not None and self.tls_ca_file is None:
            raise ValueError("a client certificate (mTLS) needs tls_ca_file")
        return self


class TracingSettings(_Section):
    """OpenTelemetry spans of the router's decisions, exported over OTLP/HTTP."""

    otlp_endpoint: str | None = None  # e.g. http://collector:4318/v1/traces; None: off
    service_name: str = "kvplane-router"
    sample_ratio: float = Field(default=1.0, ge=0, le=1)


class LoggingSettings(_Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: Literal["text", "json"] = "text"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVPLANE_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    index: IndexSettings = IndexSettings()
    control_plane: ControlPlaneSettings = ControlPlaneSettings()
    http: HttpSettings = HttpSettings()
    scoring: ScoringSettings = ScoringSettings()
    proxy: ProxySettings = ProxySettings()
    picker: PickerSettings = PickerSettings()
    disaggregation: DisaggregationSettings = DisaggregationSettings()
    flow_control: FlowControlSettings = FlowControlSettings()
    tenants: TenantSettings = TenantSettings()
    agent: AgentSettings = AgentSettings()
    tracing: TracingSettings = TracingSettings()
    logging: LoggingSettings = LoggingSettings()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = _config_file.get()
        if config_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=config_file))
        return tuple(sources)


_config_file: ContextVar[Path | None] = ContextVar("kvplane_config_file", default=None)


def load_settings(
    config_file: Path | None = None, overrides: Mapping[str, Any] | None = None
) -> Settings:
    """Settings from `config_file` (TOML), then `KVPLANE_*`, then `overrides` (flags).

    `overrides` is nested like the file (`{"index": {"backend": "redis"}}`); a flag the
    user did not give must be left out rather than passed as None.
    """
    if config_file is not None and not config_file.is_file():
        raise FileNotFoundError(f"config file {config_file} does not exist")
    token = _config_file.set(config_file)
    try:
        return Settings(**dict(overrides or {}))
    finally:
        _config_file.reset(token)
