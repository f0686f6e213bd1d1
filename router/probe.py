"""The wiring probe: one small request sent straight to a worker's engine, proving the
whole loop that cache-aware routing rests on, or naming the link that breaks.

The probe's prompt is random words (cached nowhere), tokenised by the router as any
request would be. The engine's answer says how many prompt tokens it counted (the
router must count the same, or none of its keys can match), and the engine's KV events
for the blocks it just cached must then reach the index under the router's own keys
for that worker, within `wait_s`: engine -> events -> agent -> control plane -> index,
with the router's tokenizer, model name and block size all agreeing on the way.

A completion with a text prompt is what it sends: chat templates are not exercised
here (the token counts of ordinary traffic check them, router/routing/token_agreement.py).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence

import msgspec

from kvplane.core.clock import Clock
from kvplane.core.types import WorkerInfo
from router.index.base import LocationIndex, LocationIndexError, index_deadline
from router.lifecycle.bodies import Endpoint, ParsedRequest, response_usage
from router.lifecycle.tokens import PromptTokens
from router.proxy.upstream import (
    AttemptFailed,
    NoFreeConnection,
    Upstream,
    UpstreamAnswer,
    UpstreamBroken,
)
from router.routing.decide import RoutingPlanner, servable_blocks
from router.routing.token_agreement import TokenCountAgreement
from router.routing.wiring import Check, CheckStatus

PROBE_BLOCKS = 4
"""Whole blocks the probe's prompt spans: enough to be cached and announced, small
enough to cost an engine nothing."""
ANSWER_TIMEOUT_S = 30.0
"""The most the engine's whole answer to the probe may take (however long the proxy's
own first-byte timeout): a busy engine fails the probe rather than hang the check."""
MAX_ANSWER_BYTES = 1 << 20
"""One output token's answer is a few hundred bytes: an engine that sends more than
this is not read further."""
_POLL_S = 0.05
_INDEX_TIMEOUT_S = 2.0
_UNCACHED_SCOPE = ""  # the shared scope, unsalted: the probe's words are its own


class WiringProbe:
    def __init__(
        self,
        *,
        upstream: Upstream,
        prompt_tokens: PromptTokens,
        planner: RoutingPlanner,
        index: LocationIndex,
        agreement: TokenCountAgreement,
        first_byte_timeout_s: float,
        clock: Clock = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.upstream = upstream
        self.prompt_tokens = prompt_tokens
        self.planner = planner
        self.index = index
        self.agreement = agreement
        self.first_byte_timeout_s = first_byte_timeout_s
        self._clock = clock
        self._sleep = sleep

    async def probe(self, info: WorkerInfo, wait_s: float) -> list[Check]:
        """The probe's checks: `probe_tokenizer` and `probe_index`; or `probe_send`
        alone, failed, when the engine gave no answer to compare (that proves nothing
        about the router's sight of its cache, so it does not make the worker blind)."""
        prompt = await self._prompt(info.model)
        if prompt is None:
            return [
                Check(
                    "probe_tokenizer",
                    CheckStatus.FAIL,
                    f"the router cannot tokenise a text prompt for model {info.model!r}",
                    "give the router the model's tokenizer (proxy.tokenizer_dirs)",
                )
            ]
        text, tokens = prompt
        body = msgspec.json.encode(
            {"model": info.model, "prompt": text, "max_tokens": 1, "temperature": 0}
        )
        answered = await self._send(info, body)
        if isinstance(answered, Check):
            return [answered]
        tokenizer = self._token_check(info, len(tokens), answered)
        return [tokenizer, await self._index_check(info, tokens, wait_s, tokenizer)]

    async def _prompt(self, model: str) -> tuple[str, Sequence[int]] | None:
        """Random words, as many as it takes to span PROBE_BLOCKS blocks and a token."""
        block_size = self.planner.block_size
        words = PROBE_BLOCKS * block_size // 4  # each word is a token or more
        for _ in range(6):
            # Random from its first token: a fixed opening would make every probe's first
            # block the same, and an agent reading another engine that was probed before
            # would hold it (and pass this worker's probe on it).
            text = " ".join(secrets.token_hex(3) for _ in range(words)) + " (kvplane wiring probe)"
            body = {"model": model, "prompt": text}
            request = ParsedRequest(Endpoint.COMPLETIONS, model, False, body)
            tokens = await self.prompt_tokens.of(request, _UNCACHED_SCOPE)
            if tokens is None:
                return None
            if len(tokens) > PROBE_BLOCKS * block_size:
                return text, tokens
            words *= 2
        return None

    async def _send(self, info: WorkerInfo, body: bytes) -> bytes | Check:
        """The engine's whole answer, or the failed check that says why there is none."""
        url = info.base_url.rstrip("/") + Endpoint.COMPLETIONS.value
        headers = {"content-type": "application/json"}
        first_byte_timeout_s = min(self.first_byte_timeout_s, ANSWER_TIMEOUT_S)
        try:
            async with asyncio.timeout(ANSWER_TIMEOUT_S):
                answer = await self.upstream.send(url, body, headers, first_byte_timeout_s)
                try:
                    whole = await _bounded(answer)
                finally:
                    await answer.close()
        except AttemptFailed as failure:
            return _unsent(
                f"the engine at {info.base_url} did not answer the probe ({failure.reason})",
                "check the engine, and the base URL its agent advertises (--advertise-url)",
            )
        except NoFreeConnection:
            return Check(
                "probe_send",
                CheckStatus.UNKNOWN,
                "the router has no free connection to the engines now",
                "run the check again when the router is less busy",
            )
        except UpstreamBroken as error:
            return _unsent(
                f"the engine broke its answer to the probe ({error})", "check the engine"
            )
        except TimeoutError:
            return _unsent(
                f"the engine did not answer the probe within {ANSWER_TIMEOUT_S:g} s",
                "check the engine's load; run the check again",
            )
        if answer.status >= 400:
            return _unsent(
                f"the engine answered the probe with status {answer.status}",
                f"check that the engine serves model {info.model!r} as its agent registered it",
            )
        if whole is None:
            return _unsent(
                f"the engine's answer to the probe ran past {MAX_ANSWER_BYTES} bytes",
                "check that the worker's base URL is an engine's OpenAI API",
            )
        return whole

    def _token_check(self, info: WorkerInfo, router_tokens: int, answer: bytes) -> Check:
        usage = response_usage(answer)
        engine_tokens = None if usage is None else usage.prompt_tokens
        if engine_tokens is None:
            return Check(
                "probe_tokenizer",
                CheckStatus.UNKNOWN,
                "the engine's answer has no usage.prompt_tokens to compare",
            )
        if self.agreement.observe((info.worker_id, info.incarnation), router_tokens, engine_tokens):
            return Check(
                "probe_tokenizer",
                CheckStatus.PASS,
                f"the engine counted the probe's {engine_tokens} prompt tokens as the router did",
            )
        return Check(
            "probe_tokenizer",
            CheckStatus.FAIL,
            f"the engine counted {engine_tokens} prompt tokens in the probe, the router "
            f"{router_tokens}: the router does not tokenise as this engine does",
            "give the router the engine's tokenizer (proxy.tokenizer_dirs or proxy.tokenizer_dir)",
        )

    async def _index_check(
        self, info: WorkerInfo, tokens: Sequence[int], wait_s: float, tokenizer: Check
    ) -> Check:
        """Wait for the probe's blocks to show under the worker in the index."""
        keys = self.planner.keys(info.model, _UNCACHED_SCOPE, tokens)
        keys = keys[: servable_blocks(len(tokens), self.planner.block_size)]
        started = self._clock()
        while True:
            try:
                async with index_deadline(_INDEX_TIMEOUT_S):
                    match = (await self.index.lookup(keys)).get(info.worker_id)
            except LocationIndexError as error:
                return Check(
                    "probe_index",
                    CheckStatus.UNKNOWN,
                    f"the index did not answer ({type(error).__name__})",
                    "see /readyz",
                )
            waited = self._clock() - started
            if match is not None and match.blocks:
                return Check(
                    "probe_index",
                    CheckStatus.PASS,
                    f"{match.blocks} of the probe's {len(keys)} blocks were in the index under "
                    f"this worker {waited * 1000:.0f} ms after the engine answered",
                )
            if waited >= wait_s:
                break
            await self._sleep(_POLL_S)
        if tokenizer.status is CheckStatus.FAIL:
            fix = "fix the tokenizer first: the router's keys cannot match the engine's"
        else:
            fix = (
                "fix the events check first; if it passes, the agent reads another engine "
                "than the one at this worker's base URL, or keys blocks under another model "
                "name"
            )
        return Check(
            "probe_index",
            CheckStatus.FAIL,
            f"none of the probe's {len(keys)} blocks reached the index under this worker "
            f"within {wait_s:g} s",
            fix,
        )


async def _bounded(answer: UpstreamAnswer) -> bytes | None:
    """The whole answer, or None past MAX_ANSWER_BYTES."""
    chunks, size = [answer.first_chunk], len(answer.first_chunk)
    async for chunk in answer.rest():
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _unsent(detail: str, fix: str) -> Check:
    return Check("probe_send", CheckStatus.FAIL, detail, fix)
