"""The live bake-off's workloads: conversations of real text, generated deterministically.

Text, not token ids: the peers' cache-aware policies match request text (SGLang's and
SMG's approximate trees) or token ids they ask the engine for (vllm-router), so every
router must see the same bytes. Each piece of text is a run of words drawn from a seed
named after what the text stands for, so two prompts share a prefix exactly where the
workload says they do. With kvplane's tiny tokenizer a word is about 2.5 tokens
(`TOKENS_PER_WORD`); the lengths below are in tokens and approximate, and the engines'
own counts are what the report uses.

A workload is a list of `Conversation`s. A conversation starts at `start_s` with its
system prompt (if any) and its root `Step`; each child step is sent `after_s` seconds
after its parent's response ends, with the parent's messages, the parent's real
response and the child's text: a multi-turn chat is a chain, an agent run a tree, a
single request a conversation of one step. Conversations start open-loop (on a
schedule, whatever the routers do); steps within one follow their responses.

Workloads (the shapes of `simulations/fleet_sim/workloads.py`, scaled for a small machine):
- `shared-N`: N system prompts shared by groups of requests, each with its own
  question; Poisson arrivals. The shape of SGLang's `generated-shared-prefix` benchmark
  (2,048-token system prompts, 128-token questions), the one its cache-aware router was
  published with.
- `zipf-N`: the same with N 1,024-token system prompts drawn by a Zipf law (exponent
  1): a few hot prompts and a long tail, as real prompt and document reuse goes.
  `zipf-96` is about three times the bake-off fleet's cache: the `eviction` situation.
- `multi-turn`: chats sharing one system prompt, growing turn by turn.
- `multi-tenant`: four tenants with the same system prompts' text; each tenant's
  requests carry its API key and its own `cache_salt` (as a careful client of vLLM
  would), so tenants never share cache in the engines.
- `agent-tree`: agent runs branching from a shared trunk (task, tools, documents).
- `mooncake`: the Mooncake FAST'25 conversation trace, whole conversation families
  sampled across it and its time compressed to the chosen duration, each 512-token
  block of the trace as a short run of text (32 tokens by default: prefixes are shared
  exactly as in the trace, at 1/16 of the length).

And the `noisy-tenant` situation's, whose rates are fractions of the fleet's sustainable
rate C (measured in the cell's fleet: `capacity.py`), five tenants each with its own
system prompts, API key and `cache_salt`:
- `noisy-same`: four well-behaved tenants, Poisson at 0.15 C each, and a noisy one at
  eight times that in bursts (`BURST_ON_S` on, `BURST_OFF_S` off), every request of one
  shape;
- `noisy-long`: the same, the noisy tenant's prompts and answers `LONG_FACTOR` times
  longer and its requests as many times fewer: the same token rate;
- `noisy-solo`: the four well-behaved tenants' very requests, alone (their reference);
- `shares-2-1-1`: three tenants each flooding at 0.8 C, configured to share 2:1:1.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from simulations.fleet_sim.workloads import group_drawer

TOKENS_PER_WORD = 2.5
ZIPF_SYSTEM_TOKENS = 1024
ZIPF_EXPONENT = 1.0
# Words the tiny tokenizer knows well (its training text): prompts stay short in tokens
# for their length in words, as English does with a real tokenizer.
_WORDS = [
    "cache",
    "model",
    "request",
    "prefix",
    "block",
    "router",
    "engine",
    "token",
    "replica",
    "answer",
    "question",
    "system",
    "helpful",
    "assistant",
    "summarise",
    "document",
    "engineer",
    "function",
    "return",
    "longest",
    "common",
    "list",
    "quick",
    "brown",
    "fox",
    "jumps",
    "lazy",
    "dog",
    "sentence",
    "grammar",
    "translate",
    "capital",
    "city",
    "largest",
    "paragraph",
    "short",
    "read",
    "work",
    "again",
    "part",
    "earlier",
    "same",
    "way",
    "start",
    "below",
    "remember",
    "already",
    "skip",
]


@dataclass(frozen=True, slots=True)
class Step:
    """One request of a conversation: the user's new text, what it may generate, and the
    steps that follow its response."""

    text: str
    max_tokens: int
    after_s: float = 0.0  # after the parent's response (the root: after the start)
    children: tuple[Step, ...] = ()

    def count(self) -> int:
        return 1 + sum(child.count() for child in self.children)


@dataclass(frozen=True, slots=True)
class Conversation:
    start_s: float
    root: Step
    system: str | None = None
    tenant: str | None = None


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    conversations: tuple[Conversation, ...]
    tenants: tuple[str, ...] = ()  # empty: no tenants, every request anonymous
    description: str = ""  # the shape in words, for the report's JSON
    # Tenants' configured shares of a flow-control band (the tenants file's `share`); a
    # tenant not named has kvplane's default, 1.
    shares: dict[str, float] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return sum(conversation.root.count() for conversation in self.conversations)

    @property
    def span_s(self) -> float:
        return max((c.start_s for c in self.conversations), default=0.0)


def words(key: str, tokens: int) -> str:
    """About `tokens` tokens of text, the same for the same key on every machine."""
    rng = random.Random(key)
    count = max(1, round(tokens / TOKENS_PER_WORD))
    return " ".join(rng.choice(_WORDS) for _ in range(count))


def poisson_starts(rng: random.Random, rate_per_s: float, duration_s: float) -> Iterator[float]:
    """Arrival times of a Poisson process at `rate_per_s` over `duration_s`."""
    if rate_per_s <= 0 or duration_s <= 0:
        raise ValueError("the rate and the duration must be positive")
    now = rng.expovariate(rate_per_s)
    while now < duration_s:
        yield now
        now += rng.expovariate(rate_per_s)


def shared_prompts(
    rate_per_s: float,
    duration_s: float,
    *,
    groups: int,
    system_tokens: int = 2048,
    question_tokens: int = 128,
    max_tokens: int = 16,
    seed: int = 0,
    popularity: float = 0.0,
    name: str | None = None,
) -> Workload:
    """`popularity`: the Zipf exponent the groups are drawn by (0: uniformly)."""
    rng = random.Random(f"shared-{groups}-{seed}")
    draw_group = group_drawer(rng, groups, popularity)
    systems = [words(f"system-{group}", system_tokens) for group in range(groups)]
    conversations = tuple(
        Conversation(
            start,
            Step(words(f"question-{seed}-{number}", question_tokens), max_tokens),
            system=f"You are assistant {group}. " + systems[group],
        )
        for number, start in enumerate(poisson_starts(rng, rate_per_s, duration_s))
        for group in (draw_group(),)
    )
    drawn = f" drawn by a Zipf law of exponent {popularity:g}" if popularity else ""
    return Workload(
        name or f"shared-{groups}",
        conversations,
        description=f"{groups} shared system prompts of ~{system_tokens} tokens{drawn}, "
        f"unique ~{question_tokens}-token questions",
    )


def multi_turn(
    rate_per_s: float,
    duration_s: float,
    *,
    turns: int = 5,
    system_tokens: int = 1024,
    user_tokens: int = 128,
    max_tokens: int = 24,
    think_s: float = 1.0,
    seed: int = 0,
) -> Workload:
    """Chats sharing one system prompt; `rate_per_s` counts requests (turns), so chats
    start at rate / turns."""
    rng = random.Random(f"multi-turn-{seed}")
    system = words("chat-system", system_tokens)
    conversations = []
    for number, start in enumerate(poisson_starts(rng, rate_per_s / turns, duration_s)):
        step: Step | None = None
        for turn in reversed(range(turns)):
            text = words(f"chat-{seed}-{number}-{turn}", user_tokens)
            after = rng.expovariate(1 / think_s) if turn else 0.0
            step = Step(text, max_tokens, after, () if step is None else (step,))
        assert step is not None
        conversations.append(Conversation(start, step, system=system))
    return Workload(
        "multi-turn",
        tuple(conversations),
        description=f"{turns}-turn chats, one ~{system_tokens}-token system prompt, "
        f"~{user_tokens}-token turns, think time {think_s} s",
    )


def multi_tenant(
    rate_per_s: float,
    duration_s: float,
    *,
    tenants: int = 4,
    prompts_per_tenant: int = 2,
    system_tokens: int = 2048,
    question_tokens: int = 128,
    max_tokens: int = 16,
    seed: int = 0,
) -> Workload:
    """Every tenant uses the same system prompts' text (so only the cache salts keep them
    apart)."""
    rng = random.Random(f"multi-tenant-{seed}")
    names = tuple(f"tenant{number}" for number in range(tenants))
    systems = [
        words(f"tenant-system-{prompt}", system_tokens) for prompt in range(prompts_per_tenant)
    ]
    conversations = tuple(
        Conversation(
            start,
            Step(words(f"tenant-question-{seed}-{number}", question_tokens), max_tokens),
            system=rng.choice(systems),
            tenant=rng.choice(names),
        )
        for number, start in enumerate(poisson_starts(rng, rate_per_s, duration_s))
    )
    return Workload(
        "multi-tenant",
        conversations,
        tenants=names,
        description=f"{tenants} tenants x {prompts_per_tenant} system prompts (the same "
        f"text for every tenant), ~{system_tokens} tokens each",
    )


def agent_tree(
    rate_per_s: float,
    duration_s: float,
    *,
    trunk_tokens: int = 2048,
    step_tokens: int = 64,
    branches: int = 3,
    depth: int = 2,
    max_tokens: int = 24,
    step_s: float = 0.2,
    seed: int = 0,
) -> Workload:
    """Trees start at rate / (requests per tree), so `rate_per_s` counts requests."""
    rng = random.Random(f"agent-tree-{seed}")
    per_tree = sum(branches**level for level in range(depth + 1))

    def subtree(path: str, level: int) -> Step:
        children: tuple[Step, ...] = ()
        if level < depth:
            children = tuple(subtree(f"{path}.{branch}", level + 1) for branch in range(branches))
        after = rng.expovariate(1 / step_s) if level else 0.0
        return Step(words(f"agent-step-{seed}-{path}", step_tokens), max_tokens, after, children)

    conversations = tuple(
        Conversation(
            start, subtree(str(number), 0), system=words(f"trunk-{seed}-{number}", trunk_tokens)
        )
        for number, start in enumerate(poisson_starts(rng, rate_per_s / per_tree, duration_s))
    )
    return Workload(
        "agent-tree",
        conversations,
        description=f"agent trees: a ~{trunk_tokens}-token trunk, {branches} branches, "
        f"depth {depth} ({per_tree} requests a tree)",
    )


def mooncake(
    rate_per_s: float,
    duration_s: float,
    *,
    trace: Path,
    tokens_per_block: int = 32,
    max_tokens: int = 16,
) -> Workload:
    """A sample of the whole trace at about `rate_per_s` for `duration_s`.

    The trace's reuse lies in conversations whose turns come minutes apart: its first
    few hundred requests share almost nothing (an ideal global cache would hit 6% of
    their blocks, against 37% over the whole trace). So whole conversation families
    (requests with the same first two blocks) are sampled across the whole trace, a
    deterministic share of them, and the trace's time is compressed into `duration_s`:
    the sample keeps the trace's reuse (37% ideal) and its order, at the cost of turns
    arriving far closer together than in the trace."""
    rows = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    if len(rows) < 2:
        raise ValueError(f"{trace}: too few requests to replay")
    wanted = max(2, math.ceil(rate_per_s * duration_s))
    share = max(1, round(len(rows) / wanted))
    sample = [row for row in rows if _family_bucket(row["hash_ids"], share) == 0]
    first, last = sample[0]["timestamp"], sample[-1]["timestamp"]
    speedup = (last - first) / 1000 / duration_s if last > first else 1.0
    conversations = tuple(
        Conversation(
            (row["timestamp"] - first) / 1000 / speedup,
            Step(
                " ".join(
                    words(f"mooncake-block-{block}", tokens_per_block) for block in row["hash_ids"]
                ),
                max(1, min(max_tokens, row["output_length"] // 16)),
            ),
        )
        for row in sample
    )
    return Workload(
        "mooncake",
        conversations,
        description=f"Mooncake conversation trace: {len(sample)} of {len(rows)} requests "
        f"(whole conversation families, 1 in {share}) at {speedup:.0f}x, "
        f"{tokens_per_block} tokens per 512-token block",
    )


def _family_bucket(hash_ids: list[int], buckets: int) -> int:
    """The same bucket for every request of a conversation family (its first two
    blocks), spread evenly over `buckets`."""
    family = repr(hash_ids[:2]).encode()
    return int.from_bytes(hashlib.blake2b(family, digest_size=8).digest(), "big") % buckets


# --- the noisy-tenant situation ------------------------------------------------------

NOISY_TENANT = "noisy"
WELL_BEHAVED_TENANTS = ("tenant-1", "tenant-2", "tenant-3", "tenant-4")
WELL_BEHAVED_SHARE_OF_C = 0.15  # each well-behaved tenant's rate, a fraction of C
NOISY_MULTIPLE = 8.0  # the noisy tenant's rate in a burst, in well-behaved tenants' rates
# The noisy tenant floods for BURST_ON_S, then rests BURST_OFF_S, from the start: long
# enough for every router's queues to fill (about 16 C requests behind at the end of a
# burst without flow control), then a rest in which they drain or not.
BURST_ON_S = 20.0
BURST_OFF_S = 10.0
LONG_FACTOR = 4  # noisy-long: the noisy tenant's prompts and answers, its requests fewer
NOISY_VARIANTS = ("noisy-same", "noisy-long")
NOISY_SOLO = "noisy-solo"
NOISY_WORKLOADS = (NOISY_SOLO, *NOISY_VARIANTS)
# The request shape of every tenant (the noisy one's in noisy-same): each tenant's own
# system prompts, each request one of them and its own question, as `shared-N` at half
# the prompt: ten tenants' prompts fill about a third of the fleet's cache.
TENANT_PROMPTS = 2
TENANT_SYSTEM_TOKENS = 1024
TENANT_QUESTION_TOKENS = 128
TENANT_MAX_TOKENS = 16
SHARES_WORKLOAD = "shares-2-1-1"
SHARES = {"tenant-a": 2.0, "tenant-b": 1.0, "tenant-c": 1.0}
SHARES_RATE_OF_C = 0.8  # each tenant's rate in the shares measurement: all backlogged


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What one tenant sends: its system prompts' and questions' lengths, its answers'."""

    system_tokens: int = TENANT_SYSTEM_TOKENS
    question_tokens: int = TENANT_QUESTION_TOKENS
    max_tokens: int = TENANT_MAX_TOKENS

    def scaled(self, factor: int) -> RequestShape:
        return RequestShape(
            self.system_tokens * factor, self.question_tokens * factor, self.max_tokens * factor
        )


