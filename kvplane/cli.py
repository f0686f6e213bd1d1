"""`kvplane`: one command, a subcommand per job. Each subcommand imports its own module
lazily, so `kvplane bench` does not pay for the router's imports and vice versa."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvplane.config import AgentSettings, Settings, load_settings
from kvplane.flags import add_model_flags, given_flags
from kvplane.logsetup import configure_logging
from simulations.engine.config import add_engine_sim_flags


def _add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, help="TOML configuration file (flags and KVPLANE_* win)"
    )
    parser.add_argument("--block-size", type=int, help="tokens per kvplane block key (default 16)")
    parser.add_argument(
        "--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default INFO"
    )
    parser.add_argument(
        "--log-format", choices=["text", "json"], help="text, or JSON lines (default text)"
    )


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    _add_common_flags(parser)
    parser.add_argument(
        "--index", choices=["memory", "redis", "redis-cluster"], help="location index backend"
    )
    parser.add_argument("--redis-url", help="Redis URL for the redis backends")
    parser.add_argument("--grpc-port", type=int, help="control-plane gRPC port (default 50051)")
    parser.add_argument("--http-port", type=int, help="HTTP port (default 8080)")
    parser.add_argument("--lease-s", type=float, help="worker lease in seconds (default 5)")


_AGENT_DEST = "agent_"


def _add_agent_flags(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser, AgentSettings, dest_prefix=_AGENT_DEST)


_FLAG_TO_SETTING = {
    "index": ("index", "backend"),
    "redis_url": ("index", "redis_url"),
    "grpc_port": ("control_plane", "grpc_port"),
    "http_port": ("http", "port"),
    "block_size": ("control_plane", "block_size"),
    "lease_s": ("control_plane", "lease_s"),
    "log_level": ("logging", "level"),
    "log_format": ("logging", "format"),
}


def _settings_from(args: argparse.Namespace) -> Settings:
    overrides: dict[str, dict[str, Any]] = {}
    for flag, (section, name) in _FLAG_TO_SETTING.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides.setdefault(section, {})[name] = value
    agent = given_flags(args, AgentSettings.model_fields, _AGENT_DEST)
    if agent:
        overrides.setdefault("agent", {}).update(agent)
    return load_settings(args.config, overrides)


def _run_router(args: argparse.Namespace) -> int:
    from router.app import serve

    settings = _settings_from(args)
    configure_logging(settings.logging)
    asyncio.run(serve(settings))
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from router.demo import run_demo

    settings = _settings_from(args)
    configure_logging(settings.logging)
    return asyncio.run(run_demo(settings))


def _run_agent(args: argparse.Namespace) -> int:
    from worker_agent.agent import WorkerAgent, tune_garbage_collector
    from worker_agent.publisher import PublisherRejected

    settings = _settings_from(args)
    configure_logging(settings.logging)
    tune_garbage_collector()
    try:
        asyncio.run(WorkerAgent(settings).run())
    except PublisherRejected as error:
        print(f"kvplane agent: the control plane refused it: {error}", file=sys.stderr)
        return 2
    return 0


def _run_engine_sim(args: argparse.Namespace) -> int:
    from kvplane.config import LoggingSettings
    from simulations.engine.app import serve_engine_sim
    from simulations.engine.config import config_from_args

    config = config_from_args(args)
    configure_logging(LoggingSettings(level=config.log_level))
    asyncio.run(serve_engine_sim(config))
    return 0


def _run_bench_index(args: argparse.Namespace) -> int:
    from benchmarks.index import run_index_benchmark

    return run_index_benchmark(
        json_path=args.json,
        redis_url=args.redis_url,
        entries=args.entries,
        workers=args.workers,
        lookups=args.lookups,
        redis_entries=args.redis_entries,
    )


def _run_bench_agent(args: argparse.Namespace) -> int:
    from benchmarks.agent import run_agent_benchmark

    return run_agent_benchmark(
        json_path=args.json, events=args.events, blocks_per_event=args.blocks_per_event
    )


def _run_bench_engine_sim(args: argparse.Namespace) -> int:
    from benchmarks.engine_sim import run_engine_sim_benchmark

    return run_engine_sim_benchmark(
        json_path=args.json,
        requests=args.requests,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvplane", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    router = commands.add_parser("router", help="run the router and control plane")
    _add_settings_flags(router)
    router.set_defaults(handler=_run_router)

    demo = commands.add_parser("demo", help="start a control plane and show it at work")
    _add_settings_flags(demo)
    demo.set_defaults(handler=_run_demo)

    agent = commands.add_parser(
        "agent",
        help="run beside an engine: stream its KV cache events and load to the control plane",
        description="The worker agent. Every flag is also a setting: the [agent] section "
        "of the --config file or KVPLANE_AGENT__<FIELD>; the router's block size and agent "
        "token (control_plane.block_size, control_plane.agent_token) apply here too.",
    )
    _add_common_flags(agent)
    _add_agent_flags(agent)
    agent.set_defaults(handler=_run_agent)

    engine_sim = commands.add_parser(
        "engine-sim",
        help="a vLLM-compatible engine simulator (no GPU)",
        description="A vLLM-compatible engine simulator: paged KV cache with prefix caching, "
        "KV events on ZMQ, OpenAI-compatible HTTP, modelled timing. Flags named like "
        "vLLM's take vLLM's formats. VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 sends block "
        "hashes as 32-byte digests, as it does for vLLM.",
    )
    add_engine_sim_flags(engine_sim)
    engine_sim.set_defaults(handler=_run_engine_sim)

    bench = commands.add_parser("bench", help="benchmarks that print their figures")
    bench_kinds = bench.add_subparsers(dest="bench", required=True)
    index = bench_kinds.add_parser("index", help="block keys and location index")
    index.add_argument("--json", type=Path, help="also write the figures here")
    index.add_argument(
        "--redis-url",
        default="redis://127.0.0.1:6379/0",
        help="Redis to measure (empty: skip the Redis backend)",
    )
    index.add_argument("--redis-entries", type=int, default=1_000_000)
    index.add_argument("--entries", type=int, default=10_000_000)
    index.add_argument("--workers", type=int, default=64)
    index.add_argument("--lookups", type=int, default=2000)
    index.set_defaults(handler=_run_bench_index)
    sim = bench_kinds.add_parser("engine-sim", help="engine simulator throughput")
    sim.add_argument("--json", type=Path, help="also write the figures here")
    sim.add_argument("--requests", type=int, default=10_000)
    sim.add_argument("--concurrency", type=int, default=64)
    sim.add_argument("--max-tokens", type=int, default=4)
    sim.set_defaults(handler=_run_bench_engine_sim)
    agent_bench = bench_kinds.add_parser("agent", help="agent translate-and-forward throughput")
    agent_bench.add_argument("--json", type=Path, help="also write the figures here")
    agent_bench.add_argument("--events", type=int, default=4000, help="event batches to send")
    agent_bench.add_argument("--blocks-per-event", type=int, default=64, help="blocks per batch")
    agent_bench.set_defaults(handler=_run_bench_agent)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.handler(args)
    except KeyboardInterrupt:
        return 130
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in problem['loc'])}: {problem['msg']}"
            for problem in error.errors()
        )
        parser.exit(2, f"kvplane: invalid configuration: {problems}\n")
    except (FileNotFoundError, OSError) as error:  # a missing file, a port in use, ...
        parser.exit(1, f"kvplane: {error}\n")
    return result


if __name__ == "__main__":
    sys.exit(main())
