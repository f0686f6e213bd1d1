"""Agent authentication: bearer token and mutual TLS, over real gRPC."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvplane.core.config import AgentSettings, ControlPlaneSettings
from kvplane.core.keys import KeyNamespace, block_keys
from kvplane.core.serving import cancel_task
from kvplane.core.types import Tier
from kvplane.core.worker_credentials import worker_token
from kvplane.wire.codec import events_message, register_message
from kvplane.wire.stream import AgentStream
from kvplane.wire.v1 import control_plane_pb2 as pb
from router.app import running_router
from tests.router.conftest import (
    BLOCK_SIZE,
    MODEL,
    body,
    make_settings,
    prompt_keys,
    router_with_channel,
    stored,
    worker,
)
from worker_agent.events import EngineBlocksStored
from worker_agent.publisher import ControlPlanePublisher, PublisherRejected, WorkerIdentity
from worker_agent.translate import BlockTranslator

TOKEN = "t0ken-for-tests"


@pytest.mark.parametrize("token", [None, "wrong"], ids=["missing", "wrong"])
async def test_call_without_the_right_token_is_rejected(token: str | None) -> None:
    async with router_with_channel(make_settings(agent_token=TOKEN)) as (router, channel):
        stream = AgentStream(channel, token=token)

        reply = await stream.request(register_message(worker()))

        assert body(reply) == "reject"
        assert reply.reject.code == pb.REJECT_CODE_UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await stream.reply()
        assert ended.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert await router.index.workers() == []
        assert router.workers.get("w1") is None


async def test_call_with_the_token_is_served() -> None:
    async with router_with_channel(make_settings(agent_token=TOKEN)) as (router, channel):
        stream = AgentStream(channel, token=TOKEN)
        assert (await stream.request(register_message(worker()))).ack.sequence == 0
        assert (await stream.request(events_message(1, [stored(prompt_keys(1))]))).ack.sequence == 1
        assert set(await router.index.lookup(prompt_keys(1))) == {"w1"}


SECRET = "the-routers-worker-credential-secret-0123456789"


async def test_with_worker_credentials_a_token_registers_its_own_worker_only() -> None:
    settings = make_settings(agent_token=TOKEN, worker_credential_secret=SECRET)
    async with router_with_channel(settings) as (router, channel):
        mine = AgentStream(channel, token=worker_token(SECRET, "w1"))
        assert (await mine.request(register_message(worker("w1")))).ack.sequence == 0
        assert (await mine.request(events_message(1, [stored(prompt_keys(1))]))).ack.sequence == 1
        # w1's token cannot register w2; the token every agent used to share is no longer
        # enough for anyone.
        for token, worker_id in [(worker_token(SECRET, "w1"), "w2"), (TOKEN, "w2")]:
            stream = AgentStream(channel, token=token)
            reply = await stream.request(register_message(worker(worker_id)))
            assert body(reply) == "reject"
            assert reply.reject.code == pb.REJECT_CODE_UNAUTHENTICATED
        # Nor can it take w1 over with a higher incarnation and another address.
        thief = AgentStream(channel, token=TOKEN)
        hijack = worker("w1", incarnation=2, base_url="http://203.0.113.9:8000")
        assert body(await thief.request(register_message(hijack))) == "reject"
        assert [s.info for s in await router.index.workers()] == [worker("w1")]
        assert set(await router.index.lookup(prompt_keys(1))) == {"w1"}


async def test_a_worker_may_name_only_an_engine_where_its_agent_is() -> None:
    async with router_with_channel(make_settings()) as (router, channel):
        elsewhere = worker("w1", base_url="http://203.0.113.9:8000")  # not this agent's host
        reply = await AgentStream(channel).request(register_message(elsewhere))
        assert body(reply) == "reject"
        assert reply.reject.code == pb.REJECT_CODE_INCOMPATIBLE
        assert "allowed_engine_hosts" in reply.reject.reason
        assert await router.index.workers() == []
    listed = make_settings(allowed_engine_hosts=["203.0.113.0/24"])
    async with router_with_channel(listed) as (router, channel):
        assert (await AgentStream(channel).request(register_message(elsewhere))).ack.sequence == 0


@dataclass(frozen=True)
class Pki:
    ca: bytes
    server_cert: Path
    server_key: Path
    ca_file: Path
    client_cert: bytes
    client_key: bytes
    stranger_cert: bytes  # signed by another CA
    stranger_key: bytes


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _certificate(
    name: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    dns_names: tuple[str, ...] = ("localhost",),
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, issuer_key = issuer or (subject, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [
                    *(x509.DNSName(name) for name in dns_names),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca_key, other_ca_key = _key(), _key()
    ca = _certificate("kvplane test CA", ca_key, None, ca=True)
    other_ca = _certificate("another CA", other_ca_key, None, ca=True)
    server_key, client_key, stranger_key = _key(), _key(), _key()
    server = _certificate("router", server_key, (ca.subject, ca_key))
    # The agent's certificate names the workers it speaks for: w1, and tls-agent.
    client = _certificate("w1", client_key, (ca.subject, ca_key), dns_names=("tls-agent",))
    stranger = _certificate("stranger", stranger_key, (other_ca.subject, other_ca_key))
    files = {
        "ca.pem": _pem(ca),
        "server.pem": _pem(server),
        "server-key.pem": _pem_key(server_key),
    }
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return Pki(
        ca=_pem(ca),
        server_cert=directory / "server.pem",
        server_key=directory / "server-key.pem",
        ca_file=directory / "ca.pem",
        client_cert=_pem(client),
        client_key=_pem_key(client_key),
        stranger_cert=_pem(stranger),
        stranger_key=_pem_key(stranger_key),
    )


async def _register_over_tls(
    port: int, credentials: grpc.ChannelCredentials, worker_id: str = "w1"
) -> pb.ControlMessage:
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        return await AgentStream(channel).request(register_message(worker(worker_id)))


async def test_mutual_tls(pki: Pki) -> None:
    settings = make_settings(
        tls_cert_file=pki.server_cert,
        tls_key_file=pki.server_key,
        tls_client_ca_file=pki.ca_file,
    )
    async with running_router(settings) as router:
        trusted = grpc.ssl_channel_credentials(pki.ca, pki.client_key, pki.client_cert)
        reply = await _register_over_tls(router.grpc_port, trusted)
        assert reply.ack.sequence == 0
        # The certificate speaks for the workers it names only.
        refused = await _register_over_tls(router.grpc_port, trusted, "w2")
        assert refused.reject.code == pb.REJECT_CODE_UNAUTHENTICATED
        assert "does not name worker w2" in refused.reject.reason

        for credentials in (
            grpc.ssl_channel_credentials(pki.ca),  # no client certificate
            grpc.ssl_channel_credentials(pki.ca, pki.stranger_key, pki.stranger_cert),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _register_over_tls(router.grpc_port, credentials)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}") as plaintext:
            with pytest.raises(grpc.aio.AioRpcError):
                await AgentStream(plaintext).request(register_message(worker("w2")))
        assert [w.info.worker_id for w in await router.index.workers()] == ["w1"]


async def test_server_tls_without_client_certificates(pki: Pki) -> None:
    settings = make_settings(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key)
    async with running_router(settings) as router:
        reply = await _register_over_tls(router.grpc_port, grpc.ssl_channel_credentials(pki.ca))
        assert reply.ack.sequence == 0


def _publisher(
    port: int, pki: Pki, directory: Path, token: str | None
) -> tuple[ControlPlanePublisher, BlockTranslator]:
    (directory / "agent.pem").write_bytes(pki.client_cert)
    (directory / "agent-key.pem").write_bytes(pki.client_key)
    agent = AgentSettings(
        control_plane_address=f"127.0.0.1:{port}",
        tls_ca_file=pki.ca_file,
        tls_cert_file=directory / "agent.pem",
        tls_key_file=directory / "agent-key.pem",
    )
    translator = BlockTranslator(MODEL, BLOCK_SIZE, max_tracked_blocks=1000)
    publisher = ControlPlanePublisher(
        WorkerIdentity("tls-agent", "http://127.0.0.1:1", MODEL, BLOCK_SIZE, 0, "vllm", "", {}),
        agent,
        ControlPlaneSettings(block_size=BLOCK_SIZE, agent_token=token),  # type: ignore[arg-type]
        snapshot=translator.snapshot,
    )
    return publisher, translator


async def test_the_agent_publishes_over_mutual_tls_with_its_token(pki: Pki, tmp_path: Path) -> None:
    settings = make_settings(
        tls_cert_file=pki.server_cert,
        tls_key_file=pki.server_key,
        tls_client_ca_file=pki.ca_file,
        agent_token=TOKEN,
    )
    tokens = list(range(2 * BLOCK_SIZE))
    async with running_router(settings) as router:
        publisher, translator = _publisher(router.grpc_port, pki, tmp_path, TOKEN)
        task = asyncio.create_task(publisher.run())
        try:
            await publisher.wait_connected()
            engine_event = EngineBlocksStored(
                (1, 2), None, tuple(tokens), BLOCK_SIZE, Tier.DEVICE, None, None
            )
            publisher.submit(translator.translate([engine_event]))
            await publisher.wait_flushed()
            keys = block_keys(tokens, KeyNamespace(MODEL, BLOCK_SIZE))
            assert (await router.index.lookup(keys))["tls-agent"].blocks == 2
        finally:
            await cancel_task(task)

        wrong, _ = _publisher(router.grpc_port, pki, tmp_path, "wrong")
        with pytest.raises(PublisherRejected, match="UNAUTHENTICATED"):
            await asyncio.wait_for(wrong.run(), timeout=10)


async def test_a_forged_incarnation_far_ahead_cannot_fence_the_real_agent_out() -> None:
    now = 1_754_000_000.0
    async with router_with_channel(make_settings(), wall_clock=lambda: now) as (router, channel):
        forged = worker("w1", incarnation=2**64 - 1)
        reply = await AgentStream(channel).request(register_message(forged))
        assert body(reply) == "reject"
        assert reply.reject.code == pb.REJECT_CODE_INCOMPATIBLE
        assert await router.index.workers() == []
        # An honest agent's clock, a little ahead of the router's, is welcome.
        honest = worker("w1", incarnation=int((now + 5) * 1e9))
        assert (await AgentStream(channel).request(register_message(honest))).ack.sequence == 0


async def test_a_renewed_certificate_is_served_without_a_restart(pki: Pki, tmp_path: Path) -> None:
    """cert-manager renews the router's certificate in place; new connections get the new
    one (here signed by another CA, so that the two are told apart by who trusts them)."""
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(pki.server_cert.read_bytes())
    key.write_bytes(pki.server_key.read_bytes())
    settings = make_settings(tls_cert_file=cert, tls_key_file=key)
    renewed_ca_key, renewed_key = _key(), _key()
    renewed_ca = _certificate("renewed CA", renewed_ca_key, None, ca=True)
    renewed = _certificate("router", renewed_key, (renewed_ca.subject, renewed_ca_key))
    async with running_router(settings) as router:
        first = await _register_over_tls(router.grpc_port, grpc.ssl_channel_credentials(pki.ca))
        assert first.ack.sequence == 0
        key.write_bytes(_pem_key(renewed_key))
        cert.write_bytes(_pem(renewed))
        trusting_new = grpc.ssl_channel_credentials(_pem(renewed_ca))
        again = await _register_over_tls(router.grpc_port, trusting_new, "w2")
        assert again.ack.sequence == 0
        with pytest.raises(grpc.aio.AioRpcError):  # the old CA no longer vouches for it
            await _register_over_tls(router.grpc_port, grpc.ssl_channel_credentials(pki.ca), "w3")