def burst_starts(
    rng: random.Random, rate_per_s: float, duration_s: float, on_s: float, off_s: float
) -> Iterator[float]:
    """Arrival times of a Poisson process at `rate_per_s` that runs only in bursts: on
    for `on_s`, off for `off_s`, from 0 to `duration_s`. Drawn over the bursts' own time
    and laid out on the clock, so each burst gets its full rate."""
    period = on_s + off_s
    bursts, last = divmod(duration_s, period)
    on_time = bursts * on_s + min(last, on_s)
    for start in poisson_starts(rng, rate_per_s, on_time):
        burst, into = divmod(start, on_s)
        yield burst * period + into


def tenant_conversations(
    tenant: str, starts: Iterator[float], shape: RequestShape, seed: int
) -> list[Conversation]:
    """A tenant's requests at `starts`: one of its own system prompts (`TENANT_PROMPTS`
    of them, text no other tenant sends) and a question of its own each."""
    rng = random.Random(f"tenant-{tenant}-{seed}")
    systems = [
        words(f"tenant-system-{tenant}-{prompt}-{shape.system_tokens}", shape.system_tokens)
        for prompt in range(TENANT_PROMPTS)
    ]
    return [
        Conversation(
            start,
            Step(words(f"tenant-{tenant}-{seed}-{n}", shape.question_tokens), shape.max_tokens),
            system=rng.choice(systems),
            tenant=tenant,
        )
        for n, start in enumerate(starts)
    ]


