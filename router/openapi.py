"""The router's HTTP API as an OpenAPI 3.1 document, written by hand and served at
`GET /openapi.json` (tests/abuse fuzzes the running fleet against it).

The request schemas say what the router itself reads and checks (the API key, the
body's size, JSON, `model`, `stream`, `prompt` or `messages`). Every other field goes
to the engine as the client sent it, and the engine's 4xx answers reach the client
unchanged: the few engine-checked fields described here (`max_tokens`, the messages'
shape) say so, and an engine may be more lenient than their types (vLLM's, like the
simulator's, coerce numeric strings and booleans to integers).
"""

from __future__ import annotations

from typing import Any

_MAX_TOKEN_ID = 2**32 - 1

_JSON = "application/json"


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {_JSON: {"schema": schema}}


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {"description": description, "content": _json(_ref("Error"))}
    if headers:
        response["headers"] = headers
    return response


def _ok(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": _json(schema)}


def _header(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "required": True, "schema": schema}


_RETRY_AFTER = {"retry-after": _header({"type": "integer", "minimum": 0}, "seconds")}
_UNAUTHORIZED = _error(
    "no valid key (Authorization: Bearer KEY)",
    {"www-authenticate": _header({"type": "string"}, "Bearer")},
)
_ADMIN_ERRORS = {
    "401": _UNAUTHORIZED,
    "403": _error("the fleet API is off: no http.admin_token is configured"),
}
_BODY_ERRORS = {
    "400": _error("not JSON, not an object, or a field the router reads is wrong"),
    "413": _error("the body is over proxy.max_body_bytes"),
}


def _generation(request: str, description: str) -> dict[str, Any]:
    """POST /v1/completions or /v1/chat/completions."""
    routed = {
        "x-kvplane-worker": _header({"type": "string"}, "the worker that answered"),
        "x-kvplane-cached-tokens": _header(
            {"type": "integer", "minimum": 0}, "the cached prefix the router predicted there"
        ),
        "x-kvplane-attempts": _header(
            {"type": "integer", "minimum": 1}, "the workers tried, this one included"
        ),
    }
    return {
        "summary": description,
        "description": (
            "Routed to the worker holding most of the prompt's prefix, net of load; "
            "the engine's answer (and its errors) come back unchanged."
        ),
        "security": [{"tenantKey": []}],
        "requestBody": {"required": True, "content": _json(_ref(request))},
        "responses": {
            "200": {
                "description": "the engine's answer; `text/event-stream` when `stream` is true",
                "headers": routed,
                "content": {
                    **_json(_ref("Completion")),
                    "text/event-stream": {"schema": _ref("StreamEvent")},
                },
            },
            "400": _error(
                "refused by the router (not JSON, not an object, `model`, `stream`, "
                "`prompt` or `messages`) or by the engine (its own checks)"
            ),
            "401": _UNAUTHORIZED,
            "404": _error("the engine does not serve the model"),
            "413": _BODY_ERRORS["413"],
            "503": _error(
                "no live worker, none answered before its first byte, or the router's "
                "connections to the engines are all in use",
                _RETRY_AFTER,
            ),
        },
    }


def _locality(description: str, *, admin: bool) -> dict[str, Any]:
    errors = (
        {**_ADMIN_ERRORS, "404": _error("no such tenant")}
        if admin
        else {"401": _UNAUTHORIZED, "403": _error("a tenant's key queries its own scope only")}
    )
    return {
        "summary": description,
        "description": "Nothing is sent to an engine.",
        "security": [{"adminToken": []}] if admin else [{"tenantKey": []}],
        "requestBody": {"required": True, "content": _json(_ref("LocalityQuery"))},
        "responses": {"200": _ok(_ref("Locality")), **_BODY_ERRORS, **errors},
    }


def _drain(drained: bool) -> dict[str, Any]:
    verb = "stop" if drained else "resume"
    return {
        "summary": f"{verb} routing to a worker (this router only)",
        "security": [{"adminToken": []}],
        "parameters": [
            {
                "name": "worker_id",
                "in": "path",
                "required": True,
                "description": "as the worker's agent registered it; any other is unknown",
                "schema": {"type": "string", "pattern": r"^[A-Za-z0-9._:-]{1,128}$"},
            }
        ],
        "responses": {
            "200": _ok(
                {
                    "type": "object",
                    "required": ["worker_id", "drained"],
                    "properties": {
                        "worker_id": {"type": "string"},
                        "drained": {"const": drained},
                    },
                }
            ),
            **_ADMIN_ERRORS,
            "404": _error("no such worker"),
        },
    }


def _schemas() -> dict[str, Any]:
    token_ids = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "integer", "minimum": 0, "maximum": _MAX_TOKEN_ID},
    }
    model = {"type": "string", "minLength": 1, "description": "a model (or LoRA adapter) name"}
    stream = {"type": ["boolean", "null"], "default": False}
    max_tokens = {
        "type": ["integer", "null"],
        "minimum": 1,
        "description": "checked by the engine, with the prompt, against its context length",
    }
    message = {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"type": "string"},
            "content": {
                "anyOf": [
                    {"type": ["string", "null"]},
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["type"],
                            "properties": {"type": {"type": "string"}, "text": {"type": "string"}},
                        },
                    },
                ]
            },
        },
    }
    rendered = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string"},
            "content": {
                "anyOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["type", "text"],
                            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                        },
                    },
                ]
            },
        },
    }
    return {
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["message", "type", "code"],
                    "properties": {
                        "message": {"type": "string", "description": "never prompt text"},
                        "type": {"type": "string"},
                        "param": {"type": ["string", "null"]},
                        "code": {"type": "integer"},
                    },
                }
            },
        },
        "CompletionRequest": {
            "type": "object",
            "description": (
                "`cache_salt` is kept only in the shared (anonymous) scope: a tenant's "
                "scope sets its own. Other fields go to the engine as sent."
            ),
            "required": ["model", "prompt"],
            "properties": {
                "model": model,
                "prompt": {
                    "description": "text or token ids, or a batch (routed on its first prompt)",
                    "anyOf": [
                        {"type": "string"},
                        token_ids,
                        {"type": "array", "minItems": 1, "items": {"type": "string"}},
                        {"type": "array", "minItems": 1, "items": token_ids},
                    ],
                },
                "stream": stream,
                "max_tokens": max_tokens,
            },
        },
        "ChatCompletionRequest": {
            "type": "object",
            "description": (
                "The router checks that `messages` is an array and renders it with the "
                "model's chat template to route it; the engine checks the messages."
            ),
            "required": ["model", "messages"],
            "properties": {
                "model": model,
                "messages": {"type": "array", "minItems": 1, "items": message},
                "stream": stream,
                "max_tokens": max_tokens,
                "max_completion_tokens": max_tokens,
            },
        },
        "Completion": {
            "type": "object",
            "required": ["id", "object", "model", "choices"],
            "properties": {
                "id": {"type": "string"},
                "object": {"type": "string"},
                "model": {"type": "string"},
                "choices": {"type": "array", "items": {"type": "object"}},
                "usage": {"type": ["object", "null"]},
            },
        },
        "StreamEvent": {
            "type": "object",
            "description": (
                "One server-sent event: a chunk as JSON, an error object if the engine "
                "broke the stream after its first byte, then `[DONE]`."
            ),
            "required": ["data"],
            "properties": {"data": {"type": "string"}},
        },
        "LocalityQuery": {
            "type": "object",
            "description": (
                "`token_ids` if given, else `messages`, else `prompt`; the others are "
                "ignored. Messages must render with the model's chat template (the shape "
                "here is what kvplane's default template accepts)."
            ),
            "required": ["model"],
            "properties": {
                "model": model,
                "token_ids": {**token_ids, "minItems": 0},
                "tenant": {"type": "string", "description": "whose scope; default: anonymous"},
            },
            "anyOf": [
                {"required": ["token_ids"]},
                {
                    "required": ["messages"],
                    "not": {"required": ["token_ids"]},
                    "properties": {"messages": {"type": "array", "minItems": 1, "items": rendered}},
                },
                {
                    "required": ["prompt"],
                    "not": {"anyOf": [{"required": ["token_ids"]}, {"required": ["messages"]}]},
                    "properties": {"prompt": _ref("RoutedPrompt")},
                },
            ],
        },
        "RoutedPrompt": {
            "description": "text, token ids, or a batch: the router reads its first prompt",
            "anyOf": [
                {"type": "string"},
                token_ids,
                {"type": "array", "minItems": 1, "prefixItems": [_ref("RoutedPrompt")]},
            ],
        },
        "Locality": {
            "type": "object",
            "required": ["model", "tenant", "prompt_tokens", "chosen", "workers"],
            "properties": {
                "model": {"type": "string"},
                "tenant": {"type": "string"},
                "cache_scope": {"type": "string"},
                "prompt_tokens": {"type": "integer", "minimum": 0},
                "blocks": {"type": "integer", "minimum": 0},
                "index_answered": {"type": "boolean"},
                "chosen": {"type": ["string", "null"]},
                "factor": {"type": "string"},
                "workers": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["worker_id", "eligible", "cached_tokens"],
                        "properties": {
                            "worker_id": {"type": "string"},
                            "eligible": {"type": "boolean"},
                            "cached_tokens": {"type": "integer", "minimum": 0},
                            "score": {"type": "number"},
                        },
                    },
                },
            },
        },
    }


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 description of every route the router serves."""
    string = {"type": "string"}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kvplane router",
            "version": "1",
            "description": (
                "An OpenAI-compatible proxy that routes each request to the engine replica "
                "holding most of its prompt's prefix, and the fleet API for operators "
                "(only on http.admin_port when one is set, like /metrics). Errors have the "
                "OpenAI shape and never contain prompt or completion text."
            ),
        },
        "paths": {
            "/v1/completions": {"post": _generation("CompletionRequest", "a completion")},
            "/v1/chat/completions": {
                "post": _generation("ChatCompletionRequest", "a chat completion")
            },
            "/v1/models": {
                "get": {
                    "summary": "the models live workers serve",
                    "security": [{"tenantKey": []}],
                    "responses": {
                        "200": _ok(
                            {
                                "type": "object",
                                "required": ["object", "data"],
                                "properties": {
                                    "object": {"const": "list"},
                                    "data": {
                                        "type": "array",
                                        "items": {
                                            "type": "object",
                                            "required": ["id", "object"],
                                            "properties": {"id": string, "object": string},
                                        },
                                    },
                                },
                            }
                        ),
                        "401": _UNAUTHORIZED,
                    },
                }
            },
            "/healthz": {
                "get": {
                    "summary": "the process is up",
                    "security": [],
                    "responses": {
                        "200": _ok(
                            {"type": "object", "properties": {"status": {"const": "ok"}}},
                        )
                    },
                }
            },
            "/readyz": {
                "get": {
                    "summary": "200 while gRPC serves; the body says whether routing is "
                    "cache-aware or load-only (the index unreachable)",
                    "security": [],
                    "responses": {
                        status: _ok(
                            {
                                "type": "object",
                                "required": ["ready", "grpc", "index", "routing"],
                                "properties": {
                                    "ready": {"type": "boolean"},
                                    "grpc": string,
                                    "index": string,
                                    "routing": {"enum": ["cache-aware", "load-only"]},
                                },
                            },
                            description,
                        )
                        for status, description in (("200", "ready"), ("503", "not serving"))
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics (on the admin port when one is set)",
                    "security": [],
                    "responses": {
                        "200": {"description": "OK", "content": {"text/plain": {"schema": string}}}
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "this document",
                    "security": [],
                    "responses": {"200": _ok({"type": "object"})},
                }
            },
            "/fleet/workers": {
                "get": {
                    "summary": "every worker: state, incarnation, load, lease, index entries",
                    "security": [{"adminToken": []}],
                    "responses": {
                        "200": _ok(
                            {
                                "type": "object",
                                "required": ["workers", "index_reachable"],
                                "properties": {
                                    "index_reachable": {"type": "boolean"},
                                    "workers": {
                                        "type": "array",
                                        "items": {
                                            "type": "object",
                                            "required": ["worker_id", "state", "incarnation"],
                                            "properties": {
                                                "worker_id": string,
                                                "state": {"enum": ["live", "draining", "dead"]},
                                                "incarnation": {"type": "integer", "minimum": 1},
                                            },
                                        },
                                    },
                                },
                            }
                        ),
                        **_ADMIN_ERRORS,
                    },
                }
            },
            "/fleet/locality": {
                "post": _locality(
                    "where a prompt's prefix is cached, each score term, and the pick",
                    admin=True,
                )
            },
            "/fleet/index": {
                "get": {
                    "summary": "index statistics",
                    "security": [{"adminToken": []}],
                    "responses": {
                        "200": _ok(
                            {
                                "type": "object",
                                "required": ["keys", "entries", "workers", "predicted_entries"],
                                "properties": {
                                    name: {"type": "integer", "minimum": 0}
                                    for name in (
                                        "keys",
                                        "entries",
                                        "workers",
                                        "bytes",
                                        "predicted_entries",
                                    )
                                },
                            }
                        ),
                        **_ADMIN_ERRORS,
                        "503": _error("the index is unreachable"),
                    },
                }
            },
            "/fleet/workers/{worker_id}/drain": {"post": _drain(True)},
            "/fleet/workers/{worker_id}/undrain": {"post": _drain(False)},
            "/fleet/tenants/{name}/purge": {
                "post": {
                    "summary": "a new generation of the tenant's cache scope (a new salt)",
                    "security": [{"adminToken": []}],
                    "parameters": [
                        {
                            "name": "name",
                            "in": "path",
                            "required": True,
                            "description": "a configured tenant; any other is unknown",
                            "schema": {"type": "string", "pattern": r"^[A-Za-z0-9._-]{1,64}$"},
                        }
                    ],
                    "responses": {
                        "200": _ok(
                            {
                                "type": "object",
                                "required": ["tenant", "cache_scope", "generation"],
                                "properties": {
                                    "tenant": string,
                                    "cache_scope": string,
                                    "generation": {"type": "integer", "minimum": 1},
                                },
                            }
                        ),
                        "400": _error("the tenant uses the shared scope, which has no salt"),
                        **_ADMIN_ERRORS,
                        "404": _error("no such tenant"),
                        "503": _error("the index is unreachable: the purge may not have happened"),
                    },
                }
            },
            "/fleet/tenant/locality": {
                "post": _locality(
                    "the locality query in the caller's own scope: eligible workers, their "
                    "cached tokens and total scores",
                    admin=False,
                )
            },
        },
        "components": {
            "securitySchemes": {
                "tenantKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "a tenant's API key; none while anonymous access is on",
                },
                "adminToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "http.admin_token",
                },
            },
            "schemas": _schemas(),
        },
    }
