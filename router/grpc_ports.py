"""Binding the router's gRPC servers (the agents' control plane, the endpoint picker) to
their ports, with TLS read again when its files change."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import grpc
import grpc.aio

log = logging.getLogger(__name__)


def bind_grpc(
    server: grpc.aio.Server,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None,
    *,
    serves: str,
) -> int:
    """Bind `server` to host:port (0: a free port); returns the port. `serves` names it
    in the error when the port cannot be had."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError:  # gRPC says only that binding failed
        raise OSError(
            f"cannot listen on {address} for {serves}: in use, or not an address of this machine"
        ) from None


def server_credentials(
    cert: Path | None, key: Path | None, client_ca: Path | None = None
) -> grpc.ServerCredentials | None:
    """TLS from these files (None without a certificate); with `client_ca`, clients
    must present a certificate it signed (mTLS)."""
    if cert is None or key is None:
        return None
    files = CertificateFiles(cert, key, client_ca)
    return grpc.dynamic_ssl_server_credentials(
        files.configuration(),
        files.changed_configuration,  # type: ignore[arg-type]  # None is allowed: gRPC's docs
        require_client_authentication=client_ca is not None,
    )


class CertificateFiles:
    """The router's certificate, key and client CA, read again when a file changes:
    cert-manager renews certificates in place, and a router that kept the first would
    serve an expired one. gRPC asks before each new connection's handshake."""

    def __init__(self, cert: Path, key: Path, client_ca: Path | None) -> None:
        self._paths = [path for path in (cert, key, client_ca) if path is not None]
        self._cert, self._key, self._client_ca = cert, key, client_ca
        self._stamps = self._stat()

    def _stat(self) -> list[tuple[int, int]]:
        return [(stat.st_mtime_ns, stat.st_size) for stat in map(os.stat, self._paths)]

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(self._key.read_bytes(), self._cert.read_bytes())],
            root_certificates=None if self._client_ca is None else self._client_ca.read_bytes(),
        )

    def changed_configuration(self) -> grpc.ServerCertificateConfiguration | None:
        """A new configuration when a file changed since the last read; else None (keep
        the current one), also when the files cannot be read right now (mid-rotation)."""
        try:
            stamps = self._stat()
            if stamps == self._stamps:
                return None
            configuration = self.configuration()
        except OSError as error:
            log.warning("the TLS files %s cannot be read (%s)", self._cert, error.strerror)
            return None
        self._stamps = stamps
        log.info("the TLS certificate files of %s changed: reloaded", self._cert)
        return configuration
