"""The fleet under test, as real processes on loopback: a Redis server, engine
simulators with an agent beside each, two router replicas sharing the Redis index, and
a TCP proxy on every agent-to-router path. Each router serves the gateway's endpoint
picker too.

Every process keeps its ports across restarts, as a pod keeps its address, so a
scenario can SIGKILL any of them and start it again. Logs go to `<work_dir>/logs/`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import redis

from chaos.tcp_proxy import TcpProxy
from kvplane.core.serving import free_port
from router.tenants import api_key_digest
from simulations.processes import start_kvplane
from worker_agent.engines.base import metric_samples, total

MODEL = "kvplane-tiny"
ADMIN_TOKEN = "chaos-admin"
SALT_SECRET = "chaos-salt-secret"
TENANT_KEYS = {"acme": "sk-chaos-acme", "globex": "sk-chaos-globex", "initech": "sk-chaos-ini"}
REDIS_PREFIX = "chaos"
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@dataclass(frozen=True, slots=True)
class StackShape:
    """Sizes and timings; small caches so that eviction happens within a scenario."""

    engines: int = 3
    block_size: int = 16
    engine_blocks: int = 160
    lease_s: float = 2.0
    load_interval_s: float = 0.25
    first_byte_timeout_s: float = 3.0
    idle_timeout_s: float = 3.0


class Child:
    """One restartable kvplane process."""

    def __init__(self, name: str, log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    async def start(
        self, args: list[str], health_url: str | None, env: dict[str, str] | None = None
    ) -> None:
        with self.log_path.open("ab") as log:
            self.process = await asyncio.to_thread(
                start_kvplane, args, health_url, env=env, start_timeout_s=60.0, log=log
            )

    def kill(self) -> None:
        """SIGKILL: no goodbye, as when a machine or a container goes."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()


