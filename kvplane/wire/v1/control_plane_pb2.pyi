from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DEVICE: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_BOTH: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]

class EventsState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENTS_STATE_UNSPECIFIED: _ClassVar[EventsState]
    EVENTS_STATE_NOT_CONNECTED: _ClassVar[EventsState]
    EVENTS_STATE_NEVER_SEEN: _ClassVar[EventsState]
    EVENTS_STATE_FLOWING: _ClassVar[EventsState]
    EVENTS_STATE_SILENT: _ClassVar[EventsState]

class ReplayState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLAY_STATE_UNSPECIFIED: _ClassVar[ReplayState]
    REPLAY_STATE_NOT_CONFIGURED: _ClassVar[ReplayState]
    REPLAY_STATE_OK: _ClassVar[ReplayState]
    REPLAY_STATE_FAILING: _ClassVar[ReplayState]

class RejectCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REJECT_CODE_UNSPECIFIED: _ClassVar[RejectCode]
    REJECT_CODE_UNAUTHENTICATED: _ClassVar[RejectCode]
    REJECT_CODE_INVALID_MESSAGE: _ClassVar[RejectCode]
    REJECT_CODE_NOT_REGISTERED: _ClassVar[RejectCode]
    REJECT_CODE_STALE_INCARNATION: _ClassVar[RejectCode]
    REJECT_CODE_INCOMPATIBLE: _ClassVar[RejectCode]
    REJECT_CODE_BATCH_TOO_LARGE: _ClassVar[RejectCode]
TIER_UNSPECIFIED: Tier
TIER_DEVICE: Tier
TIER_HOST: Tier
TIER_DISK: Tier
TIER_REMOTE: Tier
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_BOTH: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
EVENTS_STATE_UNSPECIFIED: EventsState
EVENTS_STATE_NOT_CONNECTED: EventsState
EVENTS_STATE_NEVER_SEEN: EventsState
EVENTS_STATE_FLOWING: EventsState
EVENTS_STATE_SILENT: EventsState
REPLAY_STATE_UNSPECIFIED: ReplayState
REPLAY_STATE_NOT_CONFIGURED: ReplayState
REPLAY_STATE_OK: ReplayState
REPLAY_STATE_FAILING: ReplayState
REJECT_CODE_UNSPECIFIED: RejectCode
REJECT_CODE_UNAUTHENTICATED: RejectCode
REJECT_CODE_INVALID_MESSAGE: RejectCode
REJECT_CODE_NOT_REGISTERED: RejectCode
REJECT_CODE_STALE_INCARNATION: RejectCode
REJECT_CODE_INCOMPATIBLE: RejectCode
REJECT_CODE_BATCH_TOO_LARGE: RejectCode

class AgentMessage(_message.Message):
    __slots__ = ("register", "kv_events", "load", "drain")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    register: Register
    kv_events: KvEvents
    load: Load
    drain: Drain
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., kv_events: _Optional[_Union[KvEvents, _Mapping]] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ...) -> None: ...

class ControlMessage(_message.Message):
    __slots__ = ("ack", "resync", "reject")
    ACK_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    REJECT_FIELD_NUMBER: _ClassVar[int]
    ack: Ack
    resync: Resync
    reject: Reject
    def __init__(self, ack: _Optional[_Union[Ack, _Mapping]] = ..., resync: _Optional[_Union[Resync, _Mapping]] = ..., reject: _Optional[_Union[Reject, _Mapping]] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("worker_id", "incarnation", "base_url", "model", "block_size", "key_scheme_version", "kv_capacity_blocks", "engine_kind", "engine_version", "labels", "max_model_len", "role", "kv_connector")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KEY_SCHEME_VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KIND_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_CONNECTOR_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: int
    base_url: str
    model: str
    block_size: int
    key_scheme_version: int
    kv_capacity_blocks: int
    engine_kind: str
    engine_version: str
    labels: _containers.ScalarMap[str, str]
    max_model_len: int
    role: WorkerRole
    kv_connector: str
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., base_url: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., key_scheme_version: _Optional[int] = ..., kv_capacity_blocks: _Optional[int] = ..., engine_kind: _Optional[str] = ..., engine_version: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., max_model_len: _Optional[int] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., kv_connector: _Optional[str] = ...) -> None: ...

