"""Rendering the Helm chart with the real helm binary (`make helm` puts it in .tools/)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import heavy

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvplane"
HELM = ROOT / ".tools" / "helm"


class RenderError(Exception):
    pass


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    heavy.require("helm")
    if not HELM.exists():
        pytest.fail(f"no helm at {HELM}: run `make helm`")
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, check=False)


def values_file(tmp_path: Path, values: dict[str, Any]) -> Path:
    path = tmp_path / "values.json"  # JSON is YAML: helm reads it as a values file
    path.write_text(json.dumps(values))
    return path


def render(
    tmp_path: Path, values: dict[str, Any], *, api_versions: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Every object `helm template` renders; RenderError with helm's message if it fails."""
    args = ["template", "rel", str(CHART), "--values", str(values_file(tmp_path, values))]
    for api in api_versions:
        args += ["--api-versions", api]
    done = helm(*args)
    if done.returncode != 0:
        raise RenderError(done.stderr)
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in by_kind(objects, kind) if o["metadata"]["name"] == name]
    return found


def container(pod_owner: dict[str, Any], name: str) -> dict[str, Any]:
    containers = pod_owner["spec"]["template"]["spec"]["containers"]
    (found,) = [c for c in containers if c["name"] == name]
    return found


def flags(args: Sequence[str]) -> dict[str, str]:
    """`--name=value` arguments as a mapping."""
    return dict(arg[2:].split("=", 1) for arg in args if arg.startswith("--") and "=" in arg)
