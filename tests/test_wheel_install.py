"""`pip wheel` on the project's tracked files (a fresh clone: nothing built, no `make`,
no system xxHash needed), the wheel installed into a fresh virtual environment outside
the repository, and `kvplane router` run from there: it serves, and the installed
native chain hashes the published block-key vectors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvplane.core.serving import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
VECTORS = REPO / "docs" / "block-key-vectors.json"

HASH_THE_VECTORS = """
import json, sys
from kvplane.core.keys import KeyNamespace, block_keys
vectors = json.load(open(sys.argv[1]))["vectors"]
for v in vectors:
    namespace = KeyNamespace(v["model"], int(v["block_size"]), v["lora"], v["cache_scope"])
    assert block_keys(v["tokens"], namespace) == v["keys"], v["name"]
import kvplane.core.keys
print(kvplane.core.keys.__file__)
"""


def _fresh_clone(destination: Path) -> Path:
    """The files a clone would hold: git's tracked and not-ignored files, as they are now."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = REPO / name.decode()
        if source.is_file():
            target = destination / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


def _run(*argv: str | Path, cwd: Path) -> None:
    result = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.timeout(600)
def test_the_wheel_builds_from_a_fresh_clone_and_its_router_runs(tmp_path: Path) -> None:
    clone = _fresh_clone(tmp_path / "clone")
    assert not list(clone.rglob("*.so"))
    wheels = tmp_path / "wheels"
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", wheels, clone, cwd=tmp_path)
    (wheel,) = wheels.glob("kvplane-*.whl")

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    _run(venv / "bin" / "pip", "install", "-q", wheel, cwd=tmp_path)
    hashed = subprocess.run(
        [venv / "bin" / "python", "-c", HASH_THE_VECTORS, VECTORS],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert hashed.returncode == 0, hashed.stderr
    assert hashed.stdout.startswith(str(venv))  # the installed package, not the checkout

    http_port, grpc_port = free_port(), free_port()
    argv = ["router", "--http-port", str(http_port), "--grpc-port", str(grpc_port)]
    router = subprocess.Popen(
        [venv / "bin" / "kvplane", *argv],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        # Ready once its gRPC server and index answer: a moment after the process starts.
        deadline, ready = time.monotonic() + 30, None
        while ready is None or (ready.status_code != 200 and time.monotonic() < deadline):
            assert router.poll() is None, router.stderr.read().decode() if router.stderr else ""
            try:
                ready = httpx.get(f"http://127.0.0.1:{http_port}/readyz", timeout=2)
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the installed router did not serve"
            time.sleep(0.2)
        assert ready.status_code == 200, ready.text
        assert json.loads(ready.text)["grpc"] == "serving"
    finally:
        router.kill()
        router.wait()
