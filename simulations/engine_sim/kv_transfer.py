"""Prefill/decode disaggregation as vLLM's NixlConnector does it (pull mode).

- Prefill leg: a request whose `kv_transfer_params` say `do_remote_decode` runs as any
  other. When it finishes, the engine lends its blocks: they stay pinned (not evictable)
  until the decode engine pulls them or the lease runs out, and the answer's
  `kv_transfer_params` name them, this engine (its id, its address) and the request,
  and (vLLM 0.34) the leg's own prompt-cache hits, which the decode reports as its
  usage's cached tokens.
- Decode leg: a request whose `kv_transfer_params` say `do_remote_prefill` first pulls
  the prompt blocks this engine does not hold from the prefill engine, as vLLM's
  scheduler loads a connector's KV: when the request's turn comes, the scheduler gives
  it blocks for its local hits and for the blocks to receive (or it waits, as any
  request waits, until they free); the engine pulls into them and waits out the
  modelled transfer (bytes / bandwidth), the request holding them all the while; when
  the scheduler next reaches it, they enter the prefix cache (their `BlockStored`), and
  it computes only the rest.

The transfer is modelled, not performed: the decode engine asks the prefill engine over
HTTP (`POST /sim/kv/pull`) to hand the blocks over, which releases them there, and
fills its own blocks. vLLM instead reads the blocks with NIXL, after a handshake on its
side-channel port (`VLLM_NIXL_SIDE_CHANNEL_PORT`, not the HTTP port), and answers with
that host and port; the simulator answers with its HTTP address.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from yarl import URL

from simulations.engine_sim.block_pool import BlockPool, KVBlock

log = logging.getLogger(__name__)

PULL_PATH = "/sim/kv/pull"
_PULL_TIMEOUT_S = 10.0


class KVLoadFailed(Exception):
    """The decode engine could not get the blocks it wanted; the message says why."""


class PullRefused(Exception):
    """The prefill engine refuses a pull, with the HTTP status to answer."""

    def __init__(self, message: str, status: int, error_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type


class PullRequest(BaseModel):
    """The body of `POST /sim/kv/pull`."""

    model_config = ConfigDict(extra="forbid")

    remote_request_id: str
    remote_engine_id: str
    num_blocks: int = Field(ge=0)  # 0: nothing wanted, release the blocks


class _RemotePrefillParams(BaseModel):
    """The fields of a decode leg's `kv_transfer_params` that the pull needs; vLLM's
    NixlConnector needs the same ones (and blocks to read) before it pulls."""

    model_config = ConfigDict(extra="ignore")

    do_remote_prefill: Literal[True]
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int = Field(ge=1, le=65535)
    remote_block_ids: list[Any] = Field(min_length=1)


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where a decode leg's prompt blocks wait: the prefill engine and its request."""

    engine_id: str
    request_id: str
    host: str
    port: int


def asks_remote_decode(params: dict[str, Any] | None) -> bool:
    """Whether a request is the prefill leg of a P/D pair."""
    return params is not None and params.get("do_remote_decode") is True


def remote_prefill(params: dict[str, Any] | None) -> RemotePrefill | None:
    """The blocks a decode leg should pull, from its `kv_transfer_params`; None when it
    asks for no pull, or lacks a field (then, as vLLM does, it computes its prompt)."""
    if params is None or params.get("do_remote_prefill") is not True:
        return None
    try:
        fields = _RemotePrefillParams.model_validate(params)
    except ValidationError:
        log.warning("kv_transfer_params without the remote fields: the prompt is computed")
        return None
    return RemotePrefill(
        fields.remote_engine_id, fields.remote_request_id, fields.remote_host, fields.remote_port
    )


def remote_prefill_cached_tokens(params: dict[str, Any] | None) -> int | None:
    """The prefill engine's own cache hits, where a decode leg's `kv_transfer_params`
    carry them (`remote_prefill_cached_tokens`): vLLM 0.34 reports them as the decode's
    `usage.prompt_tokens_details.cached_tokens` (v1/engine/output_processor.py), with or
    without a connector. None where they are not given."""
    if not params or not params.get("do_remote_prefill"):
        return None
    cached = params.get("remote_prefill_cached_tokens")
    return cached if isinstance(cached, int) else None


