"""`kvplane engine-sim` as a child process, for benchmarks, demos and fault tests that
need a simulator they can kill."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass

import httpx


@dataclass(frozen=True, slots=True)
class SimulatorProcess:
    process: subprocess.Popen[bytes]
    base_url: str


def free_port(host: str = "127.0.0.1") -> int:
    with closing(socket.create_server((host, 0))) as probe:
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def spawn_engine_sim(*flags: str, start_timeout_s: float = 60.0) -> Iterator[SimulatorProcess]:
    """Start a simulator on a free port and wait until `/health` answers; killed on exit.
    Its log goes to this process's stderr."""
    port = free_port()
    command = [sys.executable, "-m", "kvplane.cli", "engine-sim", "--port", str(port), *flags]
    process = subprocess.Popen(command)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while not _healthy(base_url):
            if process.poll() is not None:
                raise RuntimeError(f"the engine simulator exited with status {process.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError("the engine simulator did not start in time")
            time.sleep(0.05)
        yield SimulatorProcess(process, base_url)
    finally:
        process.kill()
        process.wait()


def _healthy(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/health", timeout=1.0).status_code == 200
    except httpx.TransportError:
        return False
