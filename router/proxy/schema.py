"""The OpenAI requests and answers as the OpenAPI document describes them.

The proxy does not validate bodies with these models (bodies.py reads the few fields
the router needs, faster); they say what it reads and checks (`model`, `stream`,
`prompt` or `messages`), and let every other field through, as the proxy does: the
engine judges the rest, and its 4xx answers reach the client unchanged. The few
engine-checked fields described here (`max_tokens`, the messages' shape) say so, and an
engine may be more lenient than their types (vLLM's, like the simulator's, coerce
numeric strings and booleans to integers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NotRequired

from pydantic import BaseModel, ConfigDict, Field, GetJsonSchemaHandler, RootModel
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema
from pydantic_core import core_schema as core_schema_of
from typing_extensions import TypedDict

from kvplane.core.keys import MAX_TOKEN_ID

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
ModelName = Annotated[str, Field(min_length=1, description="a model (or LoRA adapter) name")]
EngineChecked = Annotated[int, Field(ge=1)] | None
_ENGINE_CHECKED = "checked by the engine, with the prompt, against its context length"


@dataclass(frozen=True, slots=True)
class FirstItem:
    """A list of which only the first item is read, and must be `item()`: JSON Schema's
    `prefixItems` (pydantic has no type for it). `item` is called late, so that a model
    may name itself."""

    item: Callable[[], type[BaseModel]]

    def __get_pydantic_json_schema__(
        self, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler(core_schema)
        # A reference to the item's definition, not the definition again: the item may
        # be the model this list is part of.
        item = core_schema_of.definition_reference_schema(
            self.item().__pydantic_core_schema__["ref"]
        )
        schema["prefixItems"] = [handler(item)]
        return schema


class RoutedPrompt(
    RootModel[
        str | TokenIds | Annotated[list[Any], Field(min_length=1), FirstItem(lambda: RoutedPrompt)]
    ]
):
    """Text, token ids, or a batch: the router reads its first prompt."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: ModelName
    stream: bool | None = False
    max_tokens: EngineChecked = Field(default=None, description=_ENGINE_CHECKED)


class CompletionRequest(_Request):
    """`cache_salt` is kept only in the shared (anonymous) scope: a tenant's scope sets
    its own. Other fields go to the engine as sent."""

    prompt: (
        str
        | TokenIds
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1)]
    ) = Field(description="text or token ids, or a batch (routed on its first prompt)")


class ContentPart(TypedDict):
    # A TypedDict: `text` may be left out, but is never null.
    type: str
    text: NotRequired[str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_Request):
    """The router checks that `messages` is an array and renders it with the model's
    chat template to route it; the engine checks the messages."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: EngineChecked = Field(default=None, description=_ENGINE_CHECKED)


class Completion(BaseModel):
    """The engine's answer, as it sent it."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: str
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class StreamEvent(BaseModel):
    """One server-sent event: a chunk as JSON, an error object if the engine broke the
    stream after its first byte, then `[DONE]`."""

    data: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "kvplane"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
