"""Real Redis servers for the tests: found, or started on free loopback ports.

Resolution for a single server: KVPLANE_TEST_REDIS_URL, else a server answering on
127.0.0.1:6379, else a throwaway `redis-server` from PATH. A cluster is always started
by the tests (three masters), unless KVPLANE_TEST_REDIS_CLUSTER_URL names one. Without
a way to get either, the tests fail with instructions; they never skip.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from kvplane.core.serving import free_port

INSTALL_HINT = (
    "Redis is needed for these tests: set KVPLANE_TEST_REDIS_URL, run a server on "
    "127.0.0.1:6379, or install redis-server and redis-cli (Debian/Ubuntu: "
    "`apt-get install -y redis-server`)."
)


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


def _answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not on PATH. {INSTALL_HINT}")
    return path


def _start_server(directory: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    directory.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [
            _binary("redis-server"),
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
    while not _answers(f"redis://127.0.0.1:{port}/0"):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"redis-server on port {port} did not start. {INSTALL_HINT}")
        time.sleep(0.05)
    return process


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()


@contextmanager
def single_redis(workdir: Path) -> Iterator[str]:
    url = os.environ.get("KVPLANE_TEST_REDIS_URL")
    if url:
        if not _answers(url):
            raise RuntimeError(f"KVPLANE_TEST_REDIS_URL={url} does not answer PING")
        yield url
        return
    default = "redis://127.0.0.1:6379/0"
    if _answers(default):
        yield default
        return
    port = free_port()
    process = _start_server(workdir / "redis-single", port)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop([process])


class StoppableRedis:
    """A private redis-server that a test may stop (never a shared one)."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    def stop(self) -> None:
        _stop([self.process])


@contextmanager
def stoppable_redis(workdir: Path) -> Iterator[tuple[str, StoppableRedis]]:
    port = free_port()
    server = StoppableRedis(_start_server(workdir / "redis-stoppable", port))
    try:
        yield f"redis://127.0.0.1:{port}/0", server
    finally:
        server.stop()


@contextmanager
def redis_cluster(workdir: Path, masters: int = 3) -> Iterator[str]:
    url = os.environ.get("KVPLANE_TEST_REDIS_CLUSTER_URL")
    if url:
        yield url
        return
    ports: list[int] = []
    while len(ports) < masters:
        port = free_cluster_port()
        if port not in ports:
            ports.append(port)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for port in ports:
            cluster_flags = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            cluster_flags += ["--cluster-node-timeout", "5000"]
            processes.append(_start_server(workdir / f"redis-cluster-{port}", port, *cluster_flags))
        subprocess.run(
            [_binary("redis-cli"), "--cluster", "create"]
            + [f"127.0.0.1:{port}" for port in ports]
            + ["--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        _wait_cluster_ok(ports)
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        _stop(processes)


def _wait_cluster_ok(ports: list[int]) -> None:
    deadline = time.monotonic() + 30
    while True:
        states = []
        for port in ports:
            client = redis.Redis(port=port, socket_timeout=1)
            try:
                info = client.execute_command("CLUSTER", "INFO")
            finally:
                client.close()
            text = info.decode() if isinstance(info, bytes) else str(info)
            states.append("cluster_state:ok" in text)
        if all(states):
            return
        if time.monotonic() > deadline:
            raise RuntimeError("the test Redis Cluster did not reach cluster_state:ok")
        time.sleep(0.2)
