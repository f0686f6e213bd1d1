"""`kvplane engine-sim` as a child process, for benchmarks, demos and fault tests that
need a simulator they can kill."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

_SERVING = re.compile(r"engine simulator serving .* on (\S+):(\d+) ")


@dataclass(frozen=True, slots=True)
class SimulatorProcess:
    process: subprocess.Popen[str]
    base_url: str


@contextmanager
def spawn_engine_sim(*flags: str, start_timeout_s: float = 60.0) -> Iterator[SimulatorProcess]:
    """Start a simulator on a free port (unless `flags` name one) and wait until it
    serves; killed on exit. Its log is read (and dropped) so it never blocks on a pipe."""
    command = [sys.executable, "-m", "kvplane.cli", "engine-sim", "--port", "0", *flags]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        deadline = time.monotonic() + start_timeout_s
        for line in process.stderr:
            found = _SERVING.search(line)
            if found:
                threading.Thread(target=process.stderr.read, daemon=True).start()
                yield SimulatorProcess(process, f"http://{found.group(1)}:{found.group(2)}")
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the engine simulator did not start in time")
        raise RuntimeError(f"the engine simulator exited with status {process.wait()}")
    finally:
        process.kill()
        process.wait()
