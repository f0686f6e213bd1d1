"""An engine's KV transfer configuration (kvplane/core/kv_transfer.py): vLLM's
`--kv-transfer-config` JSON read, and the role a worker registers with."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvplane.core.config import AgentSettings
from kvplane.core.kv_transfer import (
    ConfiguredRole,
    KvTransferConfig,
    parse_kv_transfer_config,
    worker_role,
)
from kvplane.core.types import WorkerRole

NIXL_BOTH = KvTransferConfig("NixlConnector", "kv_both")

# -- parse_kv_transfer_config -------------------------------------------------------------


@pytest.mark.parametrize("text", ["{}", '{"kv_connector": null}', '{"kv_role": "kv_producer"}'])
def test_a_config_naming_no_connector_is_no_transfer(text: str) -> None:
    assert parse_kv_transfer_config(text) is None


def test_vllms_json_gives_its_connector_and_role() -> None:
    text = '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_rank": 1}'
    assert parse_kv_transfer_config(text) == KvTransferConfig("NixlConnector", "kv_consumer")


@pytest.mark.parametrize(
    "text",
    ['{"kv_connector": "NixlConnector"}', '{"kv_connector": "NixlConnector", "kv_role": null}'],
)
def test_a_connector_without_a_role_is_refused_as_vllm_refuses_it(text: str) -> None:
    with pytest.raises(ValueError, match="needs kv_role with kv_connector"):
        parse_kv_transfer_config(text)


def test_json_that_does_not_parse_is_refused_saying_so() -> None:
    with pytest.raises(ValueError, match="kv_transfer_config is not valid JSON"):
        parse_kv_transfer_config('{"kv_connector": "NixlConnector"')


@pytest.mark.parametrize("text", ["[]", '"NixlConnector"', "3", "null"])
def test_json_that_is_not_an_object_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="must be a JSON object"):
        parse_kv_transfer_config(text)


@pytest.mark.parametrize("role", ['"kv_prefill"', '"KV_BOTH"', "1"])
def test_a_role_vllm_does_not_know_is_refused_naming_the_known_ones(role: str) -> None:
    text = f'{{"kv_connector": "NixlConnector", "kv_role": {role}}}'
    with pytest.raises(
        ValueError, match="kv_role must be one of kv_producer, kv_consumer, kv_both"
    ):
        parse_kv_transfer_config(text)


@pytest.mark.parametrize("connector", ['""', "5", '["NixlConnector"]', '"Nixl\\nConnector"'])
def test_an_empty_or_odd_connector_is_refused(connector: str) -> None:
    with pytest.raises(ValueError, match="kv_connector must be a connector's name"):
        parse_kv_transfer_config(f'{{"kv_connector": {connector}, "kv_role": "kv_both"}}')


# -- worker_role --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv_role", "role"),
    [
        ("kv_producer", WorkerRole.PREFILL),
        ("kv_consumer", WorkerRole.DECODE),
        ("kv_both", WorkerRole.BOTH),
    ],
)
def test_auto_takes_the_role_from_the_engines_kv_role(kv_role: str, role: WorkerRole) -> None:
    engine = KvTransferConfig("NixlConnector", kv_role)
    assert worker_role("auto", engine) == (role, "NixlConnector")


def test_auto_without_an_engine_config_serves_whole_requests() -> None:
    assert worker_role("auto", None) == (WorkerRole.BOTH, "")


def test_both_without_an_engine_config_has_no_connector() -> None:
    assert worker_role("both", None) == (WorkerRole.BOTH, "")


@pytest.mark.parametrize("configured", ["prefill", "decode"])
def test_a_set_prefill_or_decode_role_needs_a_connector(configured: ConfiguredRole) -> None:
    with pytest.raises(ValueError, match=f"role {configured} needs the engine's KV connector"):
        worker_role(configured, None)


@pytest.mark.parametrize(
    ("configured", "role"),
    [("prefill", WorkerRole.PREFILL), ("decode", WorkerRole.DECODE), ("both", WorkerRole.BOTH)],
)
def test_a_set_role_overrides_the_engines_and_keeps_its_connector(
    configured: ConfiguredRole, role: WorkerRole
) -> None:
    # NixlConnector deployments give every engine kv_both: the set role splits them.
    assert worker_role(configured, NIXL_BOTH) == (role, "NixlConnector")
    producer = KvTransferConfig("LMCacheConnectorV1", "kv_producer")
    assert worker_role(configured, producer) == (role, "LMCacheConnectorV1")


# -- AgentSettings ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"kv_connector": "NixlConnector", "kv_role": "leader"}', "kv_role must be one of"),
    ],
)
def test_agent_settings_refuse_a_kv_transfer_config_vllm_would_refuse(
    text: str, reason: str
) -> None:
    with pytest.raises(ValidationError, match=reason):
        AgentSettings(kv_transfer_config=text)


def test_agent_settings_keep_a_good_kv_transfer_config_as_given() -> None:
    text = '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'
    settings = AgentSettings(kv_transfer_config=text, role="prefill")
    assert settings.kv_transfer_config == text
    assert settings.role == "prefill"
    assert AgentSettings().kv_transfer_config is None
    assert AgentSettings().role == "auto"
