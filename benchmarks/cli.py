"""`kvplane bench`: the benchmarks' command lines. Each benchmark prints its figures
and can write them as JSON."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvplane.core.config import IndexSettings
from simulations.fleet_sim.cli import workload_arg


def _run_bench_index(args: argparse.Namespace) -> int:
    from benchmarks.index import run_index_benchmark

    return run_index_benchmark(
        json_path=args.json,
        against=args.against,
        redis_url=args.redis_url,
        entries=args.entries,
        fleet_sizes=args.workers,
        lookups=args.lookups,
        redis_entries=args.redis_entries,
        repeats=args.repeats,
        redis_groups=args.redis_groups,
        redis_directory=args.redis_directory,
    )


def _run_bench_agent(args: argparse.Namespace) -> int:
    from benchmarks.agent import run_agent_benchmark

    return run_agent_benchmark(
        json_path=args.json,
        events=args.events,
        blocks_per_event=args.blocks_per_event,
        rate_per_s=args.rate,
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
        oversized=args.oversized,
        host_tier=args.host_tier,
        groups=args.groups,
        streamed=args.streamed,
        peer=not args.no_peer,
    )


def _run_bench_picker(args: argparse.Namespace) -> int:
    from benchmarks.picker import run_picker_benchmark

    return run_picker_benchmark(json_path=args.json, requests=args.requests, repeats=args.repeats)


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


def _run_bench_live(args: argparse.Namespace) -> int:
    from benchmarks.live.main import render_live_json, run_live_benchmark

    if args.from_json is not None:
        if args.json is not None or args.resume:
            print("kvplane bench live: --from-json runs nothing: no --json, no --resume",
                  file=sys.stderr)  # fmt: skip
            return 2
        return render_live_json(args.from_json, markdown_path=args.markdown, plot_path=args.plot)
    profile = "quick" if args.quick else "full" if args.full else "default"
    return run_live_benchmark(
        profile_name=profile,
        only=args.only,
        runs=args.runs,
        duration_s=args.duration,
        json_path=args.json,
        resume=args.resume,
        plot_path=args.plot,
        markdown_path=args.markdown,
        log_dir=args.logs,
    )


def _run_bench_event_rate(args: argparse.Namespace) -> int:
    from benchmarks.event_rate import run_event_rate_benchmark

    return run_event_rate_benchmark(
        json_path=args.json,
        seconds=args.seconds,
        warm_up_s=args.warm_up,
        concurrency=args.concurrency,
        prompt_tokens=args.prompt_tokens,
        system_prompt_tokens=args.system_prompt_tokens,
        system_prompts=args.system_prompts,
        max_tokens=args.max_tokens,
        fleet_engines=args.fleet_engines,
    )


def _run_bench_scale(args: argparse.Namespace) -> int:
    from benchmarks.scale import REDIS_PREFIX, fleet_shape, run_scale_benchmark
    from router.index.redis import KeyLayout

    layout = KeyLayout(REDIS_PREFIX, args.groups, args.directory)
    if args.faults:
        from benchmarks.scale_faults import run_fault_benchmark

        return run_fault_benchmark(
            json_path=args.json,
            shapes=[
                fleet_shape(count, args.capacity_blocks, args.request_blocks, args.batches_per_s)
                for count in args.workers
            ],
            routers=args.routers,
            request_rate=args.request_rate,
            window_s=args.duration,
            layout=layout,
        )
    return run_scale_benchmark(
        json_path=args.json,
        workers=args.workers,
        routers=args.routers,
        duration_s=args.duration,
        batches_per_s=args.batches_per_s,
        capacity_blocks=args.capacity_blocks,
        request_blocks=args.request_blocks,
        request_rate=args.request_rate,
        plot=args.plot,
        layout=layout,
    )


def _add_groups_option(parser: argparse.ArgumentParser, flag: str) -> None:
    parser.add_argument(
        flag,
        type=_group_count,
        default=IndexSettings().redis_groups,
        help="the Redis index's groups (index.redis_groups)",
    )


def _group_count(text: str) -> int:
    """An index.redis_groups value, checked as the router's settings check it."""
    try:
        return IndexSettings(redis_groups=int(text)).redis_groups
    except ValueError as error:  # pydantic's ValidationError is one
        raise argparse.ArgumentTypeError(f"not a group count: {text}") from error


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def build_parser(prog: str = "kvplane bench") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Benchmarks that print their figures.")
    bench_kinds = parser.add_subparsers(dest="bench", required=True)
    index = bench_kinds.add_parser("index", help="block keys and location index")
    index.add_argument("--json", type=Path, help="also write the figures here")
    index.add_argument(
        "--redis-url",
        default="redis://127.0.0.1:6379/0",
        help="Redis to measure (empty: skip the Redis backend)",
    )
    index.add_argument(
        "--against",
        choices=["dynamo"],
        help="also run Dynamo's RadixTree on the same events and lookups (needs `make dynamo-env`)",
    )
    index.add_argument("--redis-entries", type=int, default=300_000)
    _add_groups_option(index, "--redis-groups")
    index.add_argument(
        "--redis-directory",
        action="store_true",
        help="the Redis index's groups keep directories (index.redis_directory)",
    )
    index.add_argument("--entries", type=int, default=1_500_000)
    index.add_argument(
        "--workers", type=_int_list, default=[16, 64], help="fleet sizes, comma-separated"
    )
    index.add_argument("--lookups", type=int, default=2000)
    index.add_argument("--repeats", type=int, default=3, help="fills per index (median)")
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
    agent_bench.add_argument(
        "--rate",
        type=_positive,
        help="batches a second, as an engine publishes them (default: as fast as ZMQ takes them)",
    )
    agent_bench.set_defaults(handler=_run_bench_agent)
    router_bench = bench_kinds.add_parser("router", help="routing decisions and proxy overhead")
    router_bench.add_argument("--json", type=Path, help="also write the figures here")
    router_bench.add_argument(
        "--index",
        type=lambda text: [part for part in text.split(",") if part],
        default=["memory", "redis"],
        help="index backends for the decisions, comma-separated, of memory, redis and "
        "redis-directory (its groups keeping directories) (default memory,redis)",
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
        "--oversized",
        type=int,
        default=3,
        help="10 MB prompts sent after the proxy's runs: the router's CPU before it "
        "refuses one (0: skip)",
    )
    router_bench.add_argument(
        "--streamed",
        type=int,
        default=400,
        help="streamed chats a path, shaped as the bake-off's shared-prompt ones, to a "
        "simulator that paces its tokens (0: skip)",
    )
    router_bench.add_argument(
        "--no-peer",
        action="store_true",
        help="leave out the peer (sglang-router cache_aware, from make peers-env)",
    )
    _add_groups_option(router_bench, "--groups")
    router_bench.add_argument(
        "--host-tier",
        action="store_true",
        help="every fourth worker holds the back half of its prefix in host memory",
    )
    router_bench.set_defaults(handler=_run_bench_router)
    picker = bench_kinds.add_parser(
        "picker",
        help="what Envoy and the endpoint picker add to a request (make envoy-env)",
        description="The same new short completions, one at a time, straight to an engine, "
        "through Envoy alone, Envoy and a trivial picker, Envoy and kvplane's picker, and "
        "kvplane's proxy: each route's latency and its processes' CPU per request.",
    )
    picker.add_argument("--requests", type=int, default=300, help="per route and repeat")
    picker.add_argument("--repeats", type=int, default=3, help="rounds over the routes")
    picker.add_argument("--json", type=Path, help="also write the figures here")
    picker.set_defaults(handler=_run_bench_picker)
    grid = bench_kinds.add_parser(
        "policies", help="kvplane's policy against the others over workloads and arrival rates"
    )
    grid.add_argument("--json", type=Path, help="also write the figures here")
    grid.add_argument(
        "--scoring",
        type=workload_arg,
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
    live = bench_kinds.add_parser(
        "live",
        help="the bake-off: kvplane and the real peer routers in front of the same fleet",
        description="kvplane and every peer router that runs here (from `make peers-env`), "
        "each in turn in front of a fresh fleet of engine simulators, with the same requests "
        "from the official openai client; one table per workload, situation and load.",
    )
    profiles = live.add_mutually_exclusive_group()
    profiles.add_argument("--quick", action="store_true", help="a smoke test: one short run each")
    profiles.add_argument("--full", action="store_true", help="every workload, load and situation")
    live.add_argument(
        "--only",
        type=lambda text: [part for part in text.split(",") if part],
        action="append",
        default=[],
        metavar="TERM[,TERM...]",
        help="the cells whose name holds every term (e.g. 'kvplane,shared-8'); repeatable",
    )
    live.add_argument("--runs", type=int, help="runs of each point (default: the profile's)")
    live.add_argument("--duration", type=float, help="seconds of traffic per cell")
    live.add_argument("--json", type=Path, help="also write the figures here")
    live.add_argument(
        "--resume",
        action="store_true",
        help="keep the whole points that the --json file already holds; run the rest",
    )
    live.add_argument(
        "--from-json",
        type=Path,
        metavar="FILE",
        help="run nothing: print the tables and standings of the run this JSON holds, and "
        "write --markdown and --plot from it",
    )
    live.add_argument("--plot", type=Path, help="also draw them in this PNG")
    live.add_argument(
        "--markdown", type=Path, help="also write a summary in Markdown (hit rate, TTFT p90)"
    )
    live.add_argument("--logs", type=Path, help="keep every process's log under this folder, "
                      "and each cell's requests (requests.jsonl: turn, TTFT, e2e latency, "
                      "inter-token gaps, tokens; no text)")  # fmt: skip
    live.set_defaults(handler=_run_bench_live)
    rate = bench_kinds.add_parser(
        "event-rate",
        help="the KV events one busy engine (the simulator's default timing) announces",
        description="One engine simulator with its default timing model and KV events on, "
        "a closed loop of clients; its events decoded as the agent decodes them: batches, "
        "events and blocks a second and per request, and what a fleet of such engines "
        "sends its control plane.",
    )
    rate.add_argument("--json", type=Path, help="also write the figures here")
    rate.add_argument("--seconds", type=_positive, default=30.0, help="measured window")
    rate.add_argument("--warm-up", type=_positive, default=20.0, help="seconds before it")
    rate.add_argument("--concurrency", type=int, default=64, help="clients in the loop")
    rate.add_argument("--prompt-tokens", type=int, default=2048)
    rate.add_argument("--system-prompt-tokens", type=int, default=1024)
    rate.add_argument("--system-prompts", type=int, default=8, help="shared system prompts")
    rate.add_argument("--max-tokens", type=int, default=128)
    rate.add_argument(
        "--fleet-engines", type=int, default=1000, help="engines the fleet figures are for"
    )
    rate.set_defaults(handler=_run_bench_event_rate)
    scale = bench_kinds.add_parser(
        "scale",
        help="many synthetic workers and several routers on one Redis Cluster",
        description="Synthetic agents speaking the wire contract, router replicas on a "
        "Redis Cluster (three masters with a replica each) started for each point, and "
        "requests through the routers: ingest, apply lag, decision latency, Redis memory "
        "and CPU against the fleet's size.",
    )
    scale.add_argument("--json", type=Path, help="also write the figures here")
    scale.add_argument("--plot", type=Path, help="also draw them in this PNG")
    scale.add_argument(
        "--workers",
        type=_int_list,
        default=[16, 100, 300, 1000],
        help="fleet sizes, comma-separated",
    )
    scale.add_argument(
        "--routers", type=_int_list, default=[1, 2, 4], help="router replicas, comma-separated"
    )
    scale.add_argument(
        "--duration", type=_positive, default=20.0, help="seconds of each measured phase"
    )
    scale.add_argument(
        "--batches-per-s",
        type=_positive,
        default=1.0,
        help="event batches a second per worker (a finished request's blocks each)",
    )
    scale.add_argument("--capacity-blocks", type=int, default=2048, help="blocks per worker")
    scale.add_argument("--request-blocks", type=int, default=64, help="blocks per request")
    scale.add_argument(
        "--request-rate", type=_positive, default=50.0, help="requests a second, all routers"
    )
    scale.add_argument(
        "--faults",
        action="store_true",
        help="at each point, kill the busiest Redis master, then restart a router, each "
        "under --duration seconds of load: failover and recovery timings, and an audit of "
        "the index against the workers' caches (instead of the steady phases)",
    )
    scale.add_argument(
        "--directory",
        action="store_true",
        help="the index's groups keep directories (index.redis_directory)",
    )
    _add_groups_option(scale, "--groups")
    scale.set_defaults(handler=_run_bench_scale)
    return parser


def main(argv: Sequence[str], prog: str = "kvplane bench") -> int:
    args = build_parser(prog).parse_args(argv)
    result: int = args.handler(args)
    return result
