"""What the bake-off runs: cells of router x workload x load x situation x repeat, and
the profiles that pick them (`quick`, the default grid, `full`).

Situations are where a router that guesses from its own decisions should go wrong and
one that reads engine events should not:
- `steady`: nothing happens but the traffic;
- `two-replicas`: two replicas of the router, the client alternating between them
  (kvplane's share an index in Redis; a peer's replicas each keep their own);
- `engine-restart`: one engine restarts (cache emptied, nothing announced) halfway;
- `eviction`: a working set about three times the fleet's cache, a few prompts hot and
  a long tail (`zipf-96`), for twice the profile's traffic;
- `bypass`: a quarter of the conversations reach the engines around the router.

One about flow control under saturation:
- `noisy-tenant`: the fleet's sustainable rate C measured first (`capacity.py`), then
  four well-behaved tenants at 0.15 C each and a noisy one at eight times that in 20 s
  bursts, its requests of the same shape (`noisy-same`) or four times longer and fewer
  (`noisy-long`), and the well-behaved tenants alone (`noisy-solo`, their reference);
  kvplane with flow control (as one router and as two replicas), without it, and the
  cache-aware peers; and three tenants flooding with shares 2:1:1 on kvplane with flow
  control (`shares-2-1-1`). Its engines run the timing model `NOISY_TIME_SCALE` times
  slower, so that the fleet, not the 2-core machine, is what saturates, and in vLLM's
  priority scheduling, labelled so for kvplane's agents (a router that sends no
  priority, as the peers and kvplane without flow control, has them first come, first
  served).

And one where the fleet itself changes:
- `pd`: prefill/decode disaggregation, on long shared prompts and on chats
  (`PD_WORKLOADS`), with the same requests on three fleets of four engines:
  - two prefill and two decode engines (vLLM's NixlConnector): kvplane splitting where
    it pays and always, and vllm-router's P/D mode (its reference, `PD_FLEET_REFERENCES`):
    whose splitting pays more;
  - four engines each with NixlConnector and no pool named (`pd-both`), any of them
    taking either leg or a whole request: kvplane splitting where it pays, always, and
    never (that fleet's aggregated reference): whether splitting pays on one fleet;
  - the usual four engines, no connector, under `kvplane kvplane`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from benchmarks.live.engines import FLEET_BOTH, FLEET_PD, EngineShape
from benchmarks.live.routers import (
    ENVOY_FAMILIES,
    FLOW_ROUTERS,
    PD_ROUTERS,
    ROUTERS,
    TIER_ROUTERS,
    RouterSpec,
)
from benchmarks.live.workloads import NOISY_WORKLOADS, SHARES_WORKLOAD

# Offered load, in requests per second: light; medium; heavy, about where four engines
# with the default timing model (about 12k prefill tokens/s each) saturate when they
# recompute most of each 2,176-token shared-prompt request, as round-robin makes them.
LOADS: dict[str, float] = {"light": 5.0, "moderate": 8.0, "medium": 15.0, "heavy": 30.0}
SITUATIONS = (
    "steady",
    "two-replicas",
    "engine-restart",
    "eviction",
    "eviction-cpu",
    "bypass",
    "pd",
    "noisy-tenant",
)
EVICTION_WORKLOAD = "zipf-96"
# The eviction situations' own load: 8 requests a second for 30 s (240 requests), where
# the caches turn over once or twice in a cell.
EVICTION_LOAD = "moderate"
EVICTION_SITUATIONS = ("eviction", "eviction-cpu")
# eviction-cpu's CPU tier: twice each engine's device cache, so that the fleet's device
# and host memory together about hold the working set.
EVICTION_CPU_BLOCKS = 1024
PD = "pd"
PD_WORKLOADS = ("shared-8", "multi-turn")
PD_PREFILL_ENGINES = 2  # of the fleet's four: two prefill, two decode
PD_AGGREGATED_ROUTER = "kvplane kvplane"  # the pd point's reference on 4 plain engines
# What each P/D fleet's other routers are read against, run by run (the same-fleet
# comparison): vllm-router's P/D mode on the pools, kvplane never splitting on the
# engines that each take either leg.
PD_FLEET_REFERENCES = {FLEET_PD: "vllm-router pd-cache_aware", FLEET_BOTH: "kvplane both-never"}
BYPASS_SHARE = 0.25
NOISY_SITUATION = "noisy-tenant"
# The noisy-tenant situation's load: its workloads' rates are fractions of the fleet's
# sustainable rate C, measured once per sitting (`Cell.capacity_per_s`).
CALIBRATED = "calibrated"
# Its engines' time scale: at the simulator's own pace four engines sustain about 80
# requests a second of the situation's shape on the 2-core machine, and that is the
# machine's CPU saturating (both cores busy), not the engines; 8 times slower (about
# 1,500 prefill tokens a second, 64 ms decode steps: a large model's pace) they sustain
# about 20, with CPU to spare for a flood of twice that.
NOISY_TIME_SCALE = 8.0
# The flood's cells (the well-behaved tenants alone, then each variant), kept together
# as one point: each router's solo run is its flood runs' reference, measured beside
# them in one spell of the machine.
NOISY_POINT = "noisy"
LONGER_WORKLOADS: dict[str, float] = {
    "mooncake": 3.0,
    EVICTION_WORKLOAD: 2.0,
    **dict.fromkeys((*NOISY_WORKLOADS, SHARES_WORKLOAD), 50 / 15),
}
"""Workloads whose cells run this many times the profile's traffic, at the same rate.
The Mooncake sample's reuse is thin and a few of its prompts fill a whole engine's
cache: in 15 s (about 225 requests) one router's hit rate swung 22-47% from run to run,
in 45 s (about 680) it stays within two points. The eviction workload's cache takes
most of 15 s to fill, and its hit rate is read once it has turned over. The noisy
tenant's workloads run 50 s at the profile's 15: two 20 s bursts and a rest between."""


def traffic_seconds(profile_duration_s: float, workload: str) -> float:
    """How long a cell of `workload` sends traffic in a profile of `profile_duration_s`
    (to the millisecond: 15 s x 50/15 is 50 s, not a hair over)."""
    return round(profile_duration_s * LONGER_WORKLOADS.get(workload, 1.0), 3)


def cell_key(router: str, workload: str, load: str, situation: str, run: int) -> str:
    """A cell's name: what `--only` matches and what a resumed run recognises."""
    return " | ".join((router, workload, load, situation, f"run {run}"))


