"""Command-line flags: generated from a pydantic model's fields, so that a setting is
declared once (type, default, description) and `--help` documents it; and the router's
and agent's flags, which land in the one Settings model (kvplane/core/config.py)."""

from __future__ import annotations

import argparse
import enum
import json
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from kvplane.core.config import AgentSettings, Settings, load_settings


def add_model_flags(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    *,
    dest_prefix: str = "",
    skip: Iterable[str] = (),
) -> list[str]:
    """One flag per field (`--field-name`), stored as `dest_prefix + field` and left out
    of the namespace unless given. Nested models and mappings take JSON. Returns the
    field names that got a flag."""
    names = []
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        default = field.get_default(call_default_factory=True)
        shown = default.model_dump_json() if isinstance(default, BaseModel) else default
        help_text = field.description or ""
        if default is not None and default != {}:  # a None default is explained in words
            help_text += f" (default: {shown})"
        kind = _unwrap_optional(field.annotation)
        options: dict[str, Any] = {
            "dest": dest_prefix + name,
            "default": argparse.SUPPRESS,
            "help": help_text,
        }
        flag = "--" + name.replace("_", "-")
        origin = typing.get_origin(kind)
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **options)
        elif origin is list:
            parser.add_argument(flag, nargs="+", metavar="NAME", **options)
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            parser.add_argument(flag, choices=[member.value for member in kind], **options)
        elif origin is Literal:
            parser.add_argument(flag, choices=list(typing.get_args(kind)), **options)
        elif origin is dict or (isinstance(kind, type) and issubclass(kind, BaseModel)):
            parser.add_argument(flag, metavar="JSON", type=_json, **options)
        else:
            parser.add_argument(flag, metavar=name.upper(), **options)
        names.append(name)
    return names


def given_flags(
    args: argparse.Namespace, names: Iterable[str], dest_prefix: str = ""
) -> dict[str, Any]:
    """The fields whose flags were given, by field name."""
    values = vars(args)
    return {name: values[dest_prefix + name] for name in names if dest_prefix + name in values}


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error.msg})") from None


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    """--config, --block-size and the logging flags, which every kvplane process takes."""
    parser.add_argument(
        "--config", type=Path, help="TOML configuration file (flags and KVPLANE_* win)"
    )
    parser.add_argument("--block-size", type=int, help="tokens per kvplane block key (default 16)")
    parser.add_argument(
        "--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default INFO"
    )
    parser.add_argument(
        "--log-format", choices=["text", "json"], help="text, or JSON lines (default text)"
    )


def add_router_flags(parser: argparse.ArgumentParser) -> None:
    """The common flags and the router's own (each sets one field of Settings)."""
    add_common_flags(parser)
    parser.add_argument(
        "--index", choices=["memory", "redis", "redis-cluster"], help="location index backend"
    )
    parser.add_argument("--redis-url", help="Redis URL for the redis backends")
    parser.add_argument("--grpc-port", type=int, help="control-plane gRPC port (default 50051)")
    parser.add_argument("--http-port", type=int, help="HTTP port (default 8080)")
    parser.add_argument("--lease-s", type=float, help="worker lease in seconds (default 5)")
    parser.add_argument("--http-host", help="HTTP address to listen on (default 127.0.0.1)")
    parser.add_argument(
        "--admin-port", type=int, help="serve the fleet API and /metrics on this port alone"
    )
    parser.add_argument("--grpc-host", help="gRPC address to listen on (default 127.0.0.1)")
    parser.add_argument(
        "--picker-port", type=int, help="serve the gateway's endpoint picker (Envoy ext_proc)"
    )
    parser.add_argument("--picker-host", help="picker address to listen on (default 127.0.0.1)")
    parser.add_argument(
        "--tokenizer", type=Path, help="the served model's Hugging Face tokenizer directory"
    )
    parser.add_argument("--tenants-file", type=Path, help="TOML file of [[tenants]] tables")
    parser.add_argument("--otlp-endpoint", help="export spans over OTLP/HTTP to this URL")
    parser.add_argument(
        "--policy", choices=["kvplane", "round-robin"], help="routing policy (default kvplane)"
    )
    parser.add_argument(
        "--flow-control",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="hold requests in the router while their engines are saturated (default off)",
    )


_AGENT_DEST = "agent_"


def add_agent_flags(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser, AgentSettings, dest_prefix=_AGENT_DEST)


_FLAG_TO_SETTING = {
    "index": ("index", "backend"),
    "redis_url": ("index", "redis_url"),
    "grpc_port": ("control_plane", "grpc_port"),
    "http_port": ("http", "port"),
    "block_size": ("control_plane", "block_size"),
    "lease_s": ("control_plane", "lease_s"),
    "http_host": ("http", "host"),
    "admin_port": ("http", "admin_port"),
    "grpc_host": ("control_plane", "grpc_host"),
    "picker_port": ("picker", "port"),
    "picker_host": ("picker", "host"),
    "tokenizer": ("proxy", "tokenizer_dir"),
    "tenants_file": ("tenants", "tenants_file"),
    "otlp_endpoint": ("tracing", "otlp_endpoint"),
    "policy": ("scoring", "policy"),
    "flow_control": ("flow_control", "enabled"),
    "log_level": ("logging", "level"),
    "log_format": ("logging", "format"),
}


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The settings of the --config file, KVPLANE_* environment and the flags given,
    flags winning."""
    overrides: dict[str, dict[str, Any]] = {}
    for flag, (section, name) in _FLAG_TO_SETTING.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides.setdefault(section, {})[name] = value
    agent = given_flags(args, AgentSettings.model_fields, _AGENT_DEST)
    if agent:
        overrides.setdefault("agent", {}).update(agent)
    return load_settings(args.config, overrides)


def add_check_flags(parser: argparse.ArgumentParser) -> None:
    """`kvplane check`'s flags (its admin token is read from the environment)."""
    parser.add_argument(
        "--router-url",
        default="http://127.0.0.1:8080",
        help="the router's fleet API: its admin port when it has one (default "
        "http://127.0.0.1:8080)",
    )
    parser.add_argument(
        "--wait-s",
        type=float,
        default=5.0,
        help="how long each probe's blocks may take to reach the index (default 5)",
    )
    parser.add_argument(
        "--no-probe", action="store_true", help="judge from what the router knows; send nothing"
    )
    parser.add_argument("--json", action="store_true", help="print the router's answer as JSON")
