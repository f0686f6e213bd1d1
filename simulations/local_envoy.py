"""A real Envoy in front of a local fleet, for `kvplane demo --route envoy` and the
tests behind Envoy (tests/picker/envoy.py).

Envoy runs the bootstrap `kvplane envoy-config` writes (`router.picker.envoy_config`,
nothing changed), with kvplane's endpoint picker as its ext_proc service, on free
loopback ports, as an operator runs it on a small machine: `--concurrency 1`,
`--disable-hot-restart`, a base id of its own. Its config and its log live in the
caller's (temporary) directory; the context waits until the admin interface says it is
ready, the listener accepts and the picker passes Envoy's health check, and stops Envoy
when it exits. Which worker served each request is Envoy's to say: its per-host
request counts (`/clusters`), since an answer through Envoy comes straight from the
engine, without the proxy's `x-kvplane-worker`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2

from kvplane.core.serving import free_port
from router.picker.envoy_config import PICKER_CLUSTER, WORKERS_CLUSTER, build_bootstrap, render

ENVOY_ENV = Path(__file__).resolve().parents[1] / ".envoy-venv" / "bin" / "envoy"
"""Where `make envoy-env` puts Envoy (in a source checkout)."""

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def envoy_command(binary: Path, config_file: Path, base_id: int, log_level: str) -> list[str]:
    """Envoy as an operator runs it on a small machine: one worker thread (a second
    only slowed it on two cores), beside other Envoys (no hot restart, a base id of its
    own)."""
    return [
        str(binary), "-c", str(config_file),
        "--concurrency", "1",
        "--disable-hot-restart",
        "--base-id", str(base_id),
        "-l", log_level,
    ]  # fmt: skip


class EnvoyMissing(Exception):
    """No Envoy binary to run; the message says where it looked and what to do."""


def find_envoy(explicit: Path | None = None) -> Path:
    """`explicit` if given, else `make envoy-env`'s Envoy, else `envoy` on the PATH;
    EnvoyMissing when none of those is an executable file."""
    if explicit is not None:
        candidates = [explicit]
    else:
        on_path = shutil.which("envoy")
        candidates = [ENVOY_ENV, *([Path(on_path)] if on_path else [])]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    looked = ", ".join(str(candidate) for candidate in candidates)
    where = looked if explicit is not None else f"{looked} or on the PATH"
    raise EnvoyMissing(
        f"no Envoy at {where}: run `make envoy-env` (Envoy 1.40 in .envoy-venv), "
        "or name one with --envoy PATH"
    )


@dataclass(frozen=True, slots=True)
class LocalEnvoy:
    url: str  # the listener: http://127.0.0.1:PORT
    admin_url: str
    config_file: Path
    log_file: Path
    process: asyncio.subprocess.Process

    async def upstream_requests(self) -> dict[str, int]:
        """Each worker endpoint (IP:PORT) -> the requests Envoy sent it (retries
        included), from the admin `/clusters`."""
        hosts = await self.hosts(WORKERS_CLUSTER)
        return {host: int(entries["rq_total"]) for host, entries in hosts.items() if ":" in host}

    async def hosts(self, cluster: str) -> dict[str, dict[str, str]]:
        """The admin `/clusters` entries of `cluster`, by their second field: each host
        (IP:PORT) -> its entries, such as `rq_total` or `health_flags`, beside the
        cluster's own settings (`default_priority`, `outlier`, ...)."""
        async with httpx2.AsyncClient(timeout=5.0) as client:
            response = await client.get(self.admin_url + "/clusters")
        response.raise_for_status()
        hosts: dict[str, dict[str, str]] = {}
        for line in response.text.splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[0] == cluster:
                hosts.setdefault(parts[1], {})[parts[2]] = parts[3]
        return hosts

    async def stats(self, pattern: str) -> dict[str, int]:
        """Envoy's counters and gauges whose name matches the regex `pattern`."""
        async with httpx2.AsyncClient(timeout=5.0) as client:
            response = await client.get(self.admin_url + "/stats", params={"filter": pattern})
        response.raise_for_status()
        values: dict[str, int] = {}
        for line in response.text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().isdigit():
                values[name] = int(value)
        return values

    def log_tail(self, characters: int = 4000) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-characters:]
        except OSError:
            return ""


@contextlib.asynccontextmanager
async def local_envoy(
    binary: Path,
    work_dir: Path,
    *,
    endpoints: Sequence[str],
    pickers: Sequence[str],
    wait_for_pickers: bool = True,
    log_level: str = "warning",
    **options: Any,
) -> AsyncIterator[LocalEnvoy]:
    """Envoy in front of `endpoints` (IP:PORT), asking `pickers` (HOST:PORT), with
    `build_bootstrap`'s other `options`; ready once its pickers pass its health checks
    too, unless `wait_for_pickers` is False (a test of dead pickers)."""
    listen_port, admin_port = free_port(), free_port()
    bootstrap = build_bootstrap(
        listen=f"127.0.0.1:{listen_port}",
        admin_port=admin_port,
        endpoints=endpoints,
        pickers=pickers,
        **options,
    )
    config_file = work_dir / f"envoy-{listen_port}.json"
    config_file.write_text(render(bootstrap))
    log_file = work_dir / f"envoy-{listen_port}.log"
    with log_file.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            *envoy_command(binary, config_file, listen_port, log_level),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
        )
    envoy = LocalEnvoy(
        url=f"http://127.0.0.1:{listen_port}",
        admin_url=f"http://127.0.0.1:{admin_port}",
        config_file=config_file,
        log_file=log_file,
        process=process,
    )
    try:
        await _wait_ready(envoy, listen_port, wait_for_pickers)
        yield envoy
    finally:
        await _stop(process)


async def _wait_ready(envoy: LocalEnvoy, listen_port: int, wait_for_pickers: bool) -> None:
    """Until `/ready` says LIVE, the listener accepts and (`wait_for_pickers`) every
    picker is healthy in Envoy's eyes (before that, Envoy answers requests with a 500)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    async with httpx2.AsyncClient(timeout=1.0) as client:
        while True:
            if envoy.process.returncode is not None:
                raise RuntimeError(
                    f"envoy exited with status {envoy.process.returncode}:\n{envoy.log_tail()}"
                )
            with contextlib.suppress(httpx2.TransportError):
                ready = await client.get(envoy.admin_url + "/ready")
                if (
                    ready.status_code == 200
                    and (not wait_for_pickers or await _pickers_healthy(envoy))
                    and await _accepts(listen_port)
                ):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"envoy was not ready in {START_TIMEOUT_S:.0f} s:\n{envoy.log_tail()}"
                )
            await asyncio.sleep(0.05)


async def _pickers_healthy(envoy: LocalEnvoy) -> bool:
    flags = [
        entries.get("health_flags")
        for host, entries in (await envoy.hosts(PICKER_CLUSTER)).items()
        if ":" in host
    ]
    return bool(flags) and all(flag == "healthy" for flag in flags)


async def _accepts(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def _stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
    await process.wait()
