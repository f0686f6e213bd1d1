"""Writes KV event batches made by the engines' own event classes next to this file.

    .venv/bin/python tests/worker_agent/wire_corpus/make_corpus.py

For each release of vLLM and SGLang below it downloads the engine's wheel (`pip download
--no-deps`, into a temporary folder; vLLM's are about 300 MB each), loads only its event
module (`vllm/distributed/kv_events.py`, `sglang/srt/disaggregation/kv_events.py`: they
need msgspec, zmq and pydantic, all in the project's environment), builds batches with
that module's classes and encodes them as the module's ZMQ publisher does. What the
event module imports from the rest of its engine (a logger, its publisher's config and
network helpers, type aliases) is given a stand-in: the event classes do not use it.
The bytes are committed, and the tests read them without any engine.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import subprocess
import sys
import tempfile
import types
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

HERE = Path(__file__).parent
VLLM_RELEASES = ("0.9.2", "0.23.0", "0.32.0", "0.33.0")
SGLANG_RELEASES = ("0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.23")
EVENT_MODULES = {
    "vllm": "vllm/distributed/kv_events.py",
    "sglang": "sglang/srt/disaggregation/kv_events.py",
}
TS = 1754000200.0
BLOCK_SIZE = 4
TOKENS = list(range(1, 9))  # two blocks
SALT = "tenant-a"
HEAD, TAIL = 1001, 1002  # vLLM's hashes of the two blocks (unsigned)
SGLANG_HEAD, SGLANG_TAIL = -4_000_000_000_000_000_001, 5_000_000_000_000_000_002  # signed
UNSEEN = 1999  # a hash no store with tokens ever named


class _StandIn:
    """Whatever an event module imports from the rest of its engine: usable as a type
    (in annotations) and as a callable (init_logger(__name__))."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return logging.getLogger("corpus")


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any module of the given packages, as a module whose every name is a _StandIn."""

    def __init__(self, packages: Sequence[str]) -> None:
        self.packages = set(packages)

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".")[0] not in self.packages:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda name: _StandIn  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def event_module(engine: str, release: str, folder: Path) -> Any:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder),
         f"{engine}=={release}"],
        check=True,
    )  # fmt: skip
    (wheel,) = folder.glob(f"{engine}-{release}-*.whl")
    source = folder / f"{engine}_{release.replace('.', '_')}_kv_events.py"
    with zipfile.ZipFile(wheel) as archive:
        source.write_bytes(archive.read(EVENT_MODULES[engine]))
    wheel.unlink()  # hundreds of MB: one at a time
    spec = importlib.util.spec_from_file_location(source.stem, source)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fields_of(cls: Any, **fields: Any) -> Any:
    """An event of `cls` with those of `fields` that its release has."""
    return cls(**{name: value for name, value in fields.items() if name in cls.__struct_fields__})


def vllm_batches(kv: Any) -> dict[str, Any]:
    """A salted chain of two blocks (the salt in the first block's extra keys, where a
    release has them), the second block removed, then the cache cleared; from 0.32,
    also offload placeholders, a lowercase medium and remote locality."""

    def stored(hashes: list[int], parent: int | None, tokens: list[int], **more: Any) -> Any:
        salted = parent is None
        return fields_of(
            kv.BlockStored,
            block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
            block_size=BLOCK_SIZE, lora_id=None, medium="GPU", lora_name=None,
            extra_keys=[[SALT] if salted and i == 0 else None for i in range(len(hashes))],
            group_idx=0, **more,
        )  # fmt: skip

    def removed(hashes: list[int], **more: Any) -> Any:
        return fields_of(
            kv.BlockRemoved, **{"block_hashes": hashes, "medium": "GPU", "group_idx": 0, **more}
        )

    batches = {
        "chain": [
            stored([HEAD], None, TOKENS[:4]),
            stored([TAIL], HEAD, TOKENS[4:]),
            removed([TAIL]),
            kv.AllBlocksCleared(),
        ]
    }
    if "locality" in kv.BlockStored.__struct_fields__:  # vLLM 0.26 and later

        def placeholder(block_hash: int, medium: str) -> Any:
            # As the offloading connector's OffloadingEventsTracker._placeholder_stored
            # builds it (vLLM 0.32: kv_transfer/kv_connector/v1/offloading/events.py).
            return kv.BlockStored(
                block_hashes=[block_hash], parent_block_hash=None, token_ids=[], lora_id=None,
                block_size=0, medium=medium, lora_name=None, group_idx=0, locality=None,
                ownership=None,
            )  # fmt: skip

        chain = stored([HEAD, TAIL], None, TOKENS)
        batches["offload"] = [
            unsalted(chain),
            placeholder(TAIL, "CPU"),
            placeholder(UNSEEN, "STORAGE"),
            removed([HEAD, TAIL]),
        ]
        batches["lowercase-medium"] = [  # as vLLM's Mooncake store worker and LMCache name it
            unsalted(chain, medium="cpu"),
            removed([TAIL], medium="cpu"),
        ]
        batches["remote"] = [  # a block another node holds, among the publisher's own
            unsalted(chain, medium="CPU", locality="REMOTE"),
            unsalted(chain, locality="LOCAL"),
            removed([HEAD], medium="CPU", locality="REMOTE"),
            kv.AllBlocksCleared(),
        ]
    return {name: kv.KVEventBatch(ts=TS, events=events, data_parallel_rank=0)
            for name, events in batches.items()}  # fmt: skip


def unsalted(event: Any, **changes: Any) -> Any:
    """A copy of a stored event without its salt, with `changes`."""
    fields = {name: getattr(event, name) for name in event.__struct_fields__}
    fields["extra_keys"] = [None] * len(fields["block_hashes"])
    return type(event)(**{**fields, **changes})


def sglang_batches(kv: Any) -> dict[str, Any]:
    """A salted chain's first block on the GPU (the salt where the release puts it; none
    up to 0.5.17), its second in host memory, the first removed, the cache cleared."""
    stored: dict[str, Any] = dict(
        block_hashes=[SGLANG_HEAD], parent_block_hash=None, token_ids=TOKENS[:4],
        block_size=BLOCK_SIZE, lora_id=None, medium="GPU",
    )  # fmt: skip
    if hasattr(kv, "BlockStoredWithMetadata"):  # 0.5.18, 0.5.19
        first = kv.BlockStoredWithMetadata(
            **stored, metadata=kv.BlockStoredMetadata(cache_salt=SALT)
        )
    else:  # from 0.5.20 a field; up to 0.5.17 none
        first = fields_of(kv.BlockStored, **stored, cache_salt=SALT)
    second = kv.BlockStored(
        block_hashes=[SGLANG_TAIL], parent_block_hash=SGLANG_HEAD, token_ids=TOKENS[4:],
        block_size=BLOCK_SIZE, lora_id=None, medium="CPU_PINNED",
    )  # fmt: skip
    events = [first, second, kv.BlockRemoved(block_hashes=[SGLANG_HEAD], medium="GPU")]
    events.append(kv.AllBlocksCleared())
    return {"chain": kv.KVEventBatch(ts=TS, events=events, attn_dp_rank=0)}


def main() -> None:
    sys.meta_path.insert(0, _StandIns(list(EVENT_MODULES)))
    encoder = msgspec.msgpack.Encoder()  # as both engines' ZmqEventPublisher encode a batch
    makers: dict[str, tuple[Sequence[str], Callable[[Any], dict[str, Any]]]] = {
        "vllm": (VLLM_RELEASES, vllm_batches),
        "sglang": (SGLANG_RELEASES, sglang_batches),
    }
    with tempfile.TemporaryDirectory() as temporary:
        for engine, (releases, batches) in makers.items():
            for release in releases:
                kv = event_module(engine, release, Path(temporary))
                for name, batch in batches(kv).items():
                    (HERE / f"{engine}-{release}-{name}.bin").write_bytes(encoder.encode(batch))


if __name__ == "__main__":
    main()
