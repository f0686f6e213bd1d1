"""The images' Dockerfile, checked without a Docker engine (none runs here): every
final stage runs as a non-root user with a health check, every base image is pinned,
every COPY source exists and is not excluded by .dockerignore, and the final stages
install no compilers."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

import pytest

from tests.deploy.conftest import ROOT

DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
FINAL_STAGES = ("kvplane", "engine-sim")
BUILD_STAGES = ("build", "build-sim")
_COMPILERS = re.compile(r"\b(gcc|g\+\+|clang|build-essential|make|cmake|rustc|cargo)\b")


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [argument for word, argument in self.instructions if word == keyword]


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Build arguments (with defaults) and stages of a Dockerfile."""
    lines = re.sub(r"\\\n", " ", text).splitlines()
    arguments: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, argument = line.partition(" ")
        word = word.upper()
        if word == "ARG" and not stages:
            name, _, default = argument.partition("=")
            arguments[name] = default
        elif word == "FROM":
            parts = argument.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else parts[0]
            stages.append(Stage(name, parts[0]))
        else:
            stages[-1].instructions.append((word, argument.strip()))
    return arguments, stages


ARGUMENTS, STAGES = parse(DOCKERFILE.read_text())
BY_NAME = {stage.name: stage for stage in STAGES}


def lineage(stage: Stage) -> list[Stage]:
    """The stage and the stages it is built FROM, nearest first."""
    chain = [stage]
    while chain[-1].base in BY_NAME:
        chain.append(BY_NAME[chain[-1].base])
    return chain


@pytest.mark.parametrize("name", FINAL_STAGES)
def test_final_stages_run_as_a_non_root_user_with_a_health_check(name: str) -> None:
    chain = lineage(BY_NAME[name])
    users = [user for stage in chain for user in stage.all("USER")]
    assert users, f"{name} sets no USER"
    assert users[0] not in {"root", "0", "0:0"}
    assert any(stage.all("HEALTHCHECK") for stage in chain)
    assert not any("NONE" in check for stage in chain for check in stage.all("HEALTHCHECK"))


def test_every_base_image_is_pinned() -> None:
    for stage in STAGES:
        base = stage.base
        if base in BY_NAME:
            continue
        image = re.sub(r"\$\{(\w+)\}", lambda m: ARGUMENTS[m.group(1)], base)
        assert ":" in image or "@sha256:" in image, f"{base} has no tag"
        tag = image.rsplit(":", 1)[1]
        assert tag != "latest"
        assert re.search(r"\d+\.\d+\.\d+", tag), f"{image}: pin a full version"


def _ignored(path: str, patterns: list[str]) -> bool:
    return any(
        fnmatch.fnmatch(path, pattern) or path.startswith(pattern.rstrip("/") + "/")
        for pattern in patterns
    )


def test_every_copied_file_exists_and_reaches_the_build() -> None:
    ignore = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copies = 0
    for stage in STAGES:
        for argument in stage.all("COPY"):
            if argument.startswith("--from="):
                continue
            *sources, _ = argument.split()
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: no such file"
                assert not _ignored(source, ignore), f"COPY {source} is in .dockerignore"
                copies += 1
    assert copies >= 5


@pytest.mark.parametrize("name", FINAL_STAGES)
def test_final_stages_install_no_compilers(name: str) -> None:
    for stage in lineage(BY_NAME[name]):
        if stage.name in BUILD_STAGES:
            continue
        for command in stage.all("RUN"):
            assert not _COMPILERS.search(command), f"{stage.name}: {command}"
    # Only the virtual environment leaves the build stages.
    copied = [c for stage in lineage(BY_NAME[name]) for c in stage.all("COPY")]
    assert copied
    assert all(re.fullmatch(r"--from=build(-sim)? /opt/kvplane /opt/kvplane", c) for c in copied)


def test_the_product_image_installs_no_extra() -> None:
    """The router and agent image is `pip install .`: no tool dependencies."""
    copied = [c for stage in lineage(BY_NAME["kvplane"]) for c in stage.all("COPY")]
    assert copied == ["--from=build /opt/kvplane /opt/kvplane"]
    installs = [c for c in BY_NAME["build"].all("RUN") if "pip install" in c]
    assert installs
    assert all(c.endswith(" .") for c in installs), installs
    sim_installs = [c for c in BY_NAME["build-sim"].all("RUN") if "pip install" in c]
    assert any("'.[sim]'" in c for c in sim_installs), sim_installs