class BlocksStored(_message.Message):
    __slots__ = ("parent_key", "keys", "first_position", "tier")
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    parent_key: int
    keys: _containers.RepeatedScalarFieldContainer[int]
    first_position: int
    tier: Tier
    def __init__(self, parent_key: _Optional[int] = ..., keys: _Optional[_Iterable[int]] = ..., first_position: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class BlocksRemoved(_message.Message):
    __slots__ = ("keys", "tier")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[int]
    tier: Tier
    def __init__(self, keys: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlocksStored
    removed: BlocksRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlocksStored, _Mapping]] = ..., removed: _Optional[_Union[BlocksRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class KvEvents(_message.Message):
    __slots__ = ("sequence", "events", "timestamp_ms", "ack_deferred")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    ACK_DEFERRED_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    timestamp_ms: int
    ack_deferred: bool
    def __init__(self, sequence: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., timestamp_ms: _Optional[int] = ..., ack_deferred: _Optional[bool] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("running", "waiting", "kv_usage", "timestamp_ms", "engine_down", "wiring", "kv_load_failures", "kv_leases_expired")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_DOWN_FIELD_NUMBER: _ClassVar[int]
    WIRING_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_usage: float
    timestamp_ms: int
    engine_down: bool
    wiring: Wiring
    kv_load_failures: int
    kv_leases_expired: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., timestamp_ms: _Optional[int] = ..., engine_down: _Optional[bool] = ..., wiring: _Optional[_Union[Wiring, _Mapping]] = ..., kv_load_failures: _Optional[int] = ..., kv_leases_expired: _Optional[int] = ...) -> None: ...

class Wiring(_message.Message):
    __slots__ = ("events", "replay", "engine_block_size", "events_detail", "replay_detail", "skipped_events")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_DETAIL_FIELD_NUMBER: _ClassVar[int]
    REPLAY_DETAIL_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: EventsState
    replay: ReplayState
    engine_block_size: int
    events_detail: str
    replay_detail: str
    skipped_events: _containers.RepeatedCompositeFieldContainer[SkippedEvents]
    def __init__(self, events: _Optional[_Union[EventsState, str]] = ..., replay: _Optional[_Union[ReplayState, str]] = ..., engine_block_size: _Optional[int] = ..., events_detail: _Optional[str] = ..., replay_detail: _Optional[str] = ..., skipped_events: _Optional[_Iterable[_Union[SkippedEvents, _Mapping]]] = ...) -> None: ...

class SkippedEvents(_message.Message):
    __slots__ = ("event_type", "reason", "count")
    EVENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    event_type: str
    reason: str
    count: int
    def __init__(self, event_type: _Optional[str] = ..., reason: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Ack(_message.Message):
    __slots__ = ("sequence", "lease_ms", "defers_acks", "max_batch_events", "max_batch_blocks")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    DEFERS_ACKS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_EVENTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    lease_ms: int
    defers_acks: bool
    max_batch_events: int
    max_batch_blocks: int
    def __init__(self, sequence: _Optional[int] = ..., lease_ms: _Optional[int] = ..., defers_acks: _Optional[bool] = ..., max_batch_events: _Optional[int] = ..., max_batch_blocks: _Optional[int] = ...) -> None: ...

class Resync(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Reject(_message.Message):
    __slots__ = ("code", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: RejectCode
    reason: str
    def __init__(self, code: _Optional[_Union[RejectCode, str]] = ..., reason: _Optional[str] = ...) -> None: ...
