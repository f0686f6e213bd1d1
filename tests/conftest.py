"""Fixtures every test module may use: real Redis servers (see tests/redis_servers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_servers import redis_cluster, single_redis


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with single_redis(Path(tmp_path_factory.mktemp("redis"))) as url:
        yield url


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_cluster(Path(tmp_path_factory.mktemp("redis-cluster"))) as url:
        yield url
