"""Throwaway Redis servers on free loopback ports, for the tests and the benchmarks: one
server, or a Redis Cluster of masters (each with its replicas) that a caller may break
by killing a master."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import redis
from redis.crc import key_slot

INSTALL_HINT = (
    "Install redis-server and redis-cli (Debian/Ubuntu: `apt-get install -y redis-server`)."
)
NODE_TIMEOUT_MS = 5000  # a master unreachable this long is failed over to a replica


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    for candidate in random.sample(range(20000, 55000), 200):
        if _bindable(candidate) and _bindable(candidate + 10000):
            return candidate
    raise RuntimeError("no free port pair for a Redis Cluster node")


def answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not on PATH. {INSTALL_HINT}")
    return path


def start_server(directory: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    """A redis-server on 127.0.0.1:`port`, persisting nothing, once it answers."""
    directory.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [
            binary("redis-server"),
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(directory),
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not answers(f"redis://127.0.0.1:{port}/0"):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"redis-server on port {port} did not start. {INSTALL_HINT}")
        time.sleep(0.05)
    return process


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()


@dataclass(frozen=True, slots=True)
class ClusterNode:
    port: int
    process: subprocess.Popen[bytes]

    def info(self, section: str) -> dict[str, str]:
        """`INFO section` (or `CLUSTER INFO` for "cluster") as text fields."""
        client = redis.Redis(port=self.port, socket_timeout=2)
        try:
            if section == "cluster":
                # redis-py's non-cluster client leaves this command untyped.
                raw = cast(Any, client).execute_command("CLUSTER", "INFO")
                text = raw.decode() if isinstance(raw, bytes) else str(raw)
                return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
            return {key: str(value) for key, value in client.info(section).items()}
        finally:
            client.close()

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def serves(self, slot: int) -> bool:
        """Whether this node serves `slot` as a master now (by its own `CLUSTER NODES`)."""
        client = redis.Redis(port=self.port, socket_timeout=2)
        try:
            raw = cast(Any, client).execute_command("CLUSTER", "NODES")
        finally:
            client.close()
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        for line in text.splitlines():
            fields = line.split()
            if len(fields) > 2 and "myself" in fields[2].split(","):
                for entry in fields[8:]:
                    if entry.startswith("["):  # a slot being migrated: not served yet
                        continue
                    first, _, last = entry.partition("-")
                    if int(first) <= slot <= int(last or first):
                        return True
        return False


@dataclass(frozen=True, slots=True)
class RunningCluster:
    url: str  # a seed node's
    nodes: tuple[ClusterNode, ...]

    def masters(self) -> list[ClusterNode]:
        """The live nodes that serve slots now (a replica promoted by a failover too)."""
        return [node for node in self.nodes if node.alive and _role(node) == "master"]

    def live_url(self) -> str:
        """A live master's URL: the seed's may be a master a fault killed."""
        return f"redis://127.0.0.1:{self.masters()[0].port}/0"

    def master_of(self, key: bytes) -> ClusterNode:
        """The live master that serves `key`'s slot now."""
        slot = key_slot(key)
        for node in self.masters():
            if node.serves(slot):
                return node
        raise RuntimeError(f"no live master serves slot {slot}")

    def replicas_of(self, master: ClusterNode) -> list[ClusterNode]:
        """The live replicas of `master`."""
        return [
            node
            for node in self.nodes
            if node.alive
            and node is not master
            and node.info("replication").get("master_port") == str(master.port)
        ]

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says cluster_state:ok."""
        deadline = time.monotonic() + timeout_s
        while not all(
            node.info("cluster").get("cluster_state") == "ok" for node in self.nodes if node.alive
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.2)


def _role(node: ClusterNode) -> str:
    try:
        return node.info("replication").get("role", "")
    except redis.RedisError:
        return ""


@contextmanager
def redis_cluster(
    workdir: Path, masters: int = 3, replicas: int = 0, node_timeout_ms: int = NODE_TIMEOUT_MS
) -> Iterator[RunningCluster]:
    """A cluster of `masters`, each with `replicas` replicas, on free ports, failing a
    master over after `node_timeout_ms`; stopped on exit."""
    ports: list[int] = []
    while len(ports) < masters * (1 + replicas):
        port = free_cluster_port()
        if port not in ports:
            ports.append(port)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for port in ports:
            flags = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            flags += ["--cluster-node-timeout", str(node_timeout_ms)]
            processes.append(start_server(workdir / f"redis-cluster-{port}", port, *flags))
        subprocess.run(
            [binary("redis-cli"), "--cluster", "create"]
            + [f"127.0.0.1:{port}" for port in ports]
            + ["--cluster-replicas", str(replicas), "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        cluster = RunningCluster(
            f"redis://127.0.0.1:{ports[0]}/0",
            tuple(
                ClusterNode(port, process) for port, process in zip(ports, processes, strict=True)
            ),
        )
        cluster.wait_ok()
        if replicas:
            _wait_replicas_linked(cluster, masters * replicas)
        yield cluster
    finally:
        stop(processes)


def _wait_replicas_linked(cluster: RunningCluster, count: int, timeout_s: float = 30.0) -> None:
    """Until `count` replicas have synced with their masters (before that, a master's
    death would leave its slots without a replica to take them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        linked = 0
        for node in cluster.nodes:
            info = node.info("replication")
            if info.get("role") == "slave" and info.get("master_link_status") == "up":
                linked += 1
        if linked >= count:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{linked} of {count} Redis Cluster replicas synced")
        time.sleep(0.2)
