"""An engine's KV transfer configuration as a worker's role: vLLM's `kv_transfer_config`
read (its JSON, or the labels of its metrics), and the role a worker registers with.

Pure: the agent reads the engine, the settings validate the JSON an operator gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from kvplane.core.types import WorkerRole

ConfiguredRole = Literal["auto", "both", "prefill", "decode"]

# vLLM's kv_role values (vllm/config/kv_transfer.py) and the legs each takes.
_ROLE_OF_KV_ROLE = {
    "kv_producer": WorkerRole.PREFILL,
    "kv_consumer": WorkerRole.DECODE,
    "kv_both": WorkerRole.BOTH,
}


@dataclass(frozen=True, slots=True)
class KvTransferConfig:
    """The part of vLLM's `kv_transfer_config` a router needs."""

    kv_connector: str  # e.g. "NixlConnector"
    kv_role: str  # kv_producer, kv_consumer, kv_both


def parse_kv_transfer_config(text: str) -> KvTransferConfig | None:
    """vLLM's `--kv-transfer-config` JSON; None where it names no connector (no P/D).
    ValueError, saying why, for anything vLLM itself would refuse."""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"kv_transfer_config is not valid JSON ({error.msg})") from None
    if not isinstance(fields, dict):
        raise ValueError("kv_transfer_config must be a JSON object")
    connector = fields.get("kv_connector")
    if connector is None:
        return None
    if fields.get("kv_role") is None:  # vLLM refuses it too (vllm/config/kv_transfer.py)
        raise ValueError("kv_transfer_config needs kv_role with kv_connector")
    return kv_transfer_config(connector, fields["kv_role"])


def kv_transfer_config(connector: object, role: object) -> KvTransferConfig:
    """A connector and kv_role as the engine gives them, checked."""
    if not isinstance(connector, str) or not connector or not connector.isprintable():
        raise ValueError("kv_connector must be a connector's name")
    if role not in _ROLE_OF_KV_ROLE:
        raise ValueError(f"kv_role must be one of {', '.join(_ROLE_OF_KV_ROLE)}, not {role!r}")
    return KvTransferConfig(connector, str(role))


def worker_role(
    configured: ConfiguredRole, engine: KvTransferConfig | None
) -> tuple[WorkerRole, str]:
    """The role a worker registers with, and its KV connector ("" for none): as set,
    else from the engine's kv_role; an engine without a connector serves whole requests.
    A role set as prefill or decode without a connector is refused: such a worker could
    never take the legs it names."""
    connector = "" if engine is None else engine.kv_connector
    if configured == "auto":
        return (WorkerRole.BOTH if engine is None else _ROLE_OF_KV_ROLE[engine.kv_role]), connector
    role = WorkerRole(configured)
    if role is not WorkerRole.BOTH and engine is None:
        raise ValueError(
            f"role {configured} needs the engine's KV connector: its metrics do not say it, "
            "so set agent.kv_transfer_config to the engine's --kv-transfer-config"
        )
    return role, connector
