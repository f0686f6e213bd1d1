"""Child processes for the live bake-off: started together, waited for together,
charged their CPU, and always stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx2
import psutil


class StartFailed(RuntimeError):
    """A process exited or did not become ready; the message names it and its log."""


@dataclass(slots=True)
class Child:
    name: str
    command: list[str]
    process: subprocess.Popen[bytes]
    log_path: Path

    def cpu_seconds(self) -> float:
        """User and system CPU of the process and every descendant alive now."""
        try:
            root = psutil.Process(self.process.pid)
            members = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0.0
        for member in members:
            with contextlib.suppress(psutil.NoSuchProcess):
                times = member.cpu_times()
                total += times.user + times.system
        return total

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Children:
    """Every process a bake-off cell started; `stop_all` kills them, each with its
    process group (for a router that spawns helpers)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []

    def launch(
        self, name: str, command: Sequence[str], env: Mapping[str, str] | None = None
    ) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                list(command),
                # Marks the process as this cell's, for whoever checks that none is left.
                env={**os.environ, **(env or {}), "KVPLANE_BENCH_LIVE_LOGS": str(self.log_dir)},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        child = Child(name, list(command), process, log_path)
        self.children.append(child)
        return child

    def stop_all(self) -> None:
        for child in self.children:
            _stop_group(child.process)
        self.children.clear()


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    # SIGKILL at once: a cell has read its figures before it stops anything, and a
    # graceful stop costs seconds a cell (smg holds its listener for 5 s on SIGTERM).
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


Ready = Callable[[httpx2.Response], bool]


def answers_200(response: httpx2.Response) -> bool:
    return response.status_code == 200


def wait_ready(
    waits: Iterable[tuple[Child, str]],
    *,
    ready: Ready = answers_200,
    timeout_s: float = 60.0,
) -> None:
    """Wait until each child's URL answers as `ready` wants (200 by default); StartFailed
    if a child exits first or the time runs out (with the end of its log)."""
    pending = list(waits)
    deadline = time.monotonic() + timeout_s
    with httpx2.Client(timeout=1.0) as client:
        while pending:
            child, url = pending[0]
            if child.process.poll() is not None:
                raise StartFailed(
                    f"{child.name} exited with status {child.process.returncode}:\n"
                    f"{child.log_tail()}"
                )
            if _answers(client, url, ready):
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise StartFailed(
                    f"{child.name} was not ready in {timeout_s:.0f} s:\n{child.log_tail()}"
                )
            time.sleep(0.1)


def _answers(client: httpx2.Client, url: str, ready: Ready) -> bool:
    try:
        return ready(client.get(url))
    except httpx2.TransportError:
        return False
