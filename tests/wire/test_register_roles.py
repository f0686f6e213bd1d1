"""A worker's prefill/decode role and KV connector on the wire (kvplane/wire/codec.py):
what an agent registers with, what an older agent's registration reads as, and what the
control plane refuses."""

from __future__ import annotations

import pytest

from kvplane.core.keys import SCHEME_VERSION
from kvplane.core.types import WorkerInfo, WorkerRole
from kvplane.wire.codec import (
    MAX_ENGINE_FIELD_CHARS,
    Rejection,
    load_message,
    parse_load,
    parse_register,
    register_message,
)
from kvplane.wire.v1 import control_plane_pb2 as pb
from tests.router.conftest import BLOCK_SIZE, MODEL, worker
from tests.wire.test_codec import LIMITS


def _register(**fields: object) -> pb.Register:
    message = register_message(worker(role=WorkerRole.DECODE, kv_connector="NixlConnector"))
    for name, value in fields.items():
        setattr(message.register, name, value)
    return message.register


@pytest.mark.parametrize("role", list(WorkerRole))
@pytest.mark.parametrize("connector", ["NixlConnector", ""])
def test_a_role_and_connector_survive_the_wire(role: WorkerRole, connector: str) -> None:
    info = worker("pod-3", 9, role=role, kv_connector=connector, labels={"pool": "p"})
    message = register_message(info).register
    assert message.kv_connector == connector
    assert parse_register(message, LIMITS) == info


def test_the_wire_names_each_role() -> None:
    wire = {role: register_message(worker(role=role)).register.role for role in WorkerRole}
    assert wire == {
        WorkerRole.BOTH: pb.WORKER_ROLE_BOTH,
        WorkerRole.PREFILL: pb.WORKER_ROLE_PREFILL,
        WorkerRole.DECODE: pb.WORKER_ROLE_DECODE,
    }


def test_an_older_agents_registration_without_a_role_serves_whole_requests() -> None:
    # What an agent from before roles sends: fields 12 and 13 never set.
    message = pb.Register(
        worker_id="old-agent",
        incarnation=3,
        base_url="http://10.0.0.7:8000",
        model=MODEL,
        block_size=BLOCK_SIZE,
        key_scheme_version=SCHEME_VERSION,
        kv_capacity_blocks=500,
        engine_kind="vllm",
    )
    assert message.role == pb.WORKER_ROLE_UNSPECIFIED
    info = parse_register(message, LIMITS)
    assert isinstance(info, WorkerInfo)
    assert info.role is WorkerRole.BOTH
    assert info.kv_connector == ""
    assert not info.transfers_kv


def test_an_older_agents_bytes_read_as_both() -> None:
    # The same through the bytes: a registration serialised without the role's field.
    old = register_message(worker(kv_connector="")).register
    old.ClearField("role")
    parsed = pb.Register.FromString(old.SerializeToString())
    info = parse_register(parsed, LIMITS)
    assert isinstance(info, WorkerInfo)
    assert info.role is WorkerRole.BOTH


@pytest.mark.parametrize("number", [4, 99, 2**31 - 1])
def test_a_role_number_out_of_range_is_refused(number: int) -> None:
    result = parse_register(_register(role=number), LIMITS)
    assert isinstance(result, Rejection)
    assert result.code == pb.REJECT_CODE_INVALID_MESSAGE
    assert f"role {number}" in result.reason


@pytest.mark.parametrize(
    "connector",
    ["Nixl\nConnector", "\x1b[31mNixl", "Nixl\x00", "N" * (MAX_ENGINE_FIELD_CHARS + 1)],
    ids=["newline", "escape", "nul", "too-long"],
)
def test_a_connector_that_is_no_short_printable_name_is_refused(connector: str) -> None:
    result = parse_register(_register(kv_connector=connector), LIMITS)
    assert isinstance(result, Rejection)
    assert result.code == pb.REJECT_CODE_INVALID_MESSAGE
    assert "kv_connector" in result.reason
    assert connector not in result.reason  # not echoed


def test_the_longest_connector_is_accepted() -> None:
    connector = "C" * MAX_ENGINE_FIELD_CHARS
    info = parse_register(_register(kv_connector=connector), LIMITS)
    assert isinstance(info, WorkerInfo)
    assert info.kv_connector == connector
    assert info.role is WorkerRole.DECODE


def test_the_engines_transfer_failures_ride_the_load_report() -> None:
    message = load_message(1, 2, 0.5, kv_load_failures=7, kv_leases_expired=3).load
    report = parse_load(pb.Load.FromString(message.SerializeToString()))
    assert not isinstance(report, Rejection)
    assert (report.kv_load_failures, report.kv_leases_expired) == (7, 3)
    older = parse_load(pb.Load(running=1, waiting=0, kv_usage=0.1))
    assert not isinstance(older, Rejection)
    assert (older.kv_load_failures, older.kv_leases_expired) == (0, 0)
