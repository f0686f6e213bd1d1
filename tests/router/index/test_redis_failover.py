"""A real Redis Cluster failover under the Redis index: replication is asynchronous, so a
replica promoted in its master's place may lack the last writes the master
acknowledged. The index must say so (SequenceMismatch) rather than serve the older
picture as the worker's."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from router.index.base import IndexUnavailable, SequenceMismatch
from router.index.redis import KeyLayout, RedisLocationIndex
from simulations.redis_servers import ClusterNode, redis_cluster
from tests.router.index.test_conformance import chain, info, stored

PREFIX = "kvptest-failover"
NODE_TIMEOUT_MS = 1000  # fail over within a few seconds


def _replicated(master: ClusterNode) -> bool:
    """Whether one replica has every write the master acknowledged so far."""
    client = redis.Redis(port=master.port, socket_timeout=5)
    try:
        return int(cast(Any, client).execute_command("WAIT", 1, 3000)) >= 1
    finally:
        client.close()


def _cut_replicas(master: ClusterNode) -> None:
    client = redis.Redis(port=master.port, socket_timeout=5)
    try:
        cast(Any, client).execute_command("CLIENT", "KILL", "TYPE", "replica")
    finally:
        client.close()


async def _promoted(node: ClusterNode, timeout_s: float = 30.0) -> float:
    """Seconds until `node` serves as a master."""
    started = time.monotonic()
    while node.info("replication").get("role") != "master":
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"the replica on port {node.port} was not promoted")
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def test_a_failover_that_lost_writes_makes_the_worker_resync(tmp_path: Path) -> None:
    with redis_cluster(tmp_path, masters=3, replicas=1, node_timeout_ms=NODE_TIMEOUT_MS) as cluster:
        index = RedisLocationIndex.from_url(cluster.url, cluster=True, prefix=PREFIX)
        try:
            prompt = chain(70, 8)
            await index.register(info("w"), 60.0)
            await index.apply("w", 1, [stored(prompt[:4])], sequence=1)
            master = cluster.master_of(KeyLayout(PREFIX).worker("w"))
            (replica,) = cluster.replicas_of(master)
            assert _replicated(master)

            # The replica stops (its link cut, so that nothing waits for it in its
            # socket), the master acknowledges one more batch, and dies before the
            # replica sees it.
            replica.process.send_signal(signal.SIGSTOP)
            try:
                _cut_replicas(master)
                await index.apply("w", 1, [stored(prompt[4:], first_position=4)], sequence=2)
                assert (await index.lookup(prompt))["w"].blocks == 8
                master.process.kill()
                master.process.wait()
            finally:
                replica.process.send_signal(signal.SIGCONT)
            await _promoted(replica)

            async def renewal() -> None:
                while True:
                    try:
                        await index.renew("w", 1, 60.0, applied=2)
                        return
                    except IndexUnavailable:  # the cluster still settling
                        await asyncio.sleep(0.2)

            with pytest.raises(SequenceMismatch) as told:
                await asyncio.wait_for(renewal(), 30)
            assert (told.value.expected, told.value.recorded) == (2, 1)
            with pytest.raises(SequenceMismatch):
                await index.apply("w", 1, [], sequence=3)
            # What the promoted replica holds is the older picture, and it says so: a
            # reconnecting agent resumes after 1, which its own count (2) refuses.
            assert (await index.lookup(prompt))["w"].blocks == 4
            assert await index.register(info("w"), 60.0) == 1
        finally:
            await index.close()
