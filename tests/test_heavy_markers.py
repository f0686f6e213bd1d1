"""The `heavy` marker's enforcement (tests/heavy.py): a test that finds a heavy
environment without the marker fails, a marked one goes on, and a marker that names no
known environment is refused."""

from __future__ import annotations

import pytest

from tests import heavy


def test_an_unmarked_test_that_needs_a_heavy_environment_fails() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"not marked `@pytest.mark.heavy\('vllm'\)`"):
        heavy.require("vllm")


def test_a_test_marked_for_another_environment_fails_too(request: pytest.FixtureRequest) -> None:
    request.node.add_marker(pytest.mark.heavy("helm"))
    with pytest.raises(pytest.fail.Exception, match="peer routers"):
        heavy.require("peers")


def test_a_test_marked_for_the_environment_goes_on(request: pytest.FixtureRequest) -> None:
    request.node.add_marker(pytest.mark.heavy("dynamo", "helm"))
    heavy.require("dynamo")
    heavy.require("helm")


def test_an_unknown_environment_is_a_mistake_in_the_test() -> None:
    with pytest.raises(ValueError, match="unknown heavy environment 'cuda'"):
        heavy.require("cuda")


@pytest.mark.parametrize("mark", [pytest.mark.heavy(), pytest.mark.heavy("cuda")])
def test_a_heavy_marker_names_known_environments(
    request: pytest.FixtureRequest, mark: pytest.MarkDecorator
) -> None:
    request.node.add_marker(mark)
    with pytest.raises(pytest.UsageError, match="takes the names of the environments"):
        heavy.check_marks(request.node)
