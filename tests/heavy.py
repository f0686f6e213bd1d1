"""The heavy environments a test may need, and the marker it must carry to use one.

`make check` runs `pytest -m "not heavy and not slow"`; `make test` runs everything. A
test that needs one of the environments below says so with `@pytest.mark.heavy(NAME)`
(or a module's `pytestmark`), and the helpers that locate an environment call
`require(NAME)` first: it fails the running test when the test lacks the marker, so a
new heavy test that forgets it fails in `make test` instead of slowing `make check`.
(tests/conftest.py tells this module which test is running, and refuses a `heavy`
marker that names no environment below.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from simulations.local_envoy import ENVOY_ENV

ENVIRONMENTS = {
    "vllm": "a real vLLM in .vllm-venv (`make vllm-env`)",
    "peers": "the peer routers in .peers-venv (`make peers-env`)",
    "dynamo": "Dynamo's bindings in .dynamo-venv (`make dynamo-env`)",
    "chromium": "Debian's chromium and chromedriver (`make chromium`)",
    "helm": "helm in .tools/ (`make helm`)",
    "envoy": "a real Envoy in .envoy-venv (`make envoy-env`)",
}

ENVOY = ENVOY_ENV  # where `make envoy-env` puts it

running: pytest.Item | None = None
"""The test being set up, run or torn down (set by tests/conftest.py)."""


def require(environment: str) -> None:
    """Fail the running test unless it is marked `heavy(environment)`."""
    if environment not in ENVIRONMENTS:
        raise ValueError(f"unknown heavy environment {environment!r}: one of {list(ENVIRONMENTS)}")
    item = running
    if item is None:
        raise RuntimeError(f"{ENVIRONMENTS[environment]} is needed outside a running test")
    if not any(environment in mark.args for mark in item.iter_markers("heavy")):
        pytest.fail(
            f"{item.nodeid} uses {ENVIRONMENTS[environment]} but is not marked "
            f"`@pytest.mark.heavy({environment!r})`: mark the test (or its module's "
            "`pytestmark`), so that `make check` leaves it to `make test`",
            pytrace=False,
        )


def check_marks(item: pytest.Item) -> None:
    """A `heavy` marker names at least one environment, each a known one."""
    for mark in item.iter_markers("heavy"):
        unknown = [name for name in mark.args if name not in ENVIRONMENTS]
        if not mark.args or unknown or mark.kwargs:
            raise pytest.UsageError(
                f"{item.nodeid}: `heavy` takes the names of the environments it needs, "
                f"of {list(ENVIRONMENTS)}; got {mark.args!r} {mark.kwargs!r}"
            )


def envoy_binary() -> Path:
    """The real Envoy that `make envoy-env` installs, for a test marked `heavy("envoy")`."""
    require("envoy")
    if not ENVOY.exists():
        pytest.fail(f"no Envoy at {ENVOY}: run `make envoy-env`", pytrace=False)
    return ENVOY
