"""Bad HTTP input to a running fleet: each request gets a clear 4xx with an error in the
OpenAI shape that does not repeat the request's text, nothing in the index (nor any
tenant's cache salt) changes, and the fleet serves a normal request afterwards, whose
blocks reach the index.

Already covered elsewhere, and not repeated here: parse_body's refusals one by one
(tests/router/proxy/test_bodies.py); broken JSON and a missing model over HTTP, a wrong key
through the official client, a body over the limit with a Content-Length, a tenant's
key on GET /fleet/workers, a tenant's key asking for another tenant's scope on
/fleet/tenant/locality, the admin port (tests/router/proxy/test_routing.py); no live worker
and an unknown model (tests/router/proxy/test_failures.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
import pytest
import pytest_asyncio

from router.lifecycle.bodies import MAX_NESTING
from tests.abuse.conftest import (
    ADMIN,
    SECRET,
    SIM_OPTIONS,
    IndexPicture,
    auth,
    index_picture,
    prime,
    still_serves,
    wait_indexed,
)
from tests.router.proxy.conftest import (
    ADMIN_TOKEN,
    MODEL,
    RoutedFleet,
    routed_fleet,
    router_settings,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_BODY_BYTES = 64 * 1024
PROMPT = f"{SECRET} wants to know how the cache works. " * 3
ACME = auth("acme")
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def body(**fields: object) -> bytes:
    return json.dumps({"model": MODEL, **fields}).encode()


def with_raw_prompt(raw: bytes, path: str = COMPLETIONS) -> bytes:
    """A body whose prompt (or only message) is `raw`, spliced in as bytes."""
    if path == CHAT:
        return b'{"model": "%s", "messages": [{"role": "user", "content": %s}]}' % (
            MODEL.encode(),
            raw,
        )
    return b'{"model": "%s", "max_tokens": 1, "prompt": %s}' % (MODEL.encode(), raw)


NOT_UTF8 = b'"' + SECRET.encode() + b' \xff\xfe"'
LONE_SURROGATE = b'"' + SECRET.encode() + b' \\ud800"'  # escaped, as JSON allows it
SURROGATE_BYTES = b'"' + SECRET.encode() + b' \xed\xa0\x80"'  # encoded, as UTF-8 forbids
DEEP = b"[" * 10_000 + b"]" * 10_000


ACME_KEY = ((b"authorization", ACME["authorization"].encode()),)
ADMIN_KEY = ((b"authorization", ADMIN["authorization"].encode()),)
FORM = (b"content-type", b"application/x-www-form-urlencoded")
NOT_JSON = "not valid JSON"


@dataclass(frozen=True)
class Abuse:
    path: str
    status: int
    content: bytes | None = None
    says: str = ""  # in the error message: which check refused it
    headers: tuple[tuple[bytes, bytes], ...] = ACME_KEY
    method: str = "POST"


def unauthorized(path: str, value: bytes | None, method: str = "POST") -> Abuse:
    headers = () if value is None else ((b"authorization", value),)
    content = with_raw_prompt(json.dumps(PROMPT).encode(), path) if method == "POST" else None
    return Abuse(path, 401, content, "", headers, method)


def abuses() -> Iterator[object]:
    for path in (COMPLETIONS, CHAT):
        name = "chat" if path == CHAT else "completions"
        for raw, why in (
            (NOT_UTF8, "not-utf8"),
            (LONE_SURROGATE, "lone-surrogate"),
            (SURROGATE_BYTES, "surrogate-bytes"),
            (DEEP, "deep-prompt"),
        ):
            yield pytest.param(
                Abuse(path, 400, with_raw_prompt(raw, path), NOT_JSON), id=f"{name}-{why}"
            )
        for content, why in (
            (DEEP, "10000-nested-arrays"),
            (b"", "empty-body"),
            (b"[" + json.dumps(PROMPT).encode() + b"]", "an-array"),
        ):
            yield pytest.param(Abuse(path, 400, content), id=f"{name}-{why}")
        form = b"model=" + MODEL.encode() + b"&prompt=" + SECRET.encode()
        yield pytest.param(Abuse(path, 400, form, NOT_JSON, (*ACME_KEY, FORM)), id=f"{name}-a-form")
        yield pytest.param(
            Abuse(path, 400, body(model=5, prompt=PROMPT), "'model'"), id=f"{name}-model-number"
        )
        messages = [{"role": "user", "content": PROMPT}]
        yield pytest.param(
            Abuse(path, 400, body(prompt=PROMPT, messages=messages, stream="yes"), "'stream'"),
            id=f"{name}-stream-yes",
        )
        # No Authorization, a wrong key, another scheme, the admin token, bytes not ASCII.
        for value, why in (
            (None, "no-key"),
            (b"Bearer sk-wrong", "wrong-key"),
            (b"Basic " + ACME["authorization"].split()[1].encode(), "basic-scheme"),
            (f"Bearer {ADMIN_TOKEN}".encode(), "admin-token"),
            (b"Bearer sk-acme\xc3\xa9\xff", "non-ascii-key"),
        ):
            yield pytest.param(unauthorized(path, value), id=f"{name}-{why}")
    yield pytest.param(unauthorized("/v1/models", None, "GET"), id="models-no-key")
    yield pytest.param(
        unauthorized("/fleet/tenant/locality", b"Bearer \xff\xfe"), id="tenant-locality-bad-key"
    )
    # The fields the engine checks: the router passes on its 400s unchanged.
    yield pytest.param(
        Abuse(CHAT, 400, body(messages=PROMPT, max_tokens=1), "'messages'"),
        id="messages-a-string",
    )
    yield pytest.param(
        Abuse(COMPLETIONS, 400, body(prompt={"text": PROMPT}, max_tokens=1), "prompt"),
        id="prompt-a-dict",
    )
    for max_tokens, why in ((-1, "negative"), (10**30, "huge"), (1.5, "float"), ("many", "text")):
        yield pytest.param(
            Abuse(COMPLETIONS, 400, body(prompt=PROMPT, max_tokens=max_tokens), "max_tokens"),
            id=f"max-tokens-{why}",
        )
    # Just under the body limit, but more tokens than the engines' context.
    long_prompt = (PROMPT * 1000)[: MAX_BODY_BYTES - 100]
    yield pytest.param(
        Abuse(COMPLETIONS, 400, body(prompt=long_prompt, max_tokens=1), "context length"),
        id="too-many-tokens",
    )
    # The fleet API: bytes it cannot read, and a tenant's key on every operator route.
    for path, key in (("/fleet/locality", ADMIN_KEY), ("/fleet/tenant/locality", ACME_KEY)):
        name = path.strip("/").replace("/", "-")
        yield pytest.param(
            Abuse(path, 400, with_raw_prompt(NOT_UTF8), NOT_JSON, key), id=f"{name}-not-utf8"
        )
        yield pytest.param(Abuse(path, 400, DEEP, NOT_JSON, key), id=f"{name}-deep")
    for method, path in (
        ("GET", "/fleet/workers"),
        ("GET", "/fleet/index"),
        ("POST", "/fleet/locality"),
        ("POST", "/fleet/workers/worker-1/drain"),
        ("POST", "/fleet/workers/worker-1/undrain"),
        ("POST", "/fleet/tenants/globex/purge"),
        ("POST", "/fleet/tenants/acme/purge"),
    ):
        query = body(prompt=PROMPT, tenant="globex") if path == "/fleet/locality" else None
        yield pytest.param(
            Abuse(path, 401, query, "admin token", method=method),
            id=f"tenant-key-{method}-{path.strip('/').replace('/', '-')}",
        )
    for path, why in (
        ("/fleet/workers/%ff%00%2e%2e/drain", "odd-worker-id"),
        ("/fleet/tenants/%C3%A9t%C3%A9/purge", "odd-tenant"),
    ):
        yield pytest.param(Abuse(path, 404, None, "no ", ADMIN_KEY), id=why)


@dataclass
class Before:
    """The index and every tenant's cache salt, before a bad request."""

    index: IndexPicture
    salts: dict[str, str | None]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet() -> AsyncIterator[RoutedFleet]:
    settings = router_settings(proxy={"max_body_bytes": MAX_BODY_BYTES})
    async with routed_fleet(2, settings, sim_options=SIM_OPTIONS) as fleet:
        await prime(fleet)
        yield fleet


