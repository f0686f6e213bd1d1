"""`kvplane sim` (compare routing policies on a simulated fleet) and `kvplane plan`
(KV cache per replica from a model's config): their command lines."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

_T = TypeVar("_T")


def _workload(
    args: argparse.Namespace,
    workload_args: dict[str, object],
    *,
    speedup: float = 1.0,
    limit: int | None = None,
) -> Any:
    """The trace (`--trace`), generated workload (`--workload`, its arguments) or live
    bake-off's workload (`--live`, its arguments)."""
    from simulations.fleet_sim.live_shapes import live_workload
    from simulations.fleet_sim.workloads import WORKLOADS, load_trace

    if args.trace is not None:
        return load_trace(args.trace, speedup=speedup, limit=limit)
    if getattr(args, "live", None) is not None:
        live_args: dict[str, Any] = dict(workload_args)
        return live_workload(args.live, seed=getattr(args, "seed", 0), **live_args)
    if args.workload not in WORKLOADS:
        raise ValueError(f"unknown workload {args.workload!r} ({', '.join(sorted(WORKLOADS))})")
    return WORKLOADS[args.workload](seed=getattr(args, "seed", 0), **workload_args)


def _sim_inputs(args: argparse.Namespace, setting: tuple[str, float] | None = None) -> Any:
    """The workload and fleet of a `kvplane sim` run, with one setting changed (a
    sweep's point): `workers`, `capacity_tokens`, `cpu_offload_blocks`, `speedup` (a
    trace) or any parameter of a generated workload."""
    from simulations.engine_sim.scheduler import SchedulerLimits
    from simulations.engine_sim.timing import TimingModel
    from simulations.fleet_sim import live_shapes
    from simulations.fleet_sim.roofline import read_roofline_timing
    from simulations.fleet_sim.simulator import FleetConfig

    live = args.live is not None
    fleet = {
        "workers": args.workers or (live_shapes.LIVE_ENGINES if live else 10),
        "capacity_tokens": args.capacity_tokens
        or (live_shapes.live_capacity_tokens() if live else 3_000_000),
        "cpu_offload_blocks": args.cpu_offload_blocks,
    }
    max_num_seqs = args.max_num_seqs or (
        live_shapes.LIVE_MAX_NUM_SEQS if live else SchedulerLimits().max_num_seqs
    )
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
    overheads_ms = dict(live_shapes.LIVE_ROUTER_OVERHEAD_MS) if args.live_router_overheads else {}
    overheads_ms.update(args.router_overhead_ms)
    if args.time_scale != 1.0:
        timing = dataclasses.replace(
            timing,
            **{
                f.name: getattr(timing, f.name) * args.time_scale
                for f in dataclasses.fields(timing)
            },
        )
    default = FleetConfig()
    config = FleetConfig(
        workers=fleet["workers"],
        capacity_tokens=fleet["capacity_tokens"],
        timing=timing,
        limits=SchedulerLimits(max_num_seqs=max_num_seqs),
        event_delay_s=args.event_delay_s,
        load_interval_s=args.load_interval_s,
        load_delay_s=args.load_delay_s,
        router_overhead_s={name: ms / 1000 for name, ms in overheads_ms.items()},
        cpu_offload_blocks=fleet["cpu_offload_blocks"],
        # A slower fleet copies more slowly too, as the engine simulator's time scale has it.
        kv_offload_bytes_per_s=_given(args.kv_offload_bytes_per_s, default.kv_offload_bytes_per_s)
        / args.time_scale,
        kv_bytes_per_token=_given(args.kv_bytes_per_token, default.kv_bytes_per_token),
    )
    return workload, config


def _given(value: _T | None, default: _T) -> _T:
    """A flag's value, or the default where it was not given."""
    return default if value is None else value


def _run_sim(args: argparse.Namespace) -> int:
    import json

    from kvplane.core.config import ScoringSettings
    from simulations.fleet_sim.policies import POLICIES
    from simulations.fleet_sim.report import as_json, render_sweep, render_table
    from simulations.fleet_sim.run import compare, run_description

    if (args.trace, args.workload, args.live).count(None) != 2:
        print("kvplane sim: give --trace FILE, --workload NAME or --live NAME", file=sys.stderr)
        return 2
    policies = list(POLICIES) if args.policies == "all" else args.policies.split(",")
    unknown = [name for name in policies if name not in POLICIES]
    unknown += [name for name, _ in args.router_overhead_ms if name not in POLICIES]
    if not args.time_scale > 0:
        print("kvplane sim: --time-scale must be positive", file=sys.stderr)
        return 2
    if unknown:
        print(f"kvplane sim: unknown policies {unknown} ({', '.join(POLICIES)})", file=sys.stderr)
        return 2
    points = [None] if args.sweep is None else [(args.sweep[0], v) for v in args.sweep[1]]
    comparisons = []
    try:
        scoring = ScoringSettings.model_validate(dict(args.scoring))
        for point in points:
            workload, config = _sim_inputs(args, point)
            comparisons.append(
                compare(workload, config, policies, seed=args.seed,
                        show_progress=sys.stderr.isatty(), scoring=scoring)
            )  # fmt: skip
    except (TypeError, ValueError) as error:
        print(f"kvplane sim: {error}", file=sys.stderr)
        return 2
    comparison = comparisons[-1]
    description = run_description(workload, config, args.seed)
    if args.sweep is None:
        tier = f" and {config.cpu_offload_blocks:,} CPU blocks" if config.cpu_offload_blocks else ""
        print(
            f"{workload.name}: {len(workload.requests):,} requests, {config.workers} workers "
            f"of {config.capacity_tokens:,} tokens{tier}, seed {args.seed}"
        )
        print(render_table(comparison.results, comparison.bounds))
        seconds = ", ".join(f"{k} {v:.1f} s" for k, v in comparison.seconds.items())
        print(f"wall time per policy: {seconds}")
    else:
        key, values = args.sweep
        print(f"{workload.name}: sweeping {key} over {', '.join(f'{v:g}' for v in values)}")
        print(render_sweep(key, values, [c.results for c in comparisons], args.slo_ttft_p90))
    if args.plot is not None:
        from simulations.fleet_sim.plots import write_plots

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


