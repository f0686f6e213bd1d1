"""Workloads for the fleet simulator: two real traces and five generators.

Every workload is a `Workload` of `TraceRequest`s (see `requests.py`): prompts as chains
of prefix block ids, where an id names the whole prefix up to and including its block.

Real traces (read as they are; see ../shared/traces/README.md):

- `load_mooncake`: the Mooncake FAST'25 conversation trace (12,031 requests over 3,537 s,
  512-token blocks, `hash_ids` already in the prefix-chain convention). The one trace here
  with real prefix sharing; its published reuse ceilings are checked in `bounds.py`.
- `load_azure`: the Azure 2023 (Splitwise) traces, arrival times and lengths only. They
  carry no prefix information, so every request gets fresh block ids and nothing is ever
  shared: they test load behaviour (queueing, balance, capacity), never cache affinity.

Generators (deterministic for a seed; block ids are 63-bit ints from BLAKE2b over the
parent id and the block's contents, see `PrefixChain`, so equal ids mean equal
prefixes and distinct prefixes get distinct ids):

- `shared_prefix`: SGLang's `generated-shared-prefix` benchmark (defaults as published
  for SGLang v0.4's cache-aware router, ../shared/reference/peer-routers.md): 64 groups
  x 16 prompts, a 2,048-token system prompt per group followed by a 128-token question,
  256 output tokens, all sent at t=0 in shuffled order (or Poisson at `rate_per_s`;
  with `duration_s` too, Poisson over that many seconds, each request from a group
  drawn at random, as `kvplane bench live` sends them; `popularity` > 0 draws the
  groups by a Zipf law of that exponent instead of uniformly: `group_drawer`).
- `llmd_prefix`: llm-d's precise-prefix-cache benchmark (its Sep 2025 blog, same
  reference): 150 groups x 5 users, a 6,000-token group prefix, a 1,200-token question,
  1,000 output tokens, Poisson arrivals whose rate ramps linearly from 3 to 60 req/s.
  Each user keeps one question (the benchmark tool, inference-perf's shared-prefix
  generator, pre-generates one prompt per group and user and sends those again and
  again; the reference's "prefixes need about 73% of the fleet's KV capacity" is exactly
  150 x 6,000 + 750 x 1,200 = 1.8M tokens of 8 x 307,328). `new_question_per_request`
  gives every request its own question instead. The blog does not give the ramp's
  length; `duration_s` defaults to 600 s (about 18,900 requests).
- `multi_turn`: chat sessions. Turn k's prompt is turn k-1's prompt, its output and the
  new user turn, so prefixes grow turn by turn; all sessions share one system prompt.
  Sessions start as Poisson arrivals; the turns of a session are separated by
  exponential think times measured from the previous turn's arrival (open loop: choose
  a think time longer than the latency you expect), or with `closed_loop` from the end
  of the previous turn's response (the simulator sends the turn then, as a chat client
  does). Defaults are illustrative, not from a published benchmark.
- `agent_tree`: agent runs branching from a common trunk: each tree's root request is
  its trunk (task, tools, documents); every request at depth < `depth` has `branches`
  children, each one its parent's prompt + the parent's output + a new step (a tool
  result, a sampled alternative). Trees start as Poisson arrivals; a child arrives an
  exponential step time after its parent. Defaults are illustrative.
- `multi_tenant`: shared-prefix groups owned by tenants (the `tenant` field set), Poisson
  arrivals. Tenants never share cache: every tenant's chains are salted with its name
  (like vLLM's `cache_salt`), so the same system prompt text used by two tenants still
  gets different block ids (`shared_system_text`, on by default, makes that case occur).
  Defaults are illustrative.

Arrival helpers: `poisson_arrivals` (fixed rate) and `ramp_arrivals` (rate ramped
linearly over a duration, an inhomogeneous Poisson process by inversion).
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from simulations.fleet_sim.requests import TraceRequest, Workload

MOONCAKE_BLOCK_TOKENS = 512
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

Piece = tuple[str, int, int]  # (segment key, first token, end token) within that segment


def _digest(parent: int, pieces: tuple[Piece, ...]) -> int:
    data = repr((parent, pieces)).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") >> 1


@dataclass(frozen=True, slots=True)
class PrefixChain:
    """A token sequence as prefix-chain block ids, built segment by segment.

    A segment is a run of tokens named by a key that stands for its contents (two
    segments with the same key are the same text). A block's id is a digest of its
    parent's id and the pieces of segments that fill it, so two chains share a block id
    exactly when they agree on every token up to the end of that block. A partial last
    block gets an id from its pieces too: it differs from any longer block at the same
    place, as a block of different contents should. `salt` starts the chain from a
    different root, so equal texts under different salts never share a block.
    """

    block_tokens: int
    root: int = 0
    full: tuple[int, ...] = ()
    tail: tuple[Piece, ...] = ()
    tail_tokens: int = 0

    @classmethod
    def start(cls, block_tokens: int, salt: str = "") -> PrefixChain:
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        root = _digest(-1, ((salt, 0, 0),)) if salt else 0
        return cls(block_tokens, root)

    @property
    def tokens(self) -> int:
        return len(self.full) * self.block_tokens + self.tail_tokens

    def extend(self, key: str, tokens: int) -> PrefixChain:
        """This chain followed by `tokens` tokens of the segment `key`."""
        size = self.block_tokens
        full = list(self.full)
        tail = list(self.tail)
        fill = self.tail_tokens
        parent = full[-1] if full else self.root
        offset = 0
        while offset < tokens:
            take = min(size - fill, tokens - offset)
            tail.append((key, offset, offset + take))
            fill += take
            offset += take
            if fill == size:
                parent = _digest(parent, tuple(tail))
                full.append(parent)
                tail = []
                fill = 0
        return PrefixChain(size, self.root, tuple(full), tuple(tail), fill)

    def blocks(self) -> tuple[int, ...]:
        """One id per (possibly partial) block of the sequence so far."""
        if not self.tail:
            return self.full
        parent = self.full[-1] if self.full else self.root
        return (*self.full, _digest(parent, self.tail))


# Arrival processes ------------------------------------------------------------------


def poisson_arrivals(
    rng: random.Random, rate_per_s: float, count: int, *, start_s: float = 0.0
) -> list[float]:
    """`count` arrival times of a Poisson process at `rate_per_s`, after `start_s`."""
    if rate_per_s <= 0:
        raise ValueError("rate_per_s must be positive")
    times: list[float] = []
    now = start_s
    for _ in range(count):
        now += rng.expovariate(rate_per_s)
        times.append(now)
    return times


def ramp_arrivals(
    rng: random.Random, rate_start: float, rate_end: float, duration_s: float
) -> list[float]:
    """Poisson arrivals over [0, duration_s) whose rate goes linearly from start to end.

    Inversion of the cumulative rate L(t) = a t + (b - a) t^2 / (2 D): unit-rate Poisson
    points s map to the t with L(t) = s.
    """
    if rate_start < 0 or rate_end < 0 or rate_start + rate_end <= 0:
        raise ValueError("rates must be non-negative and not both zero")
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")
    a = rate_start
    slope = (rate_end - rate_start) / duration_s
    total = a * duration_s + slope * duration_s * duration_s / 2
    times: list[float] = []
    mass = rng.expovariate(1.0)
    while mass < total:
        # Root of slope/2 t^2 + a t - mass = 0 in the form stable for slope near 0.
        times.append(2 * mass / (a + math.sqrt(max(a * a + 2 * slope * mass, 0.0))))
        mass += rng.expovariate(1.0)
    return times


# Assembling workloads ----------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class _Draft:
    arrival_s: float  # a follower's: its parent's + after_s, the earliest it can arrive
    blocks: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int
    tenant: str = ""
    parent: _Draft | None = None  # closed loop: sent after_s after the parent's response
    after_s: float = 0.0


def group_drawer(rng: random.Random, groups: int, popularity: float) -> Callable[[], int]:
    """Draws a group number in [0, groups): uniformly for `popularity` 0, else by a Zipf
    law of that exponent (group k drawn with weight 1 / (k + 1) ** popularity), the
    skew of real system-prompt and document reuse."""
    if popularity < 0:
        raise ValueError("popularity must not be negative")
    if popularity == 0:
        return lambda: rng.randrange(groups)
    cumulative = list(itertools.accumulate(1.0 / (k + 1) ** popularity for k in range(groups)))
    population = range(groups)
    return lambda: rng.choices(population, cum_weights=cumulative)[0]


def _workload(name: str, block_tokens: int, drafts: Iterable[_Draft]) -> Workload:
    """Requests sorted by arrival (stable), numbered in that order; a follower names
    its parent by the parent's number (a parent always sorts before its followers)."""
    ordered = sorted(drafts, key=lambda d: d.arrival_s)
    number = {id(d): i for i, d in enumerate(ordered)}
    return Workload(
        name=name,
        block_tokens=block_tokens,
        requests=tuple(
            TraceRequest(
                request_id=i,
                arrival_s=d.arrival_s,
                blocks=d.blocks,
                prompt_tokens=d.prompt_tokens,
                output_tokens=d.output_tokens,
                tenant=d.tenant,
                follows=None if d.parent is None else number[id(d.parent)],
                after_s=d.after_s,
            )
            for i, d in enumerate(ordered)
        ),
    )


