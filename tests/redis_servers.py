"""Real Redis servers for the tests: found, or started on free loopback ports.

Resolution for a single server: KVPLANE_TEST_REDIS_URL, else a server answering on
127.0.0.1:6379, else a throwaway `redis-server` from PATH. A cluster is always started
by the tests (three masters), unless KVPLANE_TEST_REDIS_CLUSTER_URL names one. Without
a way to get either, the tests fail with instructions; they never skip.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvplane.core.serving import free_port
from simulations import redis_servers
from simulations.redis_servers import answers, start_server, stop


@contextmanager
def single_redis(workdir: Path) -> Iterator[str]:
    url = os.environ.get("KVPLANE_TEST_REDIS_URL")
    if url:
        if not answers(url):
            raise RuntimeError(f"KVPLANE_TEST_REDIS_URL={url} does not answer PING")
        yield url
        return
    default = "redis://127.0.0.1:6379/0"
    if answers(default):
        yield default
        return
    port = free_port()
    process = start_server(workdir / "redis-single", port)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop([process])


class StoppableRedis:
    """A private redis-server that a test may stop (never a shared one)."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    def stop(self) -> None:
        stop([self.process])


@contextmanager
def stoppable_redis(workdir: Path) -> Iterator[tuple[str, StoppableRedis]]:
    port = free_port()
    server = StoppableRedis(start_server(workdir / "redis-stoppable", port))
    try:
        yield f"redis://127.0.0.1:{port}/0", server
    finally:
        server.stop()


@contextmanager
def redis_cluster(workdir: Path) -> Iterator[str]:
    url = os.environ.get("KVPLANE_TEST_REDIS_CLUSTER_URL")
    if url:
        yield url
        return
    with redis_servers.redis_cluster(workdir, masters=3) as cluster:
        yield cluster.url
