"""The generated stubs in kvplane/wire/v1 must be exactly what `make proto` produces."""

from __future__ import annotations

from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    protos = sorted((ROOT / "proto" / "kvplane" / "wire" / "v1").glob("*.proto"))
    assert protos, "no .proto files found"
    out = str(tmp_path)
    exit_code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--pyi_out={out}",
            *(str(p) for p in protos),
        ]
    )
    assert exit_code == 0
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    for relative in generated:
        committed = ROOT / relative
        assert committed.exists(), f"{relative} is missing: run `make proto`"
        assert committed.read_bytes() == (tmp_path / relative).read_bytes(), (
            f"{relative} is stale: run `make proto`"
        )
