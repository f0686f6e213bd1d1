"""One engine simulator with `kvplane router` and `kvplane agent` in front of it, each a
real process on free loopback ports, as an operator runs them."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from kvplane.core.serving import free_port
from simulations.processes import spawn_kvplane


@dataclass(frozen=True, slots=True)
class OneWorkerStack:
    engine_url: str
    router_url: str
    worker_id: str
    router: subprocess.Popen[bytes]


@contextmanager
def one_worker_stack(
    worker_id: str,
    *,
    router_args: Sequence[str] = (),
    router_env: Mapping[str, str] | None = None,
    engine_args: Sequence[str] = (),
    module: str = "kvplane.cli",
) -> Iterator[OneWorkerStack]:
    """The three processes, killed on exit; `module` runs the router and the agent
    (`python -m MODULE router ...`), the engine simulator always runs as `kvplane`."""
    sim_port, grpc_port, http_port = free_port(), free_port(), free_port()
    events, replay = free_port(), free_port()
    engine_url = f"http://127.0.0.1:{sim_port}"
    router_url = f"http://127.0.0.1:{http_port}"
    kv_config = (
        f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{events}", '
        f'"replay_endpoint": "tcp://*:{replay}"}}'
    )
    with ExitStack() as stack:
        stack.enter_context(
            spawn_kvplane(
                ["engine-sim", "--port", str(sim_port), "--time-scale", "0",
                 "--kv-events-config", kv_config, *engine_args],
                engine_url + "/health",
            )
        )  # fmt: skip
        router = stack.enter_context(
            spawn_kvplane(
                ["router", "--grpc-port", str(grpc_port), "--http-port", str(http_port),
                 *router_args],
                router_url + "/healthz",
                env=router_env,
                module=module,
            )
        )  # fmt: skip
        stack.enter_context(
            spawn_kvplane(
                ["agent", "--worker-id", worker_id, "--engine-url", engine_url,
                 "--kv-events-endpoint", f"tcp://127.0.0.1:{events}",
                 "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}",
                 "--control-plane-address", f"127.0.0.1:{grpc_port}"],
                None,
                module=module,
            )
        )  # fmt: skip
        yield OneWorkerStack(engine_url, router_url, worker_id, router)
