"""A real Envoy (`make envoy-env`) in front of test upstreams, configured by
`router.picker.envoy_config`, for async tests marked `@pytest.mark.heavy("envoy")`.

    async with running_envoy(tmp_path, endpoints=[...], pickers=[...]) as envoy:
        response = await client.post(envoy.url + "/v1/completions", ...)

Envoy runs as an operator runs it on a small machine (`--concurrency 1`), beside other
Envoys (`--disable-hot-restart`, a base id of its own), on free loopback ports; the
context waits until its admin interface says it is ready and stops it on exit. Its log
(`-l warning` unless told otherwise) is in `work_dir`, and quoted when it fails to
start.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvplane.core.serving import free_port
from router.picker.envoy_config import build_bootstrap, render
from tests import heavy

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class RunningEnvoy:
    url: str  # the listener: http://127.0.0.1:PORT
    admin_url: str
    config_file: Path
    log_file: Path
    process: asyncio.subprocess.Process

    async def stats(self, pattern: str) -> dict[str, int]:
        """Envoy's counters and gauges whose name matches the regex `pattern`."""
        async with httpx.AsyncClient(timeout=5.0) as client:
            response = await client.get(self.admin_url + "/stats", params={"filter": pattern})
        response.raise_for_status()
        values: dict[str, int] = {}
        for line in response.text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().isdigit():
                values[name] = int(value)
        return values

    async def hosts(self, cluster: str) -> dict[str, dict[str, str]]:
        """Each host of `cluster` (IP:PORT) -> its admin `/clusters` entries, such as
        `rq_total`, `cx_connect_fail` or `health_flags`."""
        async with httpx.AsyncClient(timeout=5.0) as client:
            response = await client.get(self.admin_url + "/clusters")
        response.raise_for_status()
        hosts: dict[str, dict[str, str]] = {}
        for line in response.text.splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[0] == cluster:
                hosts.setdefault(parts[1], {})[parts[2]] = parts[3]
        return hosts

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")


@asynccontextmanager
async def running_envoy(
    work_dir: Path,
    *,
    endpoints: Sequence[str],
    pickers: Sequence[str],
    log_level: str = "warning",
    extra_args: Sequence[str] = (),
    **options: Any,
) -> AsyncIterator[RunningEnvoy]:
    """Envoy with `build_bootstrap(endpoints=..., pickers=..., **options)` on free ports
    (`listen` and `admin_port` are the helper's)."""
    envoy = heavy.envoy_binary()
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
            str(envoy),
            "-c", str(config_file),
            "--concurrency", "1",
            "--disable-hot-restart",
            "--base-id", str(listen_port),  # unique in this process: free_port never repeats
            "-l", log_level,
            *extra_args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
    running = RunningEnvoy(
        url=f"http://127.0.0.1:{listen_port}",
        admin_url=f"http://127.0.0.1:{admin_port}",
        config_file=config_file,
        log_file=log_file,
        process=process,
    )
    try:
        await _wait_ready(running)
        yield running
    finally:
        await _stop(process)


async def _wait_ready(envoy: RunningEnvoy) -> None:
    """Until `/ready` says LIVE (listeners bound, clusters initialised) and the listener
    accepts connections."""
    deadline = time.monotonic() + START_TIMEOUT_S
    listen_port = int(envoy.url.rsplit(":", 1)[1])
    async with httpx.AsyncClient(timeout=1.0) as client:
        while True:
            if envoy.process.returncode is not None:
                raise RuntimeError(
                    f"envoy exited with status {envoy.process.returncode}:\n{envoy.log()[-4000:]}"
                )
            with contextlib.suppress(httpx.TransportError):
                ready = await client.get(envoy.admin_url + "/ready")
                if ready.status_code == 200 and await _accepts(listen_port):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"envoy was not ready in time:\n{envoy.log()[-4000:]}")
            await asyncio.sleep(0.05)


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
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            process.kill()
    await process.wait()
