"""kvplane commands as child processes, for benchmarks and tests that need a server they
can kill or that must not share the caller's CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import httpx2


@contextmanager
def spawn_kvplane(
    args: Sequence[str],
    health_url: str | None,
    *,
    env: Mapping[str, str] | None = None,
    start_timeout_s: float = 60.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run `kvplane ARGS...` (with `env` added to the environment) until the block exits,
    then kill it; returns once `health_url` answers 200 (at once if None). Its log goes
    to this process's stderr."""
    command = [sys.executable, "-m", "kvplane.cli", *args]
    process = subprocess.Popen(command, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + start_timeout_s
        while health_url is not None and not _answers(health_url):
            if process.poll() is not None:
                raise RuntimeError(f"kvplane {args[0]} exited with status {process.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvplane {args[0]} did not start in time")
            time.sleep(0.05)
        yield process
    finally:
        process.kill()
        process.wait()


def _answers(url: str) -> bool:
    try:
        return httpx2.get(url, timeout=1.0).status_code == 200
    except httpx2.TransportError:
        return False
