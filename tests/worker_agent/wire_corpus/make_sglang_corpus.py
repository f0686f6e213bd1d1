"""Writes KV event batches made by SGLang's own event classes, one per release, next to
this file.

    .venv/bin/python tests/worker_agent/wire_corpus/make_sglang_corpus.py

For each release it downloads SGLang's wheel (`pip download --no-deps`, into a temporary
folder), loads only its `sglang/srt/disaggregation/kv_events.py` (which needs msgspec,
zmq and pydantic, all in the project's environment; what it imports from the rest of
SGLang, helpers for its publisher that the event classes do not use, is given
stand-ins), builds one batch with that module's classes and encodes it as its ZMQ
publisher does. The bytes are
committed, and the tests read them without SGLang.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path
from typing import Any

import msgspec

HERE = Path(__file__).parent
RELEASES = ("0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.23")
MODULE = "sglang/srt/disaggregation/kv_events.py"
TS = 1754000200.0
BLOCK_SIZE = 4
HEAD, TAIL = -4_000_000_000_000_000_001, 5_000_000_000_000_000_002  # SGLang's are signed
SALT = "tenant-a"


def event_module(release: str, folder: Path) -> Any:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder),
         f"sglang=={release}"],
        check=True,
    )  # fmt: skip
    (wheel,) = folder.glob(f"sglang-{release}-*.whl")
    source = folder / f"kv_events_{release.replace('.', '_')}.py"
    with zipfile.ZipFile(wheel) as archive:
        source.write_bytes(archive.read(MODULE))
    for name, imported in re.findall(
        r"^from (sglang[\w.]*) import (.+)$", source.read_text(), re.M
    ):
        stand_in = sys.modules.setdefault(name, types.ModuleType(name))
        for attribute in imported.split(","):
            setattr(stand_in, attribute.strip(), object)
    spec = importlib.util.spec_from_file_location(source.stem, source)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def batch(kv: Any) -> Any:
    """A salted chain's first block on the GPU, its second offloaded to host memory
    (CPU_PINNED), the first removed, then the cache cleared."""
    stored: dict[str, Any] = dict(
        block_hashes=[HEAD], parent_block_hash=None, token_ids=[1, 2, 3, 4],
        block_size=BLOCK_SIZE, lora_id=None, medium="GPU",
    )  # fmt: skip
    if hasattr(kv, "BlockStoredWithMetadata"):  # 0.5.18, 0.5.19
        first = kv.BlockStoredWithMetadata(
            **stored, metadata=kv.BlockStoredMetadata(cache_salt=SALT)
        )
    elif "cache_salt" in kv.BlockStored.__struct_fields__:  # 0.5.20 and later
        first = kv.BlockStored(**stored, cache_salt=SALT)
    else:  # 0.5.17: no salt on the wire
        first = kv.BlockStored(**stored)
    second = kv.BlockStored(
        block_hashes=[TAIL], parent_block_hash=HEAD, token_ids=[5, 6, 7, 8],
        block_size=BLOCK_SIZE, lora_id=None, medium="CPU_PINNED",
    )  # fmt: skip
    events = [
        first,
        second,
        kv.BlockRemoved(block_hashes=[HEAD], medium="GPU"),
        kv.AllBlocksCleared(),
    ]
    return kv.KVEventBatch(ts=TS, events=events, attn_dp_rank=0)


def main() -> None:
    encoder = msgspec.msgpack.Encoder()  # as ZmqEventPublisher encodes a batch
    with tempfile.TemporaryDirectory() as temporary:
        for release in RELEASES:
            kv = event_module(release, Path(temporary))
            (HERE / f"sglang-{release}.bin").write_bytes(encoder.encode(batch(kv)))


if __name__ == "__main__":
    main()
