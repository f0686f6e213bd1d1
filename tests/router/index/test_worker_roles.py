"""A worker's prefill/decode role and KV connector are kept with its registration, on
every backend (memory, Redis, Cluster); and what Redis reads back from a registration
written by another router."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvplane.core.types import WorkerInfo, WorkerRole
from router.index.base import WorkerState
from router.index.redis import _info_fields, _info_to_json
from tests.router.index.conftest import IndexFactory

LEASE = 30.0


def info(worker_id: str, role: WorkerRole, kv_connector: str) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        incarnation=1,
        base_url=f"http://{worker_id}.local:8000",
        model="tiny",
        block_size=16,
        kv_capacity_blocks=1000,
        engine_kind="vllm",
        labels={"zone": "a"},
        role=role,
        kv_connector=kv_connector,
    )


async def test_a_decode_workers_role_and_connector_are_reported(make_index: IndexFactory):
    index = await make_index()
    decode = info("d", WorkerRole.DECODE, "NixlConnector")
    await index.register(decode, LEASE)

    (status,) = await index.workers()
    assert status.info == decode
    assert status.info.role is WorkerRole.DECODE
    assert status.info.kv_connector == "NixlConnector"
    assert status.state is WorkerState.LIVE


async def test_each_workers_own_role_is_reported(make_index: IndexFactory):
    index = await make_index()
    registered = [
        info("p", WorkerRole.PREFILL, "NixlConnector"),
        info("d", WorkerRole.DECODE, "NixlConnector"),
        info("w", WorkerRole.BOTH, ""),
    ]
    for worker in registered:
        await index.register(worker, LEASE)

    by_id = {status.info.worker_id: status.info for status in await index.workers()}
    assert by_id == {worker.worker_id: worker for worker in registered}


async def test_registering_again_with_a_new_role_replaces_the_old(make_index: IndexFactory):
    index = await make_index()
    await index.register(info("a", WorkerRole.BOTH, ""), LEASE)
    changed = dataclasses.replace(info("a", WorkerRole.PREFILL, "NixlConnector"), incarnation=2)
    await index.register(changed, LEASE)

    (status,) = await index.workers()
    assert (status.info.role, status.info.kv_connector) == (WorkerRole.PREFILL, "NixlConnector")


# -- Redis: the stored form --------------------------------------------------------------


def _stored(worker: WorkerInfo, **changes: object) -> bytes:
    fields = json.loads(_info_to_json(worker))
    fields.update(changes)
    return json.dumps(fields).encode()


def test_the_role_is_stored_as_its_value() -> None:
    stored = json.loads(_info_to_json(info("d", WorkerRole.DECODE, "NixlConnector")))
    assert stored["role"] == "decode"
    assert stored["kv_connector"] == "NixlConnector"


@pytest.mark.parametrize("role", list(WorkerRole))
def test_a_stored_role_reads_back_as_itself(role: WorkerRole) -> None:
    worker = info("w", role, "NixlConnector")
    fields = _info_fields(_info_to_json(worker).encode())
    assert fields["role"] is role
    assert WorkerInfo(worker_id="w", incarnation=1, **fields) == worker


@pytest.mark.parametrize("stored_role", ["prefill_and_decode", "DECODE", "", 3, None])
def test_a_stored_role_this_router_does_not_know_reads_as_both(stored_role: object) -> None:
    # Written by a newer router sharing the index, during a rolling upgrade.
    stored = _stored(info("w", WorkerRole.DECODE, "NixlConnector"), role=stored_role)
    fields = _info_fields(stored)
    assert fields["role"] is WorkerRole.BOTH
    assert fields["kv_connector"] == "NixlConnector"


def test_a_registration_stored_before_roles_reads_as_both_without_a_connector() -> None:
    fields = json.loads(_info_to_json(info("w", WorkerRole.BOTH, "")))
    del fields["role"], fields["kv_connector"]
    read = WorkerInfo(worker_id="w", incarnation=1, **_info_fields(json.dumps(fields).encode()))
    assert read.role is WorkerRole.BOTH
    assert read.kv_connector == ""
