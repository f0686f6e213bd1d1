"""`kvplane`: one command, a subcommand per job; the top of the layering.

The product's own commands (`router`, `agent`) are parsed here. The tools (engine and
fleet simulators, the demo, the benchmarks) own their command lines: `kvplane TOOL ...`
hands the rest of the arguments to the tool's `main`. Each subcommand imports its
module lazily, so `kvplane agent` loads no router code and a product-only install
(no `kvplane[sim]` extra) still runs the router and the agent.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from pydantic import ValidationError

from kvplane.core.config import ConfigError
from kvplane.core.flags import (
    add_agent_flags,
    add_check_flags,
    add_common_flags,
    add_router_flags,
    settings_from_args,
)
from kvplane.core.logsetup import configure_logging
from kvplane.core.serving import run_service


@dataclass(frozen=True, slots=True)
class Tool:
    """A subcommand whose command line belongs to a tool package: `module.entry(argv,
    prog)` parses and runs it."""

    module: str
    entry: str
    help: str


TOOLS: dict[str, Tool] = {
    "demo": Tool(
        "simulations.demo",
        "main",
        "three simulated engines behind the router: kvplane against round-robin",
    ),
    "engine-sim": Tool(
        "simulations.engine_sim.cli", "main", "a vLLM-compatible engine simulator (no GPU)"
    ),
    "sim": Tool(
        "simulations.fleet_sim.cli",
        "sim_main",
        "compare routing policies on a simulated fleet, in simulated time",
    ),
    "plan": Tool(
        "simulations.fleet_sim.cli",
        "plan_main",
        "KV cache per replica and the fleet's concurrency, from a model's config",
    ),
    "bench": Tool("benchmarks.cli", "main", "benchmarks that print their figures"),
}

# A module missing from these is a bug to surface, not an extra to install.
_PRODUCT_PACKAGES = ("kvplane", "router", "worker_agent")
_SIM_EXTRA_HINT = "pip install 'kvplane[sim]'"


def _run_router(args: argparse.Namespace) -> int:
    from router.app import serve

    settings = settings_from_args(args)
    configure_logging(settings.logging)
    run_service(serve(settings))
    return 0


def _run_agent(args: argparse.Namespace) -> int:
    from worker_agent.agent import WorkerAgent, tune_garbage_collector
    from worker_agent.publisher import PublisherRejected

    settings = settings_from_args(args)
    configure_logging(settings.logging)
    tune_garbage_collector()
    try:
        run_service(WorkerAgent(settings).run())
    except PublisherRejected as error:
        print(f"kvplane agent: the control plane refused it: {error}", file=sys.stderr)
        return 2
    return 0


def _run_worker_token(args: argparse.Namespace) -> int:
    from kvplane.core.worker_credentials import worker_token

    secret = settings_from_args(args).control_plane.worker_credential_secret
    if secret is None:
        _fail(2, "no control_plane.worker_credential_secret is configured (--config or "
              "KVPLANE_CONTROL_PLANE__WORKER_CREDENTIAL_SECRET)")  # fmt: skip
    token = worker_token(secret.get_secret_value(), args.worker_id)
    if args.output is None:
        print(token)
    else:  # readable by its owner only: an init container hands it to the agent
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        descriptor = os.open(args.output, flags, 0o600)
        os.fchmod(descriptor, 0o600)  # a file that was there keeps its mode otherwise
        with os.fdopen(descriptor, "w") as output:
            output.write(token + "\n")
    return 0


def _run_check(args: argparse.Namespace) -> int:
    from router.check import run_check

    return run_check(args)


def _run_envoy_config(args: argparse.Namespace) -> int:
    from router.picker.envoy_config import (
        DEFAULT_PICKER,
        BodyMode,
        EnvoyConfigError,
        build_bootstrap,
        render,
    )

    try:
        bootstrap = build_bootstrap(
            listen=args.listen,
            pickers=args.picker or [DEFAULT_PICKER],
            endpoints=args.endpoint,
            body_mode=BodyMode(args.body_mode),
            fail_open=args.fail_open,
            admin_port=args.admin_port,
            picker_tls=args.picker_tls,
            response_body=args.response_body,
        )
    except EnvoyConfigError as error:
        _fail(2, f"envoy-config: {error}")
    if args.fail_open and args.body_mode == "full-duplex":
        print(
            "kvplane: envoy-config: note: Envoy fails open in full-duplex mode only until "
            "a request's body has gone to the picker; --body-mode buffered fails open "
            "whole (docs/picker.md)",
            file=sys.stderr,
        )
    if args.output is None:
        sys.stdout.write(render(bootstrap))
    else:
        args.output.write_text(render(bootstrap))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvplane", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    router = commands.add_parser(
        "router",
        help="run the router: OpenAI proxy, fleet API and control plane",
        description="The router. Every setting is in the --config file or KVPLANE_<SECTION>__"
        "<FIELD> (secrets such as KVPLANE_HTTP__ADMIN_TOKEN and "
        "KVPLANE_TENANTS__CACHE_SALT_SECRET belong there, not in flags); see docs/router.md.",
    )
    add_router_flags(router)
    router.set_defaults(handler=_run_router)

    agent = commands.add_parser(
        "agent",
        help="run beside an engine: stream its KV cache events and load to the control plane",
        description="The worker agent. Every flag is also a setting: the [agent] section "
        "of the --config file or KVPLANE_AGENT__<FIELD>; the router's block size and agent "
        "token (control_plane.block_size, control_plane.agent_token) apply here too.",
    )
    add_common_flags(agent)
    add_agent_flags(agent)
    agent.set_defaults(handler=_run_agent)

    check = commands.add_parser(
        "check",
        help="probe a running fleet's wiring through its router: each check, pass or fail, "
        "with the fix",
        description="Asks the router (its fleet API, with the admin token from "
        "KVPLANE_HTTP__ADMIN_TOKEN) to probe every live worker; exit status 0 when no check "
        "failed, 1 when one did, 2 when the router could not be asked. See "
        "docs/troubleshooting.md.",
    )
    add_check_flags(check)
    check.set_defaults(handler=_run_check)

    token = commands.add_parser(
        "worker-token",
        help="print the token that lets one worker's agent register (worker credentials)",
        description="Derives a worker's own token from control_plane.worker_credential_secret "
        "(the --config file or KVPLANE_CONTROL_PLANE__WORKER_CREDENTIAL_SECRET, as the router "
        "reads it); give it to that worker's agent as its control_plane.agent_token. A token "
        "for one worker cannot register another. See docs/wire-contract.md.",
    )
    token.add_argument("--config", type=Path, help="TOML configuration file (KVPLANE_* win)")
    token.add_argument("--worker-id", required=True, help="the worker the token speaks for")
    token.add_argument(
        "--output",
        type=Path,
        help="write it to this file (mode 0600) instead: the agent's "
        "control_plane.agent_token_file",
    )
    token.set_defaults(handler=_run_worker_token)

    envoy = commands.add_parser(
        "envoy-config",
        help="print an Envoy bootstrap that routes through kvplane's endpoint picker",
        description="Writes an Envoy v3 bootstrap (JSON, which Envoy reads as .json or "
        ".yaml): a listener whose requests the picker (`kvplane router --picker-port`, "
        "Envoy's ext_proc) sends to one of the --endpoint workers. Run it with `envoy -c "
        "FILE --concurrency 1` on a small machine, and `--disable-hot-restart` to run "
        "several Envoys side by side. See router/picker/envoy_config.py.",
    )
    envoy.add_argument(
        "--listen",
        default="127.0.0.1:10000",
        metavar="IP:PORT",
        help="where clients reach Envoy (default 127.0.0.1:10000)",
    )
    envoy.add_argument(
        "--picker",
        action="append",
        metavar="HOST:PORT",
        help="a picker's gRPC address; repeat it for active-active pickers "
        "(default 127.0.0.1:9002)",
    )
    envoy.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="IP:PORT",
        help="a worker (engine) the picker may name: one flag each, at least one",
    )
    envoy.add_argument(
        "--body-mode",
        choices=["full-duplex", "buffered"],
        default="full-duplex",
        help="how Envoy sends the request body to the picker: FULL_DUPLEX_STREAMED "
        "(default) or BUFFERED",
    )
    envoy.add_argument(
        "--fail-open",
        action="store_true",
        help="while no picker answers, send requests to a worker chosen round robin "
        "(default: fail closed, with a 500)",
    )
    envoy.add_argument(
        "--admin-port",
        type=int,
        default=9901,
        help="Envoy's admin interface on 127.0.0.1: /ready, /stats (default 9901)",
    )
    envoy.add_argument(
        "--picker-tls",
        action="store_true",
        help="reach the pickers over TLS, without verifying their certificates (as gateways do)",
    )
    envoy.add_argument(
        "--response-body",
        action="store_true",
        help="send every answer's headers and chunks through the picker too (as llm-d "
        "does): it then reads each answer's usage and served endpoint, at a round trip a "
        "chunk (docs/picker.md)",
    )
    envoy.add_argument("--output", type=Path, help="write it to this file, not stdout")
    envoy.set_defaults(handler=_run_envoy_config)

    for name, tool in TOOLS.items():
        # Listed for `kvplane --help`; main() hands their arguments to the tool itself.
        commands.add_parser(name, help=tool.help, add_help=False)
    return parser


def _tool_entry(name: str) -> Callable[[Sequence[str], str], int]:
    tool = TOOLS[name]
    try:
        module = importlib.import_module(tool.module)
    except ModuleNotFoundError as error:
        missing = (error.name or "").split(".")[0]
        if missing not in _PRODUCT_PACKAGES and missing not in sys.stdlib_module_names:
            _fail(2, f"kvplane {name} needs the tools and their dependencies "
                  f"({missing} is missing): {_SIM_EXTRA_HINT}")  # fmt: skip
        raise
    entry: Callable[[Sequence[str], str], int] = getattr(module, tool.entry)
    return entry


def _fail(status: int, message: str) -> NoReturn:
    print(f"kvplane: {message}", file=sys.stderr)
    raise SystemExit(status)


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        if arguments and arguments[0] in TOOLS:
            name = arguments[0]
            return _tool_entry(name)(arguments[1:], f"kvplane {name}")
        args = build_parser().parse_args(arguments)
        result: int = args.handler(args)
    except KeyboardInterrupt:
        return 130
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in problem['loc'])}: {problem['msg']}"
            for problem in error.errors()
        )
        _fail(2, f"invalid configuration: {problems}")
    except ConfigError as error:
        _fail(2, f"invalid configuration: {error}")
    except (FileNotFoundError, OSError) as error:  # a missing file, a port in use, ...
        _fail(1, str(error))
    return result


if __name__ == "__main__":
    sys.exit(main())