@dataclass(frozen=True, slots=True)
class Cell:
    router: RouterSpec
    workload: str
    load: str
    situation: str
    run: int
    # C, the fleet's sustainable rate, for a `CALIBRATED` load (NaN until measured); not
    # part of what the cell is.
    capacity_per_s: float = field(default=math.nan, compare=False)

    @property
    def rate_per_s(self) -> float:
        """The load's rate; for a calibrated load, C, its workloads' rates' unit."""
        return self.capacity_per_s if self.load == CALIBRATED else LOADS[self.load]

    @property
    def replicas(self) -> int:
        return 2 if self.situation == "two-replicas" else self.router.replicas

    @property
    def key(self) -> str:
        return cell_key(self.router.name, self.workload, self.load, self.situation, self.run)

    @property
    def point(self) -> tuple[str, str, str]:
        """What runs as one (and is resumed whole): every router and run of a workload,
        situation and load, or of the noisy tenant's flood and its reference."""
        workload = NOISY_POINT if self.workload in NOISY_WORKLOADS else self.workload
        return (workload, self.situation, self.load)

    def shape(self, base: EngineShape) -> EngineShape:
        """The cell's engines: `base`, with a CPU tier in `eviction-cpu`, slower and
        in priority scheduling in `noisy-tenant`, split into prefill and decode pools
        for a router in front of those, every engine with a connector and no pool for
        one in front of the `pd-both` fleet."""
        if self.situation == "eviction-cpu":
            return replace(base, cpu_offload_blocks=EVICTION_CPU_BLOCKS)
        if self.situation == NOISY_SITUATION:
            return replace(base, time_scale=NOISY_TIME_SCALE, priority_scheduling=True)
        if self.router.fleet == FLEET_PD:
            return replace(base, prefill_engines=PD_PREFILL_ENGINES)
        if self.router.fleet == FLEET_BOTH:
            return replace(base, prefill_engines=0, kv_both=True)
        return base


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    duration_s: float
    runs: int
    steady_workloads: tuple[str, ...]
    steady_loads: tuple[str, ...]
    situations: tuple[str, ...]
    situation_workload: str
    situation_load: str
    situation_routers: str  # "cache-aware" or "all"


PROFILES: dict[str, Profile] = {
    "quick": Profile("quick", 6.0, 1, ("shared-4",), ("light",), (), "shared-4", "light", "all"),
    "default": Profile(
        "default",
        15.0,
        2,
        ("shared-8", "multi-turn"),
        ("medium",),
        ("two-replicas", "engine-restart"),
        "shared-8",
        "medium",
        "cache-aware",
    ),
    "full": Profile(
        "full",
        15.0,
        2,
        ("shared-8", "shared-16", "multi-turn", "multi-tenant", "agent-tree", "mooncake"),
        ("light", "medium", "heavy"),
        ("two-replicas", "engine-restart", *EVICTION_SITUATIONS, "bypass", PD, NOISY_SITUATION),
        "shared-8",
        "medium",
        "all",
    ),
}


