"""Command-line flags generated from a pydantic model's fields, so that a setting is
declared once (type, default, description) and `--help` documents it."""

from __future__ import annotations

import argparse
import enum
import json
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel


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