def salts(fleet: RoutedFleet) -> dict[str, str | None]:
    return {tenant.name: tenant.cache_salt for tenant in fleet.router.tenants.all()}


def assert_clear_error(response: httpx.Response, status: int, says: str = "") -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["message"]
    assert says in error["message"]
    assert error["type"]
    assert error["code"] == status
    assert SECRET not in response.text
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("abuse", list(abuses()))
async def test_bad_input_gets_a_clear_error_and_changes_nothing(
    fleet: RoutedFleet, abuse: Abuse
) -> None:
    before = Before(await index_picture(fleet.router), salts(fleet))
    async with fleet.http() as http:
        response = await http.request(
            abuse.method, abuse.path, content=abuse.content, headers=list(abuse.headers)
        )
    assert_clear_error(response, abuse.status, abuse.says)
    assert Before(await index_picture(fleet.router), salts(fleet)) == before
    assert not fleet.router.pool.drained
    await still_serves(fleet)


async def test_no_nesting_depth_gets_a_500(fleet: RoutedFleet) -> None:
    """msgspec refuses JSON only near Python's recursion limit; bodies a few levels under
    it were decoded, then broke whatever walked them later (a 500). Every depth from the
    router's limit to past msgspec's is now a clear 400."""
    before = await index_picture(fleet.router)
    async with fleet.http() as http:
        for depth in (MAX_NESTING + 1, *range(940, 1010)):
            nested = b"[" * depth + json.dumps(PROMPT).encode() + b"]" * depth
            for path, headers in ((COMPLETIONS, ACME), ("/fleet/locality", ADMIN)):
                response = await http.post(path, content=with_raw_prompt(nested), headers=headers)
                assert_clear_error(response, 400)
        within = b"[" * (MAX_NESTING - 2) + json.dumps(PROMPT).encode() + b"]" * (MAX_NESTING - 2)
        response = await http.post(
            "/fleet/locality", content=with_raw_prompt(within), headers=ADMIN
        )
        assert response.status_code == 200, response.text  # routed on its first prompt
    assert await index_picture(fleet.router) == before
    await still_serves(fleet)


