"""Who may speak on a Connect stream, and which batch comes next: pure decisions over
what kvplane/wire/codec.py has decoded, testable without a server."""

from __future__ import annotations

import enum
import hmac
import ipaddress
from collections.abc import Iterable, Mapping, Sequence

from kvplane.core.worker_credentials import is_worker_token
from kvplane.wire.codec import Rejection
from kvplane.wire.v1 import control_plane_pb2 as pb

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class SequenceVerdict(enum.Enum):
    DUPLICATE = "duplicate"  # applied already: ignore it and Ack again
    NEXT = "next"  # the one expected: apply it
    GAP = "gap"  # batches were lost in between: the worker must resync


def presented_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes:
    """The call's `authorization: Bearer <token>`; b"" without one."""
    presented = b""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            raw = value.encode() if isinstance(value, str) else value
            scheme, _, token = raw.partition(b" ")
            if scheme.lower() == b"bearer":
                presented = token.strip()
    return presented


def authenticate(presented: bytes, expected_token: str | None) -> Rejection | None:
    """None when the call may proceed: no token is configured, or the call presented
    the configured token."""
    if expected_token is None:
        return None
    # compare_digest on bytes: its time does not depend on where the tokens differ.
    if presented and hmac.compare_digest(presented, expected_token.encode()):
        return None
    return Rejection(
        pb.REJECT_CODE_UNAUTHENTICATED, "missing or wrong bearer token (authorization metadata)"
    )


def authenticate_worker(presented: bytes, secret: str | None, worker_id: str) -> Rejection | None:
    """None when the stream may speak for `worker_id`: no worker credentials are
    configured, or it presented that worker's own token."""
    if secret is None or is_worker_token(secret, worker_id, presented):
        return None
    return Rejection(
        pb.REJECT_CODE_UNAUTHENTICATED,
        f"the bearer token is not worker {worker_id}'s own (issue it with kvplane worker-token)",
    )


def certificate_names(auth_context: Mapping[str, Iterable[bytes]]) -> frozenset[str] | None:
    """The names in the client certificate a call presented over mutual TLS (its common
    name and subject alternative names); None when it presented none."""
    if not auth_context.get("x509_pem_cert"):
        return None
    names = [
        *auth_context.get("x509_common_name", ()),
        *auth_context.get("x509_subject_alternative_name", ()),
    ]
    return frozenset(name.decode("utf-8", "replace") for name in names)


def certificate_speaks_for(names: frozenset[str] | None, worker_id: str) -> Rejection | None:
    """None when the stream may speak for `worker_id`: it presented no client
    certificate, or one naming the worker (common name or subject alternative name)."""
    if names is None or worker_id in names:
        return None
    return Rejection(
        pb.REJECT_CODE_UNAUTHENTICATED,
        f"the client certificate does not name worker {worker_id} (its common name or a "
        "subject alternative name must be the worker id)",
    )


def peer_address(peer: str | None) -> IPAddress | None:
    """The address a gRPC peer string names ("ipv4:10.0.0.5:4321", "ipv6:[::1]:4321");
    None for any other kind (a Unix socket)."""
    if not peer:
        return None
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        host = rest.rpartition(":")[0]
    elif kind == "ipv6":
        host = rest.rpartition(":")[0].strip("[]")
    else:
        return None
    try:
        return ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None


def engine_host_allowed(host: str, agent: IPAddress | None, allowed: Sequence[str]) -> bool:
    """Whether a worker's engine may be at `host`: the address its agent connects from
    (`localhost` for a loopback agent), or a host or network in `allowed`. No name is
    resolved: a name is allowed only if listed."""
    try:
        address: IPAddress | None = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        address = None
    if address is None:
        if host == "localhost" and agent is not None and agent.is_loopback:
            return True
        return host in allowed
    if address == agent:
        return True
    for entry in allowed:
        try:
            if address in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue  # a host name: compared above
    return False


def incarnation_too_far_ahead(incarnation: int, now_s: float, max_ahead_s: float) -> bool:
    """Whether an incarnation (the agent's wall clock in ns when it began) is further
    ahead of `now_s` than any honest clock would be."""
    return incarnation > int((now_s + max_ahead_s) * 1e9)


def classify_sequence(sequence: int, last_applied: int) -> SequenceVerdict:
    if sequence <= last_applied:
        return SequenceVerdict.DUPLICATE
    if sequence == last_applied + 1:
        return SequenceVerdict.NEXT
    return SequenceVerdict.GAP
