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

from kvplane.core.config import AgentSettings, ConfigError, Settings, load_settings
from kvplane.core.flags import add_model_flags, given_flags
from kvplane.core.logsetup import configure_logging
from kvplane.core.serving import run_service
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
    parser.add_argument("--http-host", help="HTTP address to listen on (default 127.0.0.1)")
    parser.add_argument(
        "--admin-port", type=int, help="serve the fleet API and /metrics on this port alone"
    )
    parser.add_argument("--grpc-host", help="gRPC address to listen on (default 127.0.0.1)")
    parser.add_argument(
        "--tokenizer", type=Path, help="the served model's Hugging Face tokenizer directory"
    )
    parser.add_argument("--tenants-file", type=Path, help="TOML file of [[tenants]] tables")
    parser.add_argument("--otlp-endpoint", help="export spans over OTLP/HTTP to this URL")
    parser.add_argument(
        "--policy", choices=["kvplane", "round-robin"], help="routing policy (default kvplane)"
    )


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
    "http_host": ("http", "host"),
    "admin_port": ("http", "admin_port"),
    "grpc_host": ("control_plane", "grpc_host"),
    "tokenizer": ("proxy", "tokenizer_dir"),
    "tenants_file": ("tenants", "tenants_file"),
    "otlp_endpoint": ("tracing", "otlp_endpoint"),
    "policy": ("scoring", "policy"),
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
    run_service(serve(settings))
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from simulations.demo import run_demo

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
        run_service(WorkerAgent(settings).run())
    except PublisherRejected as error:
        print(f"kvplane agent: the control plane refused it: {error}", file=sys.stderr)
        return 2
    return 0


def _run_engine_sim(args: argparse.Namespace) -> int:
    from kvplane.core.config import LoggingSettings
    from simulations.engine.app import serve_engine_sim
    from simulations.engine.config import config_from_args

    config = config_from_args(args)
    configure_logging(LoggingSettings(level=config.log_level))
    run_service(serve_engine_sim(config))
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


def _run_bench_router(args: argparse.Namespace) -> int:
    from benchmarks.router import run_router_benchmark

    return run_router_benchmark(
        json_path=args.json,
        backends=args.index,
        redis_url=args.redis_url,
        prompt_lengths=args.prompt_tokens,
        fleet_sizes=args.workers,
        decisions=args.decisions,
        requests=args.requests,
        concurrency=args.concurrency,
        sequential=args.sequential,
        host_tier=args.host_tier,
    )


def _run_bench_policies(args: argparse.Namespace) -> int:
    from benchmarks.policy_grid import run_policy_grid

    try:
        return run_policy_grid(
            json_path=args.json,
            scoring_overrides=dict(args.scoring),
            only=args.only,
            slo_ttft_p90_s=args.slo_ttft_p90,
        )
    except ValueError as error:  # pydantic's ValidationError too: a weight it refuses
        print(f"kvplane bench policies: {error}", file=sys.stderr)
        return 2


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def _workload(
    args: argparse.Namespace,
    workload_args: dict[str, object],
    *,
    speedup: float = 1.0,
    limit: int | None = None,
) -> Any:
    """The trace (`--trace`) or generated workload (`--workload`, its arguments)."""
    from simulations.fleet.workloads import WORKLOADS, load_trace

    if args.trace is not None:
        return load_trace(args.trace, speedup=speedup, limit=limit)
    if args.workload not in WORKLOADS:
        raise ValueError(f"unknown workload {args.workload!r} ({', '.join(sorted(WORKLOADS))})")
    return WORKLOADS[args.workload](seed=getattr(args, "seed", 0), **workload_args)


