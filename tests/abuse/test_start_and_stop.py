"""Starting with a bad setting fails at once with one clear line; SIGTERM drains: readiness
fails first, new requests are still served through the drain delay, and a stream in
progress finishes before the router exits."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from kvplane.cli import main
from tests.one_worker_stack import one_worker_stack
from tests.waiting import wait_until

DRAIN_DELAY_S = 1.5
ADMIN_TOKEN = "drain-admin"


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.create_server(("127.0.0.1", 0)) as held:
        yield held.getsockname()[1]


@pytest.mark.parametrize("flag", ["--http-port", "--admin-port", "--grpc-port"])
def test_a_port_in_use_is_one_line_naming_it(
    flag: str, busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    ports = {"--http-port": "0", "--grpc-port": "0", flag: str(busy_port)}
    arguments = [part for pair in ports.items() for part in pair]
    with pytest.raises(SystemExit) as exited:
        main(["router", *arguments])
    assert exited.value.code == 1
    error = capsys.readouterr().err
    assert f"kvplane: cannot listen on 127.0.0.1:{busy_port}" in error
    assert "Traceback" not in error


def test_a_missing_tls_key_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVPLANE_CONTROL_PLANE__TLS_CERT_FILE", "/nonexistent/cert.pem")
    monkeypatch.setenv("KVPLANE_CONTROL_PLANE__TLS_KEY_FILE", "/nonexistent/key.pem")
    with pytest.raises(SystemExit) as exited:
        main(["router", "--http-port", "0", "--grpc-port", "0"])
    assert exited.value.code == 1
    error = capsys.readouterr().err
    assert "/nonexistent/" in error
    assert "Traceback" not in error


@pytest.mark.slow
async def test_sigterm_fails_readiness_serves_through_the_delay_and_finishes_streams() -> None:
    with one_worker_stack(
        "draining",
        router_env={
            "KVPLANE_HTTP__DRAIN_DELAY_S": str(DRAIN_DELAY_S),
            "KVPLANE_HTTP__DRAIN_TIMEOUT_S": "20",
            "KVPLANE_HTTP__ADMIN_TOKEN": ADMIN_TOKEN,
        },
        # Real time, 40 ms a decode step: a 60-token stream lasts over two seconds.
        engine_args=["--time-scale", "1", "--decode-step-ms", "40"],
    ) as fleet:
        async with httpx.AsyncClient(base_url=fleet.router_url, timeout=30) as client:
            body = {"model": "kvplane-tiny", "messages": [{"role": "user", "content": "hello"}]}

            async def routable() -> bool:
                answer = await client.post("/v1/chat/completions", json={**body, "max_tokens": 1})
                return answer.status_code == 200

            await wait_until("the worker takes requests", routable, 20)
            streamed: list[str] = []
            first_chunk = asyncio.Event()

            async def stream() -> int:
                request = {**body, "max_tokens": 60, "stream": True, "ignore_eos": True}
                async with client.stream("POST", "/v1/chat/completions", json=request) as answer:
                    async for line in answer.aiter_lines():
                        if line.startswith("data: "):
                            streamed.append(line)
                            first_chunk.set()
                    return answer.status_code

            streaming = asyncio.create_task(stream())
            await asyncio.wait_for(first_chunk.wait(), 10)
            signalled = time.monotonic()
            fleet.router.send_signal(signal.SIGTERM)

            async def not_ready() -> bool:
                return (await client.get("/readyz")).status_code == 503

            await wait_until("readiness fails", not_ready, 1.0)
            readiness = (await client.get("/readyz")).json()
            assert readiness["draining"] is True
            assert readiness["ready"] is False
            # Still inside the delay: a new request is served, not refused.
            late = await client.post("/v1/chat/completions", json={**body, "max_tokens": 1})
            assert late.status_code == 200
            assert time.monotonic() - signalled < DRAIN_DELAY_S

            assert await asyncio.wait_for(streaming, 20) == 200
            assert streamed[-1] == "data: [DONE]"
            assert len(streamed) > 60  # every token's chunk, then [DONE]
            assert await asyncio.to_thread(fleet.router.wait, 10) == 0
            # The ports closed only after the delay, and the stream outlived them.
            assert time.monotonic() - signalled >= DRAIN_DELAY_S
            with pytest.raises(httpx.ConnectError):
                await client.get("/healthz")