def _cache_aware(router: RouterSpec) -> bool:
    """Whether the router routes by the cache (the situations are for those): not round
    robin, nor the trivial picker (the floor under kvplane's, on steady load only)."""
    return router.policy not in ("round-robin", "round_robin", "trivial-picker")


def _situation_routers(
    profile: Profile,
    situation: str,
    routers: Sequence[RouterSpec],
    pd_routers: Sequence[RouterSpec],
    tier_routers: Sequence[RouterSpec],
) -> list[RouterSpec]:
    """The routers a point of `situation` runs: for `pd`, the P/D routers and kvplane's
    aggregated reference; for the others, the aggregated routers (the cache-aware ones
    only, where the profile says so), and in `eviction-cpu` kvplane without its tier
    credit too."""
    if situation == PD:
        return [
            *(router for router in routers if router.name == PD_AGGREGATED_ROUTER),
            *pd_routers,
        ]
    chosen = [
        router
        for router in routers
        if situation == "steady" or profile.situation_routers == "all" or _cache_aware(router)
    ]
    return chosen + list(tier_routers) if situation == "eviction-cpu" else chosen


def noisy_tenant_routers(
    routers: Sequence[RouterSpec], flow_routers: Sequence[RouterSpec]
) -> list[RouterSpec]:
    """The noisy-tenant flood's routers: kvplane with flow control (`flow_routers`),
    kvplane without it, and the cache-aware peers, as they are (none of them shares a
    band between tenants: SMG's priority classes would need telling who is noisy)."""
    return [
        *flow_routers,
        *(
            router
            for router in routers
            if _cache_aware(router)
            and router.family not in ENVOY_FAMILIES
            and (router.family != "kvplane" or router.policy == "kvplane")
        ),
    ]


def _noisy_tenant_cells(
    runs: int, routers: Sequence[RouterSpec], flow_routers: Sequence[RouterSpec]
) -> list[Cell]:
    """The flood's point, run by run: each router's solo run, then its runs of each
    variant, so that a router's flood and its reference share a spell of the machine;
    then the shares point, on kvplane with flow control alone."""
    flood = [
        Cell(router, workload, CALIBRATED, NOISY_SITUATION, run)
        for run in range(1, runs + 1)
        for router in noisy_tenant_routers(routers, flow_routers)
        for workload in NOISY_WORKLOADS
    ]
    shares = [
        Cell(router, SHARES_WORKLOAD, CALIBRATED, NOISY_SITUATION, run)
        for run in range(1, runs + 1)
        for router in flow_routers
    ]
    return flood + shares


def cells(
    profile: Profile,
    routers: Sequence[RouterSpec] = ROUTERS,
    pd_routers: Sequence[RouterSpec] = PD_ROUTERS,
    tier_routers: Sequence[RouterSpec] = TIER_ROUTERS,
    flow_routers: Sequence[RouterSpec] = FLOW_ROUTERS,
) -> list[Cell]:
    """Every cell of the profile, point by point (so a run cut short leaves whole
    points); within a point every router's first run, then every router's second, so
    that a slow spell of the machine does not fall on one router's runs only."""
    points = [
        (workload, load, "steady")
        for workload in profile.steady_workloads
        for load in profile.steady_loads
    ]
    situated: list[Cell] = []
    for situation in profile.situations:
        if situation == PD:
            points += [(workload, profile.situation_load, PD) for workload in PD_WORKLOADS]
            continue
        if situation == NOISY_SITUATION:
            situated = _noisy_tenant_cells(profile.runs, routers, flow_routers)
            continue
        if situation in EVICTION_SITUATIONS:
            points.append((EVICTION_WORKLOAD, EVICTION_LOAD, situation))
        else:
            points.append((profile.situation_workload, profile.situation_load, situation))
    result = []
    for workload, load, situation in points:
        chosen = _situation_routers(profile, situation, routers, pd_routers, tier_routers)
        for run in range(1, profile.runs + 1):
            result += [Cell(router, workload, load, situation, run) for router in chosen]
    return result + situated


def select(all_cells: Sequence[Cell], only: Sequence[Sequence[str]]) -> list[Cell]:
    """The cells that some filter of `only` picks (all of them when there is none): a
    filter picks a cell when the cell's key contains every one of its terms, ignoring
    case (`["kvplane", "shared-8"]`: kvplane's routers on shared-8)."""
    if not only:
        return list(all_cells)
    filters = [[term.lower() for term in terms] for terms in only]
    return [
        cell
        for cell in all_cells
        if any(all(term in cell.key.lower() for term in terms) for terms in filters)
    ]