def _overhead_arg(text: str) -> tuple[str, float]:
    name, separator, raw = text.partition("=")
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not separator or not name or not ms >= 0:
        raise argparse.ArgumentTypeError(f"expected POLICY=MILLISECONDS, got {text!r}")
    return name, ms


def _run_plan(args: argparse.Namespace) -> int:
    from simulations.fleet_sim.plan import Replica, plan, read_model_shape

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


def workload_arg(text: str) -> tuple[str, object]:
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
    source.add_argument("--live", metavar="NAME",
                        help="a workload of `kvplane bench live` (shared-N, multi-turn, "
                        "agent-tree) on its fleet: 4 workers of 512 blocks of 16 tokens, "
                        "max_num_seqs 16; "
                        "--workload-arg rate_per_s=15 duration_s=15 by default")  # fmt: skip
    parser.add_argument(
        "--workload-arg", type=workload_arg, action="append", default=[], metavar="KEY=VALUE",
        help="a parameter of the generated workload (repeatable), e.g. groups=32",
    )  # fmt: skip
    parser.add_argument(
        "--scoring", type=workload_arg, action="append", default=[], metavar="KEY=VALUE",
        help="one of kvplane's [scoring] weights for its policies (repeatable), e.g. "
        "host_bandwidth_bytes_per_s=0",
    )  # fmt: skip
    parser.add_argument("--limit", type=int, help="replay only the first N requests of a trace")
    parser.add_argument("--speedup", type=float, default=1.0, help="replay a trace N times faster")
    parser.add_argument("--workers", type=int, help="engine replicas (default 10; --live: 4)")
    parser.add_argument("--capacity-tokens", type=int,
                        help="KV cache per worker, in tokens (default 3,000,000; --live: "
                        "8,192)")  # fmt: skip
    parser.add_argument("--cpu-offload-blocks", type=int, default=0,
                        help="a CPU tier of this many blocks behind each worker's cache, "
                        "as the engine simulator's (vLLM's native CPU offloading; default 0: "
                        "none)")  # fmt: skip
    parser.add_argument("--kv-offload-bytes-per-s", type=float,
                        help="bandwidth of the copies between device and CPU blocks, both "
                        "ways (default 20e9, the engine simulator's)")  # fmt: skip
    parser.add_argument("--kv-bytes-per-token", type=int,
                        help="the model's KV bytes per token, the copies' size (default "
                        "131072, the engine simulator's: an 8B model in fp16)")  # fmt: skip
    parser.add_argument("--max-num-seqs", type=int,
                        help="most requests running at once on a worker (default 256; "
                        "--live: 16)")  # fmt: skip
    parser.add_argument(
        "--policies", default="all", help="comma-separated, or all (default): "
        "random, round-robin, least-loaded, kvplane",
    )  # fmt: skip
    parser.add_argument(
        "--router-overhead-ms", type=_overhead_arg, action="append", default=[],
        metavar="POLICY=MS",
        help="time the router costs each request of this policy before its worker has it, "
        "counted in its TTFT (repeatable; default 0 for every policy)",
    )  # fmt: skip
    parser.add_argument(
        "--live-router-overheads", action="store_true",
        help="the overheads measured in `kvplane bench live`: kvplane and round-robin "
        "(kvplane's proxy) 25 ms, sglang-cache-aware and vllm-router-cache-aware 5 ms "
        "(--router-overhead-ms overrides one)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--plot", type=Path, help="write PNG charts into this directory")
    parser.add_argument(
        "--sweep", type=_sweep_arg, metavar="KEY=V1,V2,...",
        help="run once per value of workers, capacity_tokens, cpu_offload_blocks, speedup "
        "or a workload parameter (e.g. workers=4,6,8 or rate_per_s=2,4,8)",
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
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply every modelled step duration (as the engine "
                        "simulator's --time-scale does): a slower fleet (default 1)")  # fmt: skip
    parser.add_argument("--gpu", default="h100", help="with --model-config: a100, h100, h200")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="with --model-config: GPUs per worker (default 1)")  # fmt: skip


def build_sim_parser(prog: str = "kvplane sim") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="The fleet simulator: replay a trace or a generated workload through "
        "each policy on the same fleet of simulated engines (docs/simulation.md).",
    )
    _add_sim_flags(parser)
    return parser


def sim_main(argv: Sequence[str], prog: str = "kvplane sim") -> int:
    return _run_sim(build_sim_parser(prog).parse_args(argv))


def build_plan_parser(prog: str = "kvplane plan") -> argparse.ArgumentParser:
    planner = argparse.ArgumentParser(
        prog=prog,
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
    planner.add_argument("--workload-arg", type=workload_arg, action="append", default=[],
                         metavar="KEY=VALUE")  # fmt: skip
    return planner


def plan_main(argv: Sequence[str], prog: str = "kvplane plan") -> int:
    return _run_plan(build_plan_parser(prog).parse_args(argv))