def _sim_inputs(args: argparse.Namespace, setting: tuple[str, float] | None = None) -> Any:
    """The workload and fleet of a `kvplane sim` run, with one setting changed (a
    sweep's point): `workers`, `capacity_tokens`, `speedup` (a trace) or any parameter
    of a generated workload."""
    from simulations.engine.timing import TimingModel
    from simulations.fleet.roofline import read_roofline_timing
    from simulations.fleet.simulator import FleetConfig

    fleet = {"workers": args.workers, "capacity_tokens": args.capacity_tokens}
    speedup = args.speedup
    workload_args = dict(args.workload_arg)
    if setting is not None:
        key, value = setting
        if key in fleet:
            fleet[key] = int(value)
        elif key == "speedup":
            speedup = value
        else:
            workload_args[key] = value
    workload = _workload(args, workload_args, speedup=speedup, limit=args.limit)
    timing = TimingModel()
    if args.model_config is not None:
        timing = read_roofline_timing(args.model_config, args.gpu, args.tensor_parallel)
    config = FleetConfig(
        workers=fleet["workers"],
        capacity_tokens=fleet["capacity_tokens"],
        timing=timing,
        event_delay_s=args.event_delay_s,
        load_interval_s=args.load_interval_s,
        load_delay_s=args.load_delay_s,
    )
    return workload, config


def _run_sim(args: argparse.Namespace) -> int:
    import json

    from simulations.fleet.policies import POLICIES
    from simulations.fleet.report import as_json, render_sweep, render_table
    from simulations.fleet.run import compare, run_description

    if (args.trace is None) == (args.workload is None):
        print("kvplane sim: give --trace FILE or --workload NAME", file=sys.stderr)
        return 2
    policies = list(POLICIES) if args.policies == "all" else args.policies.split(",")
    unknown = [name for name in policies if name not in POLICIES]
    if unknown:
        print(f"kvplane sim: unknown policies {unknown} ({', '.join(POLICIES)})", file=sys.stderr)
        return 2
    points = [None] if args.sweep is None else [(args.sweep[0], v) for v in args.sweep[1]]
    comparisons = []
    try:
        for point in points:
            workload, config = _sim_inputs(args, point)
            comparisons.append(
                compare(workload, config, policies, seed=args.seed,
                        show_progress=sys.stderr.isatty())
            )  # fmt: skip
    except (TypeError, ValueError) as error:
        print(f"kvplane sim: {error}", file=sys.stderr)
        return 2
    comparison = comparisons[-1]
    description = run_description(workload, config, args.seed)
    if args.sweep is None:
        print(
            f"{workload.name}: {len(workload.requests):,} requests, {config.workers} workers "
            f"of {config.capacity_tokens:,} tokens, seed {args.seed}"
        )
        print(render_table(comparison.results, comparison.bounds))
        seconds = ", ".join(f"{k} {v:.1f} s" for k, v in comparison.seconds.items())
        print(f"wall time per policy: {seconds}")
    else:
        key, values = args.sweep
        print(f"{workload.name}: sweeping {key} over {', '.join(f'{v:g}' for v in values)}")
        print(render_sweep(key, values, [c.results for c in comparisons], args.slo_ttft_p90))
    if args.plot is not None:
        from simulations.fleet.plots import write_plots

        paths = write_plots(args.plot, comparison.results, comparison.bounds, comparison.records)
        print(f"plots: {', '.join(str(path) for path in paths)}")
    if args.json is not None:
        document = as_json(comparison.results, comparison.bounds, description)
        if args.sweep is not None:
            document["sweep"] = {
                "setting": args.sweep[0],
                "points": [
                    {"value": value, **as_json(c.results, c.bounds, {})}
                    for value, c in zip(args.sweep[1], comparisons, strict=True)
                ],
            }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


def _sweep_arg(text: str) -> tuple[str, list[float]]:
    key, separator, raw = text.partition("=")
    try:
        values = [float(part) for part in raw.split(",") if part]
    except ValueError:
        values = []
    if not separator or not key or not values:
        raise argparse.ArgumentTypeError(f"expected KEY=V1,V2,..., got {text!r}")
    return key.replace("-", "_"), values