async def test_a_body_streamed_past_the_limit_is_cut_off_with_413(fleet: RoutedFleet) -> None:
    """No Content-Length to refuse up front: the router stops reading at the limit."""
    chunk = b" " * 8192

    async def upload() -> AsyncIterator[bytes]:
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "' + SECRET.encode()
        for _ in range(2 * MAX_BODY_BYTES // len(chunk)):
            yield chunk
        yield b'"}'

    before = await index_picture(fleet.router)
    async with fleet.http() as http:
        response = await http.post(COMPLETIONS, content=upload(), headers=ACME)
    assert "content-length" not in response.request.headers
    assert_clear_error(response, 413)
    assert await index_picture(fleet.router) == before
    await still_serves(fleet)


async def test_header_values_that_are_not_ascii_do_not_get_in_the_way(
    fleet: RoutedFleet,
) -> None:
    async with fleet.http() as http:
        response = await http.post(
            COMPLETIONS,
            content=body(prompt=PROMPT, max_tokens=1),
            headers=[
                (b"authorization", ACME["authorization"].encode()),
                (b"x-client-note", "été 日本".encode()),
                (b"user-agent", b"\xff\xfe"),
            ],
        )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"]
    await wait_indexed(fleet, PROMPT, "acme", response.headers["x-kvplane-worker"])
    await still_serves(fleet)