def _positive(**values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive")


def _arrivals(rng: random.Random, rate_per_s: float | None, count: int) -> list[float]:
    return [0.0] * count if rate_per_s is None else poisson_arrivals(rng, rate_per_s, count)


# Real traces -------------------------------------------------------------------------


def _take(limit: int | None) -> int:
    if limit is not None and limit < 0:
        raise ValueError("limit must be non-negative")
    return -1 if limit is None else limit


def load_mooncake(path: Path, *, speedup: float = 1.0, limit: int | None = None) -> Workload:
    """The Mooncake trace at `path` (JSON lines), arrivals compressed by `speedup`.

    Errors name the line number and numbers only, never the line's contents.
    """
    _positive(speedup=speedup)
    remaining = _take(limit)
    size = MOONCAKE_BLOCK_TOKENS
    drafts: list[_Draft] = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if remaining == 0:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                timestamp = record["timestamp"]
                input_length = record["input_length"]
                output_length = record["output_length"]
                hash_ids = record["hash_ids"]
                valid = (
                    isinstance(timestamp, int | float)
                    and isinstance(input_length, int)
                    and isinstance(output_length, int)
                    and isinstance(hash_ids, list)
                    and all(isinstance(h, int) for h in hash_ids)
                )
            except (ValueError, KeyError, TypeError):
                valid = False
            if not valid:
                raise ValueError(
                    f"{path.name} line {number}: not a Mooncake record (an object with "
                    "numeric timestamp, input_length, output_length and integer hash_ids)"
                )
            if input_length < 1 or timestamp < 0:
                raise ValueError(f"{path.name} line {number}: input_length < 1 or timestamp < 0")
            expected = -(-input_length // size)
            if len(hash_ids) != expected:
                raise ValueError(
                    f"{path.name} line {number}: {len(hash_ids)} hash ids for input_length "
                    f"{input_length}, expected {expected} ({size}-token blocks)"
                )
            drafts.append(
                _Draft(
                    arrival_s=timestamp / 1000 / speedup,
                    blocks=tuple(hash_ids),
                    prompt_tokens=input_length,
                    output_tokens=max(1, output_length),
                )
            )
            remaining -= 1
    return _workload(f"mooncake/{path.stem}", size, drafts)


def load_azure(
    path: Path,
    *,
    block_tokens: int = 16,
    speedup: float = 1.0,
    limit: int | None = None,
    seed: int = 0,
) -> Workload:
    """An Azure 2023 trace (CSV) at `path`: arrivals and lengths, no prefix sharing.

    Arrivals are TIMESTAMP relative to the first row, divided by `speedup`. The trace
    has no content, so every block gets a fresh id (consecutive ints from `seed << 32`)
    and no two requests share a block: the workload tests load behaviour only.
    """
    _positive(speedup=speedup, block_tokens=block_tokens)
    if seed < 0:
        raise ValueError("seed must be non-negative")
    remaining = _take(limit)
    next_id = seed << 32
    first: datetime | None = None
    drafts: list[_Draft] = []
    with path.open(encoding="utf-8", newline="") as handle:
        rows = csv.reader(handle)
        header = next(rows, None)
        if header is None or tuple(h.strip() for h in header) != AZURE_HEADER:
            raise ValueError(f"{path.name} line 1: expected the header {','.join(AZURE_HEADER)}")
        for number, row in enumerate(rows, start=2):
            if remaining == 0:
                break
            if not row:
                continue
            try:
                stamp = datetime.fromisoformat(row[0].strip())
                context = int(row[1])
                generated = int(row[2])
                valid = len(row) == 3 and context >= 1 and generated >= 0
            except (ValueError, IndexError):
                valid = False
            if not valid:
                raise ValueError(
                    f"{path.name} line {number}: expected a timestamp, ContextTokens >= 1 "
                    "and GeneratedTokens >= 0"
                )
            if first is None:
                first = stamp
            count = -(-context // block_tokens)
            drafts.append(
                _Draft(
                    arrival_s=(stamp - first).total_seconds() / speedup,
                    blocks=tuple(range(next_id, next_id + count)),
                    prompt_tokens=context,
                    output_tokens=max(1, generated),
                )
            )
            next_id += count
            remaining -= 1
    return _workload(f"azure/{path.stem}", block_tokens, drafts)


def load_trace(path: Path, *, speedup: float = 1.0, limit: int | None = None) -> Workload:
    """A trace file, its format told by its name and first line (Mooncake or Azure)."""
    with path.open(encoding="utf-8") as handle:
        first = next((line for line in handle if line.strip()), "")
    if path.suffix == ".jsonl":
        try:
            record = json.loads(first)
        except ValueError:
            record = None
        if isinstance(record, dict) and "hash_ids" in record:
            return load_mooncake(path, speedup=speedup, limit=limit)
    if path.suffix == ".csv" and first.startswith("TIMESTAMP"):
        return load_azure(path, speedup=speedup, limit=limit)
    raise ValueError(
        f"{path.name}: unknown trace format (expected Mooncake JSON lines with hash_ids, "
        "or an Azure CSV with a TIMESTAMP header)"
    )


# Generators --------------------------------------------------------------------------


def shared_prefix(
    groups: int = 64,
    prompts_per_group: int = 16,
    system_tokens: int = 2048,
    question_tokens: int = 128,
    output_tokens: int = 256,
    block_tokens: int = 64,
    rate_per_s: float | None = None,
    seed: int = 0,
    duration_s: float | None = None,
    popularity: float = 0.0,
) -> Workload:
    """SGLang's generated-shared-prefix: each prompt is its group's system prompt + a question.

    All requests arrive at t=0 (as SGLang sends them) unless `rate_per_s` is given, then
    as a Poisson process; the order of prompts is shuffled with `seed`. With
    `duration_s` too, requests arrive as a Poisson process at `rate_per_s` over
    `duration_s` seconds, however many that makes, each from a group drawn at random
    (by `group_drawer` with `popularity`) with its own question (as `kvplane bench live`
    sends them; `prompts_per_group` is then unused).
    """
    _positive(groups=groups, prompts_per_group=prompts_per_group, system_tokens=system_tokens)
    _positive(question_tokens=question_tokens, output_tokens=output_tokens)
    rng = random.Random(seed)
    ns = f"shared-prefix/{seed}"
    systems = [
        PrefixChain.start(block_tokens).extend(f"{ns}/g{g}/system", system_tokens)
        for g in range(groups)
    ]
    prompts: list[PrefixChain] = []
    if duration_s is None:
        for g, system in enumerate(systems):
            prompts.extend(
                system.extend(f"{ns}/g{g}/q{p}", question_tokens) for p in range(prompts_per_group)
            )
        rng.shuffle(prompts)
        arrivals = _arrivals(rng, rate_per_s, len(prompts))
    else:
        if rate_per_s is None:
            raise ValueError("duration_s needs rate_per_s")
        arrivals = ramp_arrivals(rng, rate_per_s, rate_per_s, duration_s)
        draw_group = group_drawer(rng, groups, popularity)
        for i in range(len(arrivals)):
            g = draw_group()
            prompts.append(systems[g].extend(f"{ns}/g{g}/r{i}", question_tokens))
    return _workload(
        "shared-prefix",
        block_tokens,
        (
            _Draft(t, chain.blocks(), chain.tokens, output_tokens)
            for t, chain in zip(arrivals, prompts, strict=True)
        ),
    )


def llmd_prefix(
    groups: int = 150,
    users_per_group: int = 5,
    prefix_tokens: int = 6000,
    question_tokens: int = 1200,
    output_tokens: int = 1000,
    block_tokens: int = 64,
    rate_start: float = 3.0,
    rate_end: float = 60.0,
    duration_s: float = 600.0,
    seed: int = 0,
    new_question_per_request: bool = False,
) -> Workload:
    """llm-d's precise-prefix benchmark: group prefix + the user's question, ramped Poisson.

    Each request picks a group and a user uniformly at random. A user asks the same
    question every time (the benchmark's fixed prompts) unless `new_question_per_request`.
    """
    _positive(groups=groups, users_per_group=users_per_group, prefix_tokens=prefix_tokens)
    _positive(question_tokens=question_tokens, output_tokens=output_tokens)
    rng = random.Random(seed)
    ns = f"llmd-prefix/{seed}"
    start = PrefixChain.start(block_tokens)
    prefixes = [start.extend(f"{ns}/g{g}/prefix", prefix_tokens) for g in range(groups)]
    fixed = [
        [prefix.extend(f"{ns}/g{g}/u{u}", question_tokens) for u in range(users_per_group)]
        for g, prefix in enumerate(prefixes)
    ]
    drafts: list[_Draft] = []
    for i, t in enumerate(ramp_arrivals(rng, rate_start, rate_end, duration_s)):
        g = rng.randrange(groups)
        u = rng.randrange(users_per_group)
        if new_question_per_request:
            chain = prefixes[g].extend(f"{ns}/g{g}/u{u}/r{i}", question_tokens)
        else:
            chain = fixed[g][u]
        drafts.append(_Draft(t, chain.blocks(), chain.tokens, output_tokens))
    return _workload("llmd-prefix", block_tokens, drafts)


def multi_turn(
    sessions: int = 200,
    turns: int = 8,
    system_tokens: int = 1024,
    turn_tokens: int = 256,
    output_tokens: int = 256,
    think_time_s: float = 30.0,
    rate_per_s: float = 1.0,
    block_tokens: int = 64,
    seed: int = 0,
    duration_s: float | None = None,
    closed_loop: bool = False,
) -> Workload:
    """Chat sessions whose prompts grow: turn k = turn k-1's prompt + its output + a turn.

    Sessions start at `rate_per_s` (Poisson): `sessions` of them, or with `duration_s`
    as many as start in that many seconds. Each next turn comes an exponential think
    time (mean `think_time_s`) after the previous turn's arrival (open loop), or with
    `closed_loop` after the previous turn's response ends, as a chat client (and
    `kvplane bench live`) sends it. One system prompt for all.
    """
    _positive(sessions=sessions, turns=turns, system_tokens=system_tokens)
    _positive(turn_tokens=turn_tokens, output_tokens=output_tokens, think_time_s=think_time_s)
    rng = random.Random(seed)
    ns = f"multi-turn/{seed}"
    system = PrefixChain.start(block_tokens).extend(f"{ns}/system", system_tokens)
    if duration_s is None:
        starts = poisson_arrivals(rng, rate_per_s, sessions)
    else:
        starts = ramp_arrivals(rng, rate_per_s, rate_per_s, duration_s)
    drafts: list[_Draft] = []
    for s, start_s in enumerate(starts):
        context = system
        t = start_s
        previous: _Draft | None = None
        for k in range(turns):
            think = 0.0
            if k:
                context = context.extend(f"{ns}/s{s}/o{k - 1}", output_tokens)
                think = rng.expovariate(1 / think_time_s)
                t += think
            context = context.extend(f"{ns}/s{s}/u{k}", turn_tokens)
            draft = _Draft(
                t,
                context.blocks(),
                context.tokens,
                output_tokens,
                parent=previous if closed_loop else None,
                after_s=think if closed_loop else 0.0,
            )
            drafts.append(draft)
            previous = draft
    return _workload("multi-turn", block_tokens, drafts)


def agent_tree(
    trees: int = 32,
    branches: int = 3,
    depth: int = 3,
    trunk_tokens: int = 4096,
    step_tokens: int = 512,
    output_tokens: int = 128,
    rate_per_s: float = 1.0,
    block_tokens: int = 64,
    seed: int = 0,
    step_time_s: float = 2.0,
    closed_loop: bool = False,
) -> Workload:
    """Agent runs branching from a common trunk: a tree of requests per run.

    The root request is the trunk; each request above `depth` has `branches` children,
    each its parent's prompt + the parent's output + a new step. 1 + b + ... + b^depth
    requests per tree; children arrive an exponential step time (mean `step_time_s`)
    after their parent's arrival (open loop), or with `closed_loop` after its response
    ends, as an agent (and `kvplane bench live`) sends them; trees start as Poisson
    arrivals at `rate_per_s`.
    """
    _positive(trees=trees, branches=branches, trunk_tokens=trunk_tokens)
    _positive(step_tokens=step_tokens, output_tokens=output_tokens, step_time_s=step_time_s)
    if depth < 0:
        raise ValueError("depth must be non-negative")
    rng = random.Random(seed)
    ns = f"agent-tree/{seed}"
    drafts: list[_Draft] = []
    for tree, start_s in enumerate(poisson_arrivals(rng, rate_per_s, trees)):
        trunk = PrefixChain.start(block_tokens).extend(f"{ns}/t{tree}/trunk", trunk_tokens)
        root = _Draft(start_s, trunk.blocks(), trunk.tokens, output_tokens)
        level: list[tuple[str, PrefixChain, _Draft]] = [(f"{ns}/t{tree}", trunk, root)]
        drafts.append(root)
        for _ in range(depth):
            children: list[tuple[str, PrefixChain, _Draft]] = []
            for name, chain, parent in level:
                after = chain.extend(f"{name}/out", output_tokens)
                for b in range(branches):
                    child = after.extend(f"{name}/{b}/step", step_tokens)
                    step_s = rng.expovariate(1 / step_time_s)
                    draft = _Draft(
                        parent.arrival_s + step_s,
                        child.blocks(),
                        child.tokens,
                        output_tokens,
                        parent=parent if closed_loop else None,
                        after_s=step_s if closed_loop else 0.0,
                    )
                    children.append((f"{name}/{b}", child, draft))
                    drafts.append(draft)
            level = children
    return _workload("agent-tree", block_tokens, drafts)


def multi_tenant(
    tenants: int = 4,
    groups_per_tenant: int = 8,
    prompts_per_group: int = 32,
    system_tokens: int = 2048,
    question_tokens: int = 256,
    output_tokens: int = 256,
    shared_system_text: bool = True,
    rate_per_s: float = 20.0,
    block_tokens: int = 64,
    seed: int = 0,
) -> Workload:
    """Shared-prefix groups owned by tenants; tenants never share a block id.

    Tenant t's group g uses system prompt text g for every tenant when
    `shared_system_text` (as when tenants deploy the same application), yet its chains
    are salted with the tenant's name, so the cache can never serve one tenant's blocks
    to another. Prompts are shuffled and arrive as a Poisson process at `rate_per_s`.
    """
    _positive(tenants=tenants, groups_per_tenant=groups_per_tenant)
    _positive(prompts_per_group=prompts_per_group, system_tokens=system_tokens)
    _positive(question_tokens=question_tokens, output_tokens=output_tokens)
    rng = random.Random(seed)
    ns = f"multi-tenant/{seed}"
    prompts: list[tuple[str, PrefixChain]] = []
    for t in range(tenants):
        tenant = f"tenant-{t}"
        start = PrefixChain.start(block_tokens, salt=tenant)
        for g in range(groups_per_tenant):
            text = f"{ns}/system{g}" if shared_system_text else f"{ns}/{tenant}/system{g}"
            system = start.extend(text, system_tokens)
            prompts.extend(
                (tenant, system.extend(f"{ns}/{tenant}/g{g}/q{p}", question_tokens))
                for p in range(prompts_per_group)
            )
    rng.shuffle(prompts)
    arrivals = poisson_arrivals(rng, rate_per_s, len(prompts))
    return _workload(
        "multi-tenant",
        block_tokens,
        (
            _Draft(t, chain.blocks(), chain.tokens, output_tokens, tenant)
            for t, (tenant, chain) in zip(arrivals, prompts, strict=True)
        ),
    )


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "shared-prefix": shared_prefix,
    "llmd-prefix": llmd_prefix,
    "multi-turn": multi_turn,
    "agent-tree": agent_tree,
    "multi-tenant": multi_tenant,
}