def _run_plan(args: argparse.Namespace) -> int:
    from simulations.fleet.plan import Replica, plan, read_model_shape

    try:
        shape = read_model_shape(args.model_config, args.kv_dtype)
        mean = None
        if args.trace is not None or args.workload is not None:
            requests = _workload(args, dict(args.workload_arg)).requests
            mean = sum(r.prompt_tokens + r.output_tokens for r in requests) / max(1, len(requests))
        replica = Replica(
            gpus=args.gpus_per_replica,
            gpu_memory_gib=args.gpu_memory_gib,
            memory_utilization=args.gpu_memory_utilization,
            weights_gib=args.weights_gib,
            reserve_gib_per_gpu=args.reserve_gib,
        )
        result = plan(
            shape,
            replica,
            replicas=args.replicas,
            block_size=args.block_size,
            mean_request_tokens=mean,
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"kvplane plan: {error}", file=sys.stderr)
        return 2
    kind = "latent" if shape.latent_dim is not None else "keys and values"
    print(
        f"model: {shape.layers} layers, {shape.kv_heads} KV heads of {shape.head_dim} "
        f"({kind}), {shape.dtype_bytes} byte(s) per element"
    )
    print(f"KV bytes per token:      {result.kv_bytes_per_token:,}")
    print(
        f"KV cache per replica:    {result.kv_cache_gib:,.2f} GiB = "
        f"{result.tokens_per_replica:,} tokens = {result.blocks_per_replica:,} blocks of "
        f"{args.block_size}"
    )
    print(f"blocks per GPU:          {result.blocks_per_gpu:,}")
    print(f"fleet ({result.replicas} replicas):     {result.fleet_tokens:,} tokens of KV cache")
    if result.concurrent_requests is not None and result.mean_request_tokens is not None:
        print(
            f"concurrency:             {result.concurrent_requests:,} requests of "
            f"{result.mean_request_tokens:,.0f} tokens (prompt and output, the workload's mean)"
        )
    return 0


def _workload_arg(text: str) -> tuple[str, object]:
    """KEY=VALUE, the value read as an int, a float, `none`, or else a string."""
    key, separator, raw = text.partition("=")
    if not separator or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    value: object = raw
    if raw.lower() == "none":
        value = None
    else:
        for parse in (int, float):
            try:
                value = parse(raw)
                break
            except ValueError:
                continue
    return key.replace("-", "_"), value