def poisson_tenants(
    tenants: tuple[str, ...], rate_per_s: float, duration_s: float, seed: int
) -> list[Conversation]:
    """Every one of `tenants` Poisson at `rate_per_s`, each from a seed of its own (its
    requests the same whoever else sends), in the situation's request shape."""
    return [
        conversation
        for tenant in tenants
        for conversation in tenant_conversations(
            tenant,
            poisson_starts(random.Random(f"{tenant}-{seed}"), rate_per_s, duration_s),
            RequestShape(),
            seed,
        )
    ]


def noisy_tenant(capacity_per_s: float, duration_s: float, name: str, *, seed: int = 0) -> Workload:
    """`name` (`NOISY_WORKLOADS`) at the fleet's sustainable rate `capacity_per_s` (C):
    the well-behaved tenants Poisson at 0.15 C each, their requests the same in every
    variant (their seeds are their own); the noisy tenant, but in `noisy-solo`, at 8 x
    0.15 C in bursts, or in `noisy-long` its requests LONG_FACTOR times longer and as
    many times fewer."""
    if name not in NOISY_WORKLOADS:
        raise ValueError(f"unknown workload {name!r}")
    rate = WELL_BEHAVED_SHARE_OF_C * capacity_per_s
    conversations = poisson_tenants(WELL_BEHAVED_TENANTS, rate, duration_s, seed)
    tenants: tuple[str, ...] = WELL_BEHAVED_TENANTS
    noisy = ""
    if name != NOISY_SOLO:
        factor = LONG_FACTOR if name == "noisy-long" else 1
        rng = random.Random(f"{NOISY_TENANT}-{seed}")
        burst_rate = NOISY_MULTIPLE * rate / factor
        starts = burst_starts(rng, burst_rate, duration_s, BURST_ON_S, BURST_OFF_S)
        conversations += tenant_conversations(
            NOISY_TENANT, starts, RequestShape().scaled(factor), seed
        )
        tenants = (*tenants, NOISY_TENANT)
        noisy = (
            f"; {NOISY_TENANT} at {NOISY_MULTIPLE:g}x that in {BURST_ON_S:g} s bursts "
            f"every {BURST_ON_S + BURST_OFF_S:g} s"
            + (f", {factor}x longer prompts and answers, {factor}x fewer" if factor > 1 else "")
        )
    return Workload(
        name,
        tuple(sorted(conversations, key=lambda conversation: conversation.start_s)),
        tenants=tenants,
        description=f"{len(WELL_BEHAVED_TENANTS)} tenants at {rate:.2f} req/s "
        f"({WELL_BEHAVED_SHARE_OF_C:g} C, C = {capacity_per_s:.1f} req/s) each, "
        f"{TENANT_PROMPTS} system prompts of ~{TENANT_SYSTEM_TOKENS} tokens of their own" + noisy,
    )


