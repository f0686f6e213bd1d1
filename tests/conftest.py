"""Fixtures every test module may use: real Redis servers (see tests/redis_servers.py);
and the `heavy` marker's enforcement (see tests/heavy.py)."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests import heavy
from tests.redis_servers import redis_cluster, single_redis


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with single_redis(Path(tmp_path_factory.mktemp("redis"))) as url:
        yield url


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_cluster(Path(tmp_path_factory.mktemp("redis-cluster"))) as url:
        yield url


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        heavy.check_marks(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    """Tell tests/heavy.py which test runs, through its fixtures' set-up and teardown."""
    heavy.running = item
    try:
        return (yield)
    finally:
        heavy.running = None
