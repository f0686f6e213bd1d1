"""Tenants: who a request's API key belongs to, and which cache scope it may use.

A scope is a set of tenants allowed to share cached blocks. Every scope but the
unsalted `shared` one has a cache salt derived from a server secret and the scope's
name: the router passes it to the engine as `cache_salt` (so the engine keeps the
scope's blocks apart) and keys the request's blocks under it (so the index does too).
Keys are stored as SHA-256 digests only; the keys themselves never reach the router's
configuration, logs or memory beyond the request that carries one.

Purging a scope starts its next generation (kept in the index, so every router agrees):
the salt changes, so neither the index's entries nor the engines' blocks of the old
generation are ever matched again; they leave as the engines evict them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import secrets
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import TypeAdapter

from kvplane.core.config import (
    ConfigError,
    IsolationClass,
    RequestLimits,
    TenantSettings,
    TenantSpec,
)

log = logging.getLogger(__name__)

SHARED_SCOPE = "shared"
"""The scope of requests the router does not salt: blocks any such request may hit."""

ANONYMOUS = "anonymous"
POOL_LABEL = "kvplane.io/pool"
"""The worker label naming the pool a `dedicated` tenant's requests are confined to."""

_SALT_CONTEXT = b"kvplane-cache-scope\x00"
_SALT_HEX_CHARS = 32  # 128 bits: unguessable, and well inside vLLM's limits


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    cache_scope: str
    cache_salt: str | None  # None for the shared scope
    isolation: IsolationClass = "shared"
    required_labels: Mapping[str, str] = field(default_factory=dict)
    pool: str | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Flow control (router/flow_control): its band, the highest band its requests' header
    # may ask (None: the header is ignored), its share of a band.
    priority: int = 0
    max_priority: int | None = None
    share: float = 1.0


ANONYMOUS_TENANT = Tenant(name=ANONYMOUS, cache_scope=SHARED_SCOPE, cache_salt=None)


def own_scope(tenant: str) -> str:
    """A tenant's scope when it names none. Named scopes cannot contain ":", so no
    configuration can name (and so join) another tenant's own scope."""
    return f"tenant:{tenant}"


def api_key_digest(api_key: str) -> str:
    """What the configuration stores for a key: `printf %s KEY | sha256sum`."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def derive_cache_salt(secret: bytes, scope: str, generation: int = 0) -> str | None:
    """The engine cache salt of `scope` in `generation` (None for the shared scope): an
    HMAC of the scope's name, so only a router holding the secret can name another
    scope's salt."""
    if scope == SHARED_SCOPE:
        return None
    message = _SALT_CONTEXT + scope.encode("utf-8")
    if generation:
        message += b"\x00" + str(generation).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()[:_SALT_HEX_CHARS]


class TenantDirectory:
    """API key → tenant, and tenant name → tenant."""

    def __init__(
        self,
        specs: Iterable[TenantSpec],
        *,
        secret: bytes,
        allow_anonymous: bool,
        anonymous_limits: RequestLimits | None = None,
    ) -> None:
        self.allow_anonymous = allow_anonymous
        self._anonymous = dataclasses.replace(
            ANONYMOUS_TENANT, limits=anonymous_limits or RequestLimits()
        )
        self._specs = list(specs)
        self._secret = secret
        self._generations: dict[str, int] = {}
        names = [spec.name for spec in self._specs]
        if len(set(names)) != len(names) or ANONYMOUS in names:
            raise ConfigError("tenant names must be distinct, and not 'anonymous'")
        digests = [digest for spec in self._specs for digest in spec.api_key_sha256]
        if len(set(digests)) != len(digests):
            raise ConfigError("an API key is configured twice (for one tenant or two)")
        self._by_name: dict[str, Tenant] = {}
        self._by_digest: dict[str, Tenant] = {}
        self._build()

    def _build(self) -> None:
        by_name, by_digest = {}, {}
        for spec in self._specs:
            scope = spec.cache_scope or own_scope(spec.name)
            tenant = Tenant(
                name=spec.name,
                cache_scope=scope,
                cache_salt=derive_cache_salt(self._secret, scope, self._generations.get(scope, 0)),
                isolation=spec.isolation,
                required_labels=dict(spec.required_labels),
                pool=spec.pool,
                limits=spec.limits,
                priority=spec.priority,
                max_priority=spec.max_priority,
                share=spec.share,
            )
            by_name[spec.name] = tenant
            by_digest.update(dict.fromkeys(spec.api_key_sha256, tenant))
        if self.allow_anonymous:
            by_name[ANONYMOUS] = self._anonymous
        self._by_name, self._by_digest = by_name, by_digest

    def apply_generations(self, generations: Mapping[str, int]) -> None:
        """Take the scopes' generations from the index (salts follow them). A scope's
        generation never goes back: a read older than a purge must not bring the old
        salt (and the engines' old blocks) back."""
        raised = {
            scope: generation
            for scope, generation in generations.items()
            if generation > self._generations.get(scope, 0)
        }
        if raised:
            self._generations.update(raised)
            self._build()

    @classmethod
    def from_settings(cls, settings: TenantSettings) -> TenantDirectory:
        specs = list(settings.tenants)
        if settings.tenants_file is not None:
            specs += read_tenants_file(settings.tenants_file)
        if settings.cache_salt_secret is not None:
            secret = settings.cache_salt_secret.get_secret_value().encode("utf-8")
        else:
            secret = secrets.token_bytes(32)
            if specs:
                log.warning(
                    "no tenants.cache_salt_secret: tenants' cache salts are random to this "
                    "process, so router replicas and restarts will not share their hits"
                )
        allow_anonymous = (
            not specs if settings.allow_anonymous is None else settings.allow_anonymous
        )
        return cls(
            specs,
            secret=secret,
            allow_anonymous=allow_anonymous,
            anonymous_limits=settings.anonymous_limits,
        )

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of an `Authorization: Bearer KEY` header; anonymous for an
        unknown or missing key when anonymous access is on; else None."""
        tenant = None
        if authorization is not None:
            scheme, _, key = authorization.partition(" ")
            if scheme.lower() == "bearer" and key.strip():
                tenant = self._by_digest.get(api_key_digest(key.strip()))
        if tenant is None and self.allow_anonymous:
            return self._anonymous
        return tenant

    def get(self, name: str) -> Tenant | None:
        return self._by_name.get(name)

    def all(self) -> list[Tenant]:
        return list(self._by_name.values())


_TENANT_LIST = TypeAdapter(list[TenantSpec])


def read_tenants_file(path: Path) -> list[TenantSpec]:
    """`[[tenants]]` tables of a TOML file, checked like the main configuration."""
    try:
        with path.open("rb") as file:
            document = tomllib.load(file)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: {error}") from None
    unknown = set(document) - {"tenants"}
    if unknown:
        raise ConfigError(f"{path}: unknown top-level keys {sorted(unknown)}")
    return _TENANT_LIST.validate_python(document.get("tenants", []))