def tenant_shares(capacity_per_s: float, duration_s: float, *, seed: int = 0) -> Workload:
    """`SHARES_WORKLOAD`: every tenant of `SHARES` Poisson at 0.8 C (all of them
    backlogged on a fleet that serves C), configured to share the band as `SHARES`."""
    rate = SHARES_RATE_OF_C * capacity_per_s
    conversations = poisson_tenants(tuple(SHARES), rate, duration_s, seed)
    return Workload(
        SHARES_WORKLOAD,
        tuple(sorted(conversations, key=lambda conversation: conversation.start_s)),
        tenants=tuple(SHARES),
        description=f"{len(SHARES)} tenants at {rate:.2f} req/s ({SHARES_RATE_OF_C:g} C) each, "
        "configured shares " + ":".join(f"{share:g}" for share in SHARES.values()),
        shares=dict(SHARES),
    )


WorkloadFactory = Callable[[float, float], Workload]


def build_workload(name: str, rate_per_s: float, duration_s: float, *, trace: Path) -> Workload:
    """The named workload at a request rate over a duration (for the noisy-tenant
    situation's, the fleet's sustainable rate C)."""
    for prefix in ("shared-", "zipf-"):
        if not name.startswith(prefix):
            continue
        try:
            groups = int(name.removeprefix(prefix))
        except ValueError:
            raise ValueError(f"unknown workload {name!r}") from None
        if prefix == "shared-":
            return shared_prompts(rate_per_s, duration_s, groups=groups)
        return shared_prompts(
            rate_per_s,
            duration_s,
            groups=groups,
            system_tokens=ZIPF_SYSTEM_TOKENS,
            popularity=ZIPF_EXPONENT,
            name=name,
        )
    factories: dict[str, WorkloadFactory] = {
        "multi-turn": multi_turn,
        "multi-tenant": multi_tenant,
        "agent-tree": agent_tree,
        "mooncake": lambda rate, duration: mooncake(rate, duration, trace=trace),
        SHARES_WORKLOAD: tenant_shares,
        **{noisy: functools.partial(noisy_tenant, name=noisy) for noisy in NOISY_WORKLOADS},
    }
    if name not in factories:
        known = ", ".join(("shared-N", "zipf-N", *factories))
        raise ValueError(f"unknown workload {name!r} (known: {known})")
    return factories[name](rate_per_s, duration_s)