def _add_sim_flags(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", type=Path, help="a Mooncake .jsonl or Azure .csv trace")
    source.add_argument("--workload", help="a generated workload: shared-prefix, llmd-prefix, "
                        "multi-turn, agent-tree, multi-tenant")  # fmt: skip
    parser.add_argument(
        "--workload-arg", type=_workload_arg, action="append", default=[], metavar="KEY=VALUE",
        help="a parameter of the generated workload (repeatable), e.g. groups=32",
    )  # fmt: skip
    parser.add_argument("--limit", type=int, help="replay only the first N requests of a trace")
    parser.add_argument("--speedup", type=float, default=1.0, help="replay a trace N times faster")
    parser.add_argument("--workers", type=int, default=10, help="engine replicas (default 10)")
    parser.add_argument(
        "--capacity-tokens", type=int, default=3_000_000, help="KV cache per worker, in tokens"
    )
    parser.add_argument(
        "--policies", default="all", help="comma-separated, or all (default): "
        "random, round-robin, least-loaded, kvplane",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--plot", type=Path, help="write PNG charts into this directory")
    parser.add_argument(
        "--sweep", type=_sweep_arg, metavar="KEY=V1,V2,...",
        help="run once per value of workers, capacity_tokens, speedup or a workload "
        "parameter (e.g. workers=4,6,8 or rate_per_s=2,4,8)",
    )  # fmt: skip
    parser.add_argument(
        "--slo-ttft-p90", type=float, default=2.0,
        help="with --sweep: the TTFT p90 each policy must meet (default 2 s)",
    )  # fmt: skip
    parser.add_argument("--event-delay-s", type=float, default=0.01,
                        help="engine step to the router's index (default 0.01)")  # fmt: skip
    parser.add_argument("--load-interval-s", type=float, default=1.0,
                        help="between load reports (default 1)")  # fmt: skip
    parser.add_argument("--load-delay-s", type=float, default=0.01,
                        help="a load report's way to the router (default 0.01)")  # fmt: skip
    parser.add_argument("--model-config", type=Path,
                        help="time steps by a roofline of this model (a config.json or its "
                        "directory) on --gpu instead of the default timing model")  # fmt: skip
    parser.add_argument("--gpu", default="h100", help="with --model-config: a100, h100, h200")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="with --model-config: GPUs per worker (default 1)")  # fmt: skip


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
    _add_settings_flags(router)
    router.set_defaults(handler=_run_router)

    demo = commands.add_parser(
        "demo", help="three simulated engines behind the router: kvplane against round-robin"
    )
    _add_common_flags(demo)
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

    sim = commands.add_parser(
        "sim",
        help="compare routing policies on a simulated fleet, in simulated time",
        description="The fleet simulator: replay a trace or a generated workload through "
        "each policy on the same fleet of simulated engines (docs/simulation.md).",
    )
    _add_sim_flags(sim)
    sim.set_defaults(handler=_run_sim)

    planner = commands.add_parser(
        "plan",
        help="KV cache per replica and the fleet's concurrency, from a model's config",
        description="Capacity planning from a Hugging Face config.json: KV bytes per token "
        "(layers, KV heads, head dim, dtype), blocks per GPU, and how many requests of a "
        "workload the fleet's cache holds at once.",
    )
    planner.add_argument("model_config", type=Path, help="a config.json, or its directory")
    planner.add_argument("--gpu-memory-gib", type=float, required=True, help="per GPU")
    planner.add_argument("--weights-gib", type=float, required=True, help="the whole model")
    planner.add_argument("--gpus-per-replica", type=int, default=1, help="tensor parallelism")
    planner.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                         help="vLLM's --gpu-memory-utilization (default 0.9)")  # fmt: skip
    planner.add_argument("--reserve-gib", type=float, default=1.0,
                         help="per GPU, for activations (default 1)")  # fmt: skip
    planner.add_argument("--kv-dtype", help="the KV cache's dtype (default: the model's)")
    planner.add_argument("--block-size", type=int, default=16)
    planner.add_argument("--replicas", type=int, default=1)
    source = planner.add_mutually_exclusive_group()
    source.add_argument("--trace", type=Path, help="a workload trace, for its mean request")
    source.add_argument("--workload", help="a generated workload, for its mean request")
    planner.add_argument("--workload-arg", type=_workload_arg, action="append", default=[],
                         metavar="KEY=VALUE")  # fmt: skip
    planner.set_defaults(handler=_run_plan)

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
    router_bench = bench_kinds.add_parser("router", help="routing decisions and proxy overhead")
    router_bench.add_argument("--json", type=Path, help="also write the figures here")
    router_bench.add_argument(
        "--index",
        type=lambda text: [part for part in text.split(",") if part],
        default=["memory", "redis"],
        help="index backends for the decisions, comma-separated (default memory,redis)",
    )
    router_bench.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    router_bench.add_argument(
        "--prompt-tokens", type=_int_list, default=[1024, 8192, 32768], help="comma-separated"
    )
    router_bench.add_argument(
        "--workers", type=_int_list, default=[16, 64, 256], help="comma-separated"
    )
    router_bench.add_argument(
        "--decisions", type=int, default=1000, help="timed per row (fewer for the largest)"
    )
    router_bench.add_argument(
        "--requests", type=int, default=5000, help="proxied requests (0: skip the proxy)"
    )
    router_bench.add_argument("--concurrency", type=int, default=32)
    router_bench.add_argument(
        "--sequential", type=int, default=1000, help="one-at-a-time requests, for latency"
    )
    router_bench.add_argument(
        "--host-tier",
        action="store_true",
        help="every fourth worker holds the back half of its prefix in host memory",
    )
    router_bench.set_defaults(handler=_run_bench_router)
    grid = bench_kinds.add_parser(
        "policies", help="kvplane's policy against the others over workloads and arrival rates"
    )
    grid.add_argument("--json", type=Path, help="also write the figures here")
    grid.add_argument(
        "--scoring",
        type=_workload_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one of kvplane's [scoring] weights, repeatable",
    )
    grid.add_argument(
        "--only",
        type=lambda text: [part for part in text.split(",") if part],
        default=[],
        help="these workloads only, comma-separated",
    )
    grid.add_argument("--slo-ttft-p90", type=float, default=2.0)
    grid.set_defaults(handler=_run_bench_policies)
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
    except ConfigError as error:
        parser.exit(2, f"kvplane: invalid configuration: {error}\n")
    except (FileNotFoundError, OSError) as error:  # a missing file, a port in use, ...
        parser.exit(1, f"kvplane: {error}\n")
    return result


if __name__ == "__main__":
    sys.exit(main())
