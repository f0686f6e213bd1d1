"""`kvplane engine-sim` as a child process, for benchmarks, demos and fault tests that
need a simulator they can kill."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvplane.core.serving import free_port
from simulations.processes import spawn_kvplane


@dataclass(frozen=True, slots=True)
class SimulatorProcess:
    process: subprocess.Popen[bytes]
    base_url: str


@contextmanager
def spawn_engine_sim(*flags: str, start_timeout_s: float = 60.0) -> Iterator[SimulatorProcess]:
    """Start a simulator on a free port and wait until `/health` answers; killed on exit."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    args = ["engine-sim", "--port", str(port), *flags]
    with spawn_kvplane(args, base_url + "/health", start_timeout_s=start_timeout_s) as process:
        yield SimulatorProcess(process, base_url)
