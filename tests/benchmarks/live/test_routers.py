"""A two-replica cell's kvplane routers share an index in a Redis of the cell's own:
the machine's Redis is never written to nor flushed, and the server goes with the cell."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from benchmarks.live.processes import Children
from benchmarks.live.routers import own_redis


def test_a_cells_redis_is_its_own_and_goes_with_the_cell(tmp_path: Path) -> None:
    children = Children(tmp_path)
    try:
        url = own_redis(children)
        assert not url.startswith("redis://127.0.0.1:6379/")
        client = redis.Redis.from_url(url)
        try:
            client.set("written", "here")
            assert client.get("written") == b"here"
        finally:
            client.close()
    finally:
        children.stop_all()
    gone = redis.Redis.from_url(url, socket_connect_timeout=1.0)
    try:
        with pytest.raises(redis.ConnectionError):
            gone.ping()
    finally:
        gone.close()
