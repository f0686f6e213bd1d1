"""Translating the engine's block events into kvplane block keys. No I/O.

For each stored engine block the translator computes the kvplane key with the shared
scheme (`kvplane.core.keys`), rooted in the namespace the router uses for the same request:
model, LoRA name, cache scope (the cache salt), router block size. A chain that starts
after a parent continues from the parent's key. It remembers, per engine hash, what it
needs to translate later events (removals carry engine hashes only): the block's
position, tokens, the keys it completes or belongs to, and a reference count per tier
(an engine may store or remove the same block twice).

The router's block size may be a multiple k of the engine's: a router key then covers k
engine blocks and is announced only while all k are held on that tier. (If one of them
is removed and stored again, the key stays withdrawn until its last block is stored
again: the index may miss a block, which is safe, but never holds one that is gone.)

A store that names its blocks by hash alone (an offloading connector's copy to a
slower tier) is credited to that tier under the keys the blocks got from their own
stores with tokens.

Never guess: a chain whose parent is unknown (the agent missed its store) cannot be
keyed and is skipped and counted; so is a hash-only store of a block the agent does
not know; a removal of an unknown block is counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvplane.core.keys import BlockKey, KeyNamespace, chain_keys, root_key
from kvplane.core.types import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEvent, Tier
from worker_agent.events import (
    EngineBlockHash,
    EngineBlocksOffloaded,
    EngineBlocksRemoved,
    EngineBlocksStored,
    EngineCacheCleared,
    EngineEvent,
)

_REF_BITS = 16
_REF_MASK = (1 << _REF_BITS) - 1


class TrackingLimitExceeded(Exception):
    """More engine blocks than the agent may track: its picture is no longer complete."""


@dataclass(slots=True)
class TranslationCounters:
    stored_blocks: int = 0  # engine blocks stored
    offloaded_blocks: int = 0  # stored by hash alone, of blocks the agent knows
    unresolved_blocks: int = 0  # stored by hash alone, but not resolvable: skipped
    orphan_blocks: int = 0  # stored after a parent the agent does not know: skipped
    unknown_removals: int = 0  # removals of blocks the agent does not hold
    mismatched_blocks: int = 0  # engine block size that does not divide the router's
    other_group_blocks: int = 0  # events of KV cache groups other than the first: ignored


class _EngineBlock:
    # A plain slotted class: one is built per stored block, on ingest's hot path.
    __slots__ = ("chain_key", "member_of", "parent", "position", "refs", "router_key", "tokens")

    def __init__(
        self,
        position: int,
        tokens: Sequence[int],
        parent: EngineBlockHash | None,
        chain_key: BlockKey,
        router_key: BlockKey | None,
    ) -> None:
        self.position = position  # index of the block in its chain, in engine blocks
        self.tokens = tokens  # kept only while it may complete a router block (size > 1)
        self.parent = parent  # engine hash of the block before; None at the chain's start
        self.chain_key = chain_key  # key of the last router block complete here (or root)
        self.router_key = router_key  # the router key this block completes, if any
        # Reference counts per tier, 16 bits each, packed in one int: a dict per block
        # would double the objects the garbage collector walks on the ingest path.
        self.refs = 0
        # Router keys of groups this block is an earlier member of (router block size > 1).
        self.member_of: set[BlockKey] | None = None


# An announced key's (parent key, position in router blocks): a plain tuple, built once
# per stored block on the hot path (a NamedTuple's constructor is a Python call).
_Announced = tuple[BlockKey | None, int]


class BlockTranslator:
    def __init__(self, model: str, router_block_size: int, *, max_tracked_blocks: int) -> None:
        self.model = model
        self.router_block_size = router_block_size
        self.max_tracked_blocks = max_tracked_blocks
        self.counters = TranslationCounters()
        self._blocks: dict[EngineBlockHash, _EngineBlock] = {}
        # The engine's block size as its stores say (hash-only stores do not); None once
        # they disagree (a hybrid model's groups): a router block's members are unknown.
        self._engine_block_size: int | None = 0
        self._announced: dict[tuple[Tier, BlockKey], _Announced] = {}

    @property
    def tracked_blocks(self) -> int:
        return len(self._blocks)

    @property
    def announced_keys(self) -> int:
        return len(self._announced)

    def translate(self, events: Iterable[EngineEvent]) -> list[KvEvent]:
        """kvplane events for a batch of engine events, in order.

        Raises TrackingLimitExceeded when the map outgrows its bound; the caller must
        then forget everything (clear()) and start over under a new incarnation.
        """
        out: list[KvEvent] = []
        for event in events:
            if not isinstance(event, EngineCacheCleared) and event.group_idx != 0:
                # Hybrid models keep several groups (sliding-window layers, ...) that store
                # and evict the same hashes on their own schedules. A prefix is reusable
                # while the first (full-attention) group holds it; counting the others'
                # references too would keep keys the first group evicted.
                self.counters.other_group_blocks += len(event.block_hashes)
                continue
            if isinstance(event, EngineBlocksStored):
                out.extend(self._store(event))
            elif isinstance(event, EngineBlocksOffloaded):
                out.extend(self._offload(event))
            elif isinstance(event, EngineBlocksRemoved):
                out.extend(self._remove(event))
            else:
                assert isinstance(event, EngineCacheCleared)
                self.clear()
                out.append(AllBlocksCleared())
        if len(self._blocks) > self.max_tracked_blocks:
            raise TrackingLimitExceeded(
                f"{len(self._blocks)} engine blocks tracked, limit {self.max_tracked_blocks}"
            )
        return out

    def clear(self) -> None:
        self._blocks.clear()
        self._announced.clear()
        self._engine_block_size = 0

    def snapshot(self) -> list[KvEvent]:
        """Every announced key, for a new incarnation that must send the whole picture:
        chained runs, parents before children."""
        runs: list[tuple[Tier, int, BlockKey | None, list[BlockKey]]] = []
        open_runs: dict[tuple[Tier, BlockKey], list[BlockKey]] = {}  # (tier, last key) -> run keys
        ordered = sorted(self._announced.items(), key=lambda item: item[1][1])
        for (tier, key), (parent, position) in ordered:
            run = None if parent is None else open_runs.pop((tier, parent), None)
            if run is None:
                run = []
                runs.append((tier, position, parent, run))
            run.append(key)
            open_runs[(tier, key)] = run
        return [
            BlocksStored(keys=keys, tier=tier, first_position=position, parent_key=parent)
            for tier, position, parent, keys in runs
        ]

    def _store(self, event: EngineBlocksStored) -> list[KvEvent]:
        engine_size, count = event.block_size, len(event.block_hashes)
        if self.router_block_size % engine_size:
            self.counters.mismatched_blocks += count
            return []
        group = self.router_block_size // engine_size
        if self._engine_block_size not in (0, engine_size):
            self._engine_block_size = None
        elif self._engine_block_size == 0:
            self._engine_block_size = engine_size
        if event.parent_hash is None:
            namespace = KeyNamespace(
                model=self.model,
                block_size=self.router_block_size,
                lora=event.lora_name or "",
                cache_scope=event.cache_salt or "",
            )
            parent: _EngineBlock | None = None
            chain_key, position = root_key(namespace), 0
        else:
            parent = self._blocks.get(event.parent_hash)
            if parent is None:
                self.counters.orphan_blocks += count
                return []
            chain_key, position = parent.chain_key, parent.position + 1
        self.counters.stored_blocks += count

        if group == 1:
            return self._store_run(event, chain_key, position)
        runs = _Runs(event.tier)
        parent_hash = event.parent_hash
        for index, block_hash in enumerate(event.block_hashes):
            block = self._blocks.get(block_hash)
            if block is None:
                tokens = event.token_ids[index * engine_size : (index + 1) * engine_size]
                new_block = self._new_block(parent_hash, position, tokens, chain_key, group)
                if new_block is None:
                    # An earlier block of its router block is gone: neither it nor anything
                    # after it in the chain can be keyed. Never guess.
                    self.counters.orphan_blocks += count - index
                    break
                block = self._blocks[block_hash] = new_block
            shift = _REF_BITS * event.tier
            held = (block.refs >> shift) & _REF_MASK
            if held < _REF_MASK:
                block.refs += 1 << shift
            key = block.router_key
            if not held and key is not None and self._group_held(block, key, group, event.tier):
                router_position = position // group
                parent_key = chain_key if router_position else None
                self._announced[(event.tier, key)] = (parent_key, router_position)
                runs.add(key, parent_key, router_position)
            chain_key = block.chain_key
            parent_hash, position = block_hash, position + 1
        return runs.done()

    def _store_run(
        self, event: EngineBlocksStored, chain_key: BlockKey, position: int
    ) -> list[KvEvent]:
        """`_store` when a router block is one engine block: the hot path of ingest, so
        the whole run is keyed in one call and the loop keeps to local names."""
        keys = chain_keys(chain_key, event.token_ids, event.block_size)
        tier = event.tier
        shift = _REF_BITS * tier
        one_ref = 1 << shift
        blocks, announced = self._blocks, self._announced
        runs: list[KvEvent] = []
        run: list[BlockKey] = []
        run_start, run_parent = 0, chain_key
        previous_key = chain_key  # the key before the current block (the root at 0)
        parent_hash = event.parent_hash
        for block_hash, key in zip(event.block_hashes, keys, strict=True):
            block = blocks.get(block_hash)
            if block is None:
                block = blocks[block_hash] = _EngineBlock(position, (), parent_hash, key, key)
                block.refs = one_ref
                held = 0
            else:
                held = (block.refs >> shift) & _REF_MASK
                if held < _REF_MASK:
                    block.refs += one_ref
                # What removals will withdraw (equal to `key` unless hashes collide).
                key = block.chain_key
            if not held:
                parent_key = previous_key if position else None
                announced[(tier, key)] = (parent_key, position)
                if not run or run[-1] != previous_key:
                    if run:
                        runs.append(_stored(run, tier, run_start, run_parent))
                    run, run_start, run_parent = [], position, previous_key
                run.append(key)
            previous_key, parent_hash, position = key, block_hash, position + 1
        if run:
            runs.append(_stored(run, tier, run_start, run_parent))
        return runs

    def _new_block(
        self,
        parent_hash: EngineBlockHash | None,
        position: int,
        tokens: Sequence[int],
        chain_key: BlockKey,
        group: int,
    ) -> _EngineBlock | None:
        """The engine block's record; None when it ends a router block whose earlier
        blocks the translator no longer has (their tokens are needed for the key)."""
        block = _EngineBlock(
            position=position,
            tokens=tuple(tokens),
            parent=parent_hash,
            chain_key=chain_key,
            router_key=None,
        )
        if position % group == group - 1:
            members = self._earlier_members(parent_hash, group - 1)
            if len(members) < group - 1:
                return None
            group_tokens: list[int] = []
            for member in reversed(members):
                group_tokens.extend(member.tokens)
            group_tokens.extend(tokens)
            (key,) = chain_keys(chain_key, group_tokens, self.router_block_size)
            block.router_key = block.chain_key = key
        return block

    def _earlier_members(
        self, parent_hash: EngineBlockHash | None, count: int
    ) -> list[_EngineBlock]:
        """The `count` engine blocks before a group's last one, nearest first."""
        members: list[_EngineBlock] = []
        while len(members) < count and parent_hash is not None:
            member = self._blocks.get(parent_hash)
            if member is None:
                break
            members.append(member)
            parent_hash = member.parent
        return members

    def _group_held(self, last: _EngineBlock, key: BlockKey, group: int, tier: Tier) -> bool:
        """Whether every engine block of the router block `last` completes is held on
        `tier`; if so, each is marked as a member of `key` (so that its removal withdraws
        the key, even if it was forgotten and stored again since the key was made)."""
        if group == 1:
            return True
        members = self._earlier_members(last.parent, group - 1)
        shift = _REF_BITS * tier
        if len(members) < group - 1 or not all((m.refs >> shift) & _REF_MASK for m in members):
            return False
        for member in members:
            if member.member_of is None:
                member.member_of = set()
            member.member_of.add(key)
        return True

    def _offload(self, event: EngineBlocksOffloaded) -> list[KvEvent]:
        """Blocks stored on `event.tier` by engine hash alone: each one the agent knows
        (from its store with tokens) is credited to that tier under the key it already
        has; the others cannot be keyed, and are counted."""
        if self._engine_block_size is None:  # which blocks make a router block is unknown
            self.counters.unresolved_blocks += len(event.block_hashes)
            return []
        # A block is known only after a store with tokens, which set the block size.
        group = self.router_block_size // self._engine_block_size if self._blocks else 1
        tier, shift = event.tier, _REF_BITS * event.tier
        runs = _Runs(tier)
        for block_hash in event.block_hashes:
            block = self._blocks.get(block_hash)
            if block is None:
                self.counters.unresolved_blocks += 1
                continue
            self.counters.offloaded_blocks += 1
            held = (block.refs >> shift) & _REF_MASK
            if held < _REF_MASK:
                block.refs += 1 << shift
            key = block.router_key
            if held or key is None or not self._group_held(block, key, group, tier):
                continue
            placed = self._placement(key)
            if placed is None:  # keyed, but held on no tier now: where it chains is unknown
                continue
            self._announced[(tier, key)] = placed
            parent_key, position = placed
            runs.add(key, parent_key, position)
        return runs.done()

    def _placement(self, key: BlockKey) -> _Announced | None:
        """Where an announced key sits in its chain (its parent key and position), as
        announced on any tier."""
        for tier in Tier:
            placed = self._announced.get((tier, key))
            if placed is not None:
                return placed
        return None

    def _remove(self, event: EngineBlocksRemoved) -> list[KvEvent]:
        withdrawn: list[BlockKey] = []
        for block_hash in event.block_hashes:
            block = self._blocks.get(block_hash)
            shift = _REF_BITS * event.tier
            held = 0 if block is None else (block.refs >> shift) & _REF_MASK
            if block is None or not held:
                self.counters.unknown_removals += 1
                continue
            if held > 1:
                block.refs -= 1 << shift
                continue
            block.refs -= 1 << shift
            keys = set(block.member_of or ())
            if block.router_key is not None:
                keys.add(block.router_key)
            for key in keys:
                if self._announced.pop((event.tier, key), None) is not None:
                    withdrawn.append(key)
            if not block.refs:
                del self._blocks[block_hash]
        return [BlocksRemoved(keys=withdrawn, tier=event.tier)] if withdrawn else []


class _Runs:
    """Announced keys gathered into chained runs, one BlocksStored each."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self._runs: list[KvEvent] = []
        self._run: list[BlockKey] = []
        self._start = 0
        self._parent: BlockKey | None = None

    def add(self, key: BlockKey, parent_key: BlockKey | None, position: int) -> None:
        if self._run and self._run[-1] == parent_key:  # the key right after the run's last
            self._run.append(key)
            return
        self._close()
        self._run, self._start, self._parent = [key], position, parent_key

    def done(self) -> list[KvEvent]:
        self._close()
        return self._runs

    def _close(self) -> None:
        if self._run:
            self._runs.append(_stored(self._run, self.tier, self._start, self._parent))


def _stored(
    keys: list[BlockKey], tier: Tier, first_position: int, parent_key: BlockKey | None
) -> BlocksStored:
    return BlocksStored(
        keys=keys,
        tier=tier,
        first_position=first_position,
        parent_key=parent_key if first_position else None,
    )