def prefill_answer_params(
    block_ids: list[int],
    engine_id: str,
    request_id: str,
    num_computed_tokens: int,
    host: str,
    port: int,
    cached_tokens: int | None,
) -> dict[str, Any]:
    """The `kv_transfer_params` of a finished prefill leg's answer: the fields vLLM's
    NixlConnector returns from `request_finished` (pull scheduler), for one attention
    group (`remote_block_ids` holds one list of block ids per group) and no parallelism,
    then `remote_prefill_cached_tokens`, the leg's own prompt-cache hits, which vLLM
    0.34's scheduler adds when the leg finishes with its first output (it has its
    prefill statistics then; a leg that generated more tokens has none: None here)."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [block_ids],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "remote_num_tokens": num_computed_tokens,
    }
    if cached_tokens is not None:
        params["remote_prefill_cached_tokens"] = cached_tokens
    return params


@dataclass(slots=True)
class _Loan:
    blocks: list[KVBlock]
    expiry: asyncio.TimerHandle


class BlockLender:
    """The prefill side: finished requests' blocks, pinned until pulled or expired.

    A lent block holds one reference, so nothing evicts it; when the decode engine pulls
    it, or the lease runs out, the reference goes as vLLM frees a finished request's
    blocks (cached ones stay in the prefix cache). Faults set at run time change what
    it does: `withhold` lends nothing (the answer then carries no parameters),
    `refuse_pulls` fails every pull, `lease_override_s` replaces the configured lease.
    """

    def __init__(
        self,
        pool: BlockPool,
        lease_s: float,
        expired: Callable[[], None],
        released: Callable[[], None],
    ) -> None:
        self._pool = pool
        self._lease_s = lease_s
        self._expired = expired
        self._released = released  # blocks went back to the pool: waiting requests may fit
        self._loans: dict[str, _Loan] = {}
        self.engine_id = _new_engine_id()
        self.withhold = False
        self.refuse_pulls = False
        self.lease_override_s: float | None = None

    def lend(self, request_id: str, blocks: list[KVBlock]) -> None:
        self._pool.touch(blocks)
        lease_s = self._lease_s if self.lease_override_s is None else self.lease_override_s
        expiry = asyncio.get_running_loop().call_later(lease_s, self._expire, request_id)
        self._loans[request_id] = _Loan(blocks, expiry)

    def hand_over(self, request_id: str, engine_id: str, num_blocks: int) -> None:
        """A decode engine reads `num_blocks` of the request's lent blocks (those it
        lacks), and all of them are released. PullRefused, changing nothing, where the
        loan is not there or cannot give that many."""
        if self.refuse_pulls:
            raise PullRefused("KV transfers are refused (fault)", 503, "ServiceUnavailableError")
        if engine_id != self.engine_id:
            raise PullRefused(f"this is engine {self.engine_id}, not {engine_id}", 409, "Conflict")
        loan = self._loans.get(request_id)
        if loan is None:
            raise PullRefused(
                f"no blocks are lent for request {request_id} (unknown, already pulled, or "
                "its lease expired)",
                404,
                "NotFoundError",
            )
        if num_blocks > len(loan.blocks):
            raise PullRefused(
                f"{num_blocks} blocks wanted, request {request_id} lent {len(loan.blocks)}",
                409,
                "Conflict",
            )
        self._release(request_id)

    def restart(self) -> None:
        """A crash and restart: every loan is gone with the cache, under a new id."""
        for loan in self._loans.values():
            loan.expiry.cancel()
        self._loans.clear()
        self.engine_id = _new_engine_id()

    def _expire(self, request_id: str) -> None:
        self._release(request_id)
        self._expired()
        log.warning("the lease on request %s's blocks expired before a pull", request_id)

    def _release(self, request_id: str) -> None:
        loan = self._loans.pop(request_id)
        loan.expiry.cancel()
        self._pool.free(reversed(loan.blocks))  # tail first, as a finished request
        self._released()


class PullClient:
    """The decode side's one HTTP client to every prefill engine."""

    def __init__(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_PULL_TIMEOUT_S))

    async def close(self) -> None:
        await self._session.close()

    async def pull(self, source: RemotePrefill, num_blocks: int) -> None:
        """Read `num_blocks` of the request's blocks from the prefill engine, which then
        releases them all (0: only release them); KVLoadFailed if it cannot be reached
        or refuses."""
        url = URL.build(scheme="http", host=source.host, port=source.port, path=PULL_PATH)
        body = PullRequest(
            remote_request_id=source.request_id,
            remote_engine_id=source.engine_id,
            num_blocks=num_blocks,
        )
        try:
            async with self._session.post(url, json=body.model_dump()) as response:
                status, text = response.status, await response.text()
        except (aiohttp.ClientError, TimeoutError) as error:
            raise KVLoadFailed(
                f"the prefill engine at {source.host}:{source.port} did not answer "
                f"({type(error).__name__})"
            ) from None
        if status != 200:
            raise KVLoadFailed(f"the prefill engine refused the pull: {_message(text, status)}")


def _new_engine_id() -> str:
    # Like vLLM's default engine_id: a fresh UUID for each process incarnation.
    return str(uuid.uuid4())


def _message(text: str, status: int) -> str:
    """An error answer's message (vLLM's error shape), else its status."""
    try:
        return str(msgspec.json.decode(text)["error"]["message"])
    except (msgspec.DecodeError, KeyError, TypeError):
        return f"HTTP {status}"