class RedisServer:
    """A private, memory-only Redis; stopping it loses everything, as a restart would."""

    def __init__(self, work_dir: Path, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = work_dir / "redis"
        self._log = log_dir / "redis.log"
        self.process: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH (apt-get install -y redis-server)")
        self._dir.mkdir(parents=True, exist_ok=True)
        with self._log.open("ab") as log:
            self.process = subprocess.Popen(  # noqa: ASYNC220 - returns at once
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self._dir)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 10
        while not await asyncio.to_thread(self._answers):
            if time.monotonic() > deadline:
                raise TimeoutError("redis-server did not start")
            await asyncio.sleep(0.05)

    def _answers(self) -> bool:
        client = redis.Redis.from_url(self.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()


@dataclass
class Router:
    child: Child
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    picker_port: int = field(default_factory=free_port)  # the gateway's endpoint picker

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def picker_address(self) -> str:
        return f"127.0.0.1:{self.picker_port}"


@dataclass
class Worker:
    """An engine simulator and the agent beside it, with the agent's paths to the
    routers (one TCP proxy per router)."""

    worker_id: str
    engine: Child
    agent: Child
    proxies: list[TcpProxy]
    http_port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


class ChaosStack:
    def __init__(self, work_dir: Path, shape: StackShape = StackShape()) -> None:
        self.shape = shape
        self.work_dir = work_dir
        self.log_dir = work_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis = RedisServer(work_dir, self.log_dir)
        self.routers = [Router(Child(f"router-{n}", self.log_dir)) for n in (1, 2)]
        self.workers: list[Worker] = []
        self._config = work_dir / "router.toml"
        self.http = httpx2.AsyncClient(timeout=10)

    # -- starting and stopping ------------------------------------------------------

    async def start(self) -> None:
        await self.redis.start()
        self._write_router_config()
        await asyncio.gather(*(self.start_router(router) for router in self.routers))
        for n in range(1, self.shape.engines + 1):
            proxies = [TcpProxy("127.0.0.1", router.grpc_port) for router in self.routers]
            for proxy in proxies:
                await proxy.start()
            worker_id = f"sim-{n}"
            self.workers.append(
                Worker(
                    worker_id,
                    Child(f"engine-{worker_id}", self.log_dir),
                    Child(f"agent-{worker_id}", self.log_dir),
                    proxies,
                )
            )
        await asyncio.gather(*(self.start_engine(worker) for worker in self.workers))
        await asyncio.gather(*(self.start_agent(worker) for worker in self.workers))
        await self.wait_for("every router sees every worker live", self.all_live, timeout_s=60)

    async def stop(self) -> None:
        for worker in self.workers:
            worker.agent.kill()
            worker.engine.kill()
            for proxy in worker.proxies:
                await proxy.close()
        for router in self.routers:
            router.child.kill()
        self.redis.kill()
        await self.http.aclose()

    async def start_router(self, router: Router) -> None:
        args = ["router", "--config", str(self._config), "--http-port", str(router.http_port),
                "--grpc-port", str(router.grpc_port), "--picker-port", str(router.picker_port),
                "--log-level", "WARNING"]  # fmt: skip
        env = {"KVPLANE_HTTP__ADMIN_TOKEN": ADMIN_TOKEN}
        await router.child.start(args, router.url + "/readyz", env)

    async def start_engine(self, worker: Worker) -> None:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # vLLM's rule: a `*` endpoint binds, a host name connects.
            "endpoint": f"tcp://*:{worker.events_port}",
            "replay_endpoint": f"tcp://*:{worker.replay_port}",
        }
        args = ["engine-sim", "--port", str(worker.http_port),
                "--block-size", str(self.shape.block_size),
                "--num-gpu-blocks-override", str(self.shape.engine_blocks),
                "--max-model-len", "4096", "--enable-prompt-tokens-details",
                "--kv-events-config", json.dumps(events),
                "--log-level", "WARNING"]  # fmt: skip
        await worker.engine.start(args, worker.engine_url + "/health")

    async def start_agent(self, worker: Worker) -> None:
        addresses = ",".join(proxy.address for proxy in worker.proxies)
        args = ["agent", "--worker-id", worker.worker_id, "--engine", "vllm",
                "--engine-url", worker.engine_url,
                "--kv-events-endpoint", f"tcp://127.0.0.1:{worker.events_port}",
                "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{worker.replay_port}",
                "--control-plane-address", addresses,
                "--block-size", str(self.shape.block_size),
                "--load-interval-s", str(self.shape.load_interval_s),
                "--reconnect-max-s", "1", "--log-level", "WARNING"]  # fmt: skip
        await worker.agent.start(args, None)

    def _write_router_config(self) -> None:
        shape = self.shape
        tenants = "".join(
            f'[[tenants.tenants]]\nname = "{name}"\napi_key_sha256 = ["{api_key_digest(key)}"]\n'
            for name, key in TENANT_KEYS.items()
        )
        self._config.write_text(
            f'[index]\nbackend = "redis"\nredis_url = "{self.redis.url}"\n'
            f'redis_prefix = "{REDIS_PREFIX}"\n'
            f"[control_plane]\nblock_size = {shape.block_size}\nlease_s = {shape.lease_s}\n"
            f"[proxy]\nfirst_byte_timeout_s = {shape.first_byte_timeout_s}\n"
            f"idle_timeout_s = {shape.idle_timeout_s}\nconnect_timeout_s = 1.0\n"
            f"unreachable_backoff_s = 1.0\n"
            f'[tenants]\ncache_salt_secret = "{SALT_SECRET}"\n{tenants}'
        )

    # -- what the fleet says --------------------------------------------------------

    async def fleet_workers(self, router: Router | None = None) -> dict[str, dict[str, Any]]:
        """The registry as a live router sees it (the first live one by default)."""
        for candidate in [router] if router is not None else self.routers:
            if not candidate.child.running:
                continue
            with contextlib.suppress(httpx2.HTTPError):
                answer = await self.http.get(
                    candidate.url + "/fleet/workers", headers=ADMIN_HEADERS
                )
                if answer.status_code == 200:
                    return {row["worker_id"]: row for row in answer.json()["workers"]}
        return {}

    async def all_live(self) -> bool:
        """Whether every running router sees every worker live: a router that did not
        take a worker's registration learns of it at its next registry refresh, and
        until then routes (and picks, behind Envoy) without it."""
        for router in self.routers:
            if not router.child.running:
                continue
            rows = await self.fleet_workers(router)
            if len(rows) != len(self.workers) or any(r["state"] != "live" for r in rows.values()):
                return False
        return True

    async def state_of(self, worker: Worker) -> tuple[str, int]:
        """The worker's state and incarnation in the registry ("absent", 0 when gone)."""
        row = (await self.fleet_workers()).get(worker.worker_id)
        return ("absent", 0) if row is None else (row["state"], row["incarnation"])

    async def engine_blocks(self, worker: Worker, prefixes: bool = False) -> dict[str, Any]:
        query = "?prefixes=1" if prefixes else ""
        answer = await self.http.get(worker.engine_url + "/sim/blocks" + query)
        answer.raise_for_status()
        body: dict[str, Any] = answer.json()
        return body

    async def engine_running(self, worker: Worker) -> float:
        """vLLM's running plus waiting requests, from the engine's /metrics."""
        names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
        samples = metric_samples((await self.http.get(worker.engine_url + "/metrics")).text, names)
        return sum(total(samples, name) or 0.0 for name in names)

    async def fault(self, worker: Worker, **fault: Any) -> None:
        answer = await self.http.post(worker.engine_url + "/sim/faults", json=fault)
        answer.raise_for_status()

    @staticmethod
    async def wait_for(what: str, condition: Any, timeout_s: float, poll_s: float = 0.05) -> float:
        """Seconds until the async `condition()` holds; TimeoutError naming `what` after
        `timeout_s`."""
        started = time.monotonic()
        while not await condition():
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"timed out after {timeout_s:g} s waiting until {what}")
            await asyncio.sleep(poll_s)
        return time.monotonic() - started


def process_resources(pid: int) -> tuple[int, int]:
    """A process's resident memory in bytes and its open file descriptors."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))
