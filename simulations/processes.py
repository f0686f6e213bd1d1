"""kvplane commands as child processes, for benchmarks and tests that need a server they
can kill or that must not share the caller's CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import IO

import httpx2


def start_kvplane(
    args: Sequence[str],
    health_url: str | None,
    *,
    env: Mapping[str, str] | None = None,
    start_timeout_s: float = 60.0,
    log: IO[bytes] | None = None,
    module: str = "kvplane.cli",
) -> subprocess.Popen[bytes]:
    """Start `kvplane ARGS...` (with `env` added to the environment) and return once
    `health_url` answers 200 (at once if None); killed if it does not in time. Its log
    goes to `log`, or to this process's stderr. `module` is what `python -m` runs: the
    kvplane command, or a wrapper of it."""
    command = [sys.executable, "-m", module, *args]
    process = subprocess.Popen(
        command,
        env={**os.environ, **(env or {})},
        stdout=log,
        stderr=None if log is None else subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + start_timeout_s
        while health_url is not None and not _answers(health_url):
            if process.poll() is not None:
                raise RuntimeError(f"kvplane {args[0]} exited with status {process.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvplane {args[0]} did not start in time")
            time.sleep(0.05)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process


@contextmanager
def spawn_kvplane(
    args: Sequence[str],
    health_url: str | None,
    *,
    env: Mapping[str, str] | None = None,
    start_timeout_s: float = 60.0,
    log: IO[bytes] | None = None,
    module: str = "kvplane.cli",
) -> Iterator[subprocess.Popen[bytes]]:
    """`start_kvplane`, killed when the block exits."""
    process = start_kvplane(
        args, health_url, env=env, start_timeout_s=start_timeout_s, log=log, module=module
    )
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def _answers(url: str) -> bool:
    try:
        return httpx2.get(url, timeout=1.0).status_code == 200
    except httpx2.TransportError:
        return False
