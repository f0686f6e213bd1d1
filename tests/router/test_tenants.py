"""Tenants: API keys to tenants by digest, and each cache scope's derived salt."""

from __future__ import annotations

import hashlib
import string
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from kvplane.core.config import TenantSettings, TenantSpec
from router.tenants import (
    ANONYMOUS,
    ANONYMOUS_TENANT,
    SHARED_SCOPE,
    TenantDirectory,
    api_key_digest,
    derive_cache_salt,
    read_tenants_file,
)

SECRET = b"test-secret"


def spec(name: str, *keys: str, **fields: object) -> TenantSpec:
    return TenantSpec(name=name, api_key_sha256=[api_key_digest(k) for k in keys], **fields)  # type: ignore[arg-type]


def directory(*specs: TenantSpec, allow_anonymous: bool = False) -> TenantDirectory:
    return TenantDirectory(specs, secret=SECRET, allow_anonymous=allow_anonymous)


# -- digests and salts ---------------------------------------------------------------


def test_a_key_digest_is_its_sha256_in_hex() -> None:
    assert api_key_digest("sk-acme") == hashlib.sha256(b"sk-acme").hexdigest()
    assert len(api_key_digest("sk-acme")) == 64


def test_the_shared_scope_has_no_salt() -> None:
    assert derive_cache_salt(SECRET, SHARED_SCOPE) is None


def test_a_salt_is_32_hex_characters_and_stable() -> None:
    salt = derive_cache_salt(SECRET, "acme")
    assert salt is not None
    assert len(salt) == 32
    assert set(salt) <= set(string.hexdigits.lower())
    assert derive_cache_salt(SECRET, "acme") == salt


def test_salts_differ_per_scope_and_per_secret() -> None:
    salt = derive_cache_salt(SECRET, "acme")
    assert derive_cache_salt(SECRET, "globex") != salt
    assert derive_cache_salt(b"another-secret", "acme") != salt
    assert salt is not None
    assert "acme" not in salt


# -- the directory -----------------------------------------------------------------------


def test_a_bearer_key_authenticates_its_tenant() -> None:
    tenants = directory(spec("acme", "sk-acme", "sk-acme-2"), spec("globex", "sk-globex"))
    acme = tenants.authenticate("Bearer sk-acme")
    assert acme is not None
    assert acme.name == "acme"
    assert acme.cache_scope == "tenant:acme"
    assert acme.cache_salt == derive_cache_salt(SECRET, "tenant:acme")
    assert tenants.authenticate("bearer  sk-acme-2 ") == acme
    globex = tenants.authenticate("Bearer sk-globex")
    assert globex is not None
    assert globex.name == "globex"
    assert tenants.get("acme") == acme


def test_a_wrong_or_missing_key_is_refused_without_anonymous_access() -> None:
    tenants = directory(spec("acme", "sk-acme"))
    assert tenants.authenticate("Bearer sk-wrong") is None
    assert tenants.authenticate(None) is None
    assert tenants.authenticate("Bearer ") is None
    assert tenants.authenticate("Basic sk-acme") is None
    assert tenants.authenticate("sk-acme") is None
    assert tenants.get(ANONYMOUS) is None


def test_with_anonymous_access_a_wrong_or_missing_key_is_anonymous() -> None:
    tenants = directory(spec("acme", "sk-acme"), allow_anonymous=True)
    assert tenants.authenticate("Bearer sk-wrong") == ANONYMOUS_TENANT
    assert tenants.authenticate(None) == ANONYMOUS_TENANT
    acme = tenants.authenticate("Bearer sk-acme")
    assert acme is not None
    assert acme.name == "acme"
    assert ANONYMOUS_TENANT.cache_salt is None
    assert tenants.get(ANONYMOUS) == ANONYMOUS_TENANT
    assert {t.name for t in tenants.all()} == {"acme", ANONYMOUS}


def test_tenants_naming_one_scope_share_its_salt() -> None:
    tenants = directory(
        spec("acme", "sk-acme", cache_scope="partners"),
        spec("globex", "sk-globex", cache_scope="partners"),
        spec("initech", "sk-initech"),
    )
    acme, globex, initech = (tenants.get(name) for name in ("acme", "globex", "initech"))
    assert acme is not None
    assert globex is not None
    assert initech is not None
    assert acme.cache_salt == globex.cache_salt == derive_cache_salt(SECRET, "partners")
    assert acme.cache_salt is not None
    assert initech.cache_salt != acme.cache_salt


def test_a_tenant_in_the_shared_scope_is_unsalted() -> None:
    tenants = directory(spec("acme", "sk-acme", cache_scope=SHARED_SCOPE))
    acme = tenants.get("acme")
    assert acme is not None
    assert acme.cache_salt is None


def test_isolation_settings_reach_the_tenant() -> None:
    tenants = directory(
        spec("acme", isolation="private", required_labels={"zone": "a"}),
        spec("gold", isolation="dedicated", pool="gold-pool"),
    )
    acme, gold = tenants.get("acme"), tenants.get("gold")
    assert acme is not None
    assert gold is not None
    assert acme.isolation == "private"
    assert dict(acme.required_labels) == {"zone": "a"}
    assert (gold.isolation, gold.pool) == ("dedicated", "gold-pool")


def test_a_name_used_twice_or_reserved_is_refused() -> None:
    with pytest.raises(ValueError, match=r"acme|distinct|twice"):
        directory(spec("acme", "sk-1"), spec("acme", "sk-2"))
    with pytest.raises(ValueError, match=ANONYMOUS):
        directory(spec(ANONYMOUS, "sk-1"))


def test_a_key_of_two_tenants_is_refused() -> None:
    with pytest.raises(ValueError, match="key"):
        directory(spec("acme", "sk-same"), spec("globex", "sk-same"))


def test_a_dedicated_tenant_needs_a_pool() -> None:
    with pytest.raises(ValidationError, match="needs a pool"):
        TenantSpec(name="gold", isolation="dedicated")


def test_a_key_digest_must_be_64_hex_digits() -> None:
    with pytest.raises(ValidationError, match="64 hex digits"):
        TenantSpec(name="acme", api_key_sha256=["sk-acme"])


# -- from settings and files -------------------------------------------------------------


def test_anonymous_access_by_default_only_without_tenants() -> None:
    assert TenantDirectory.from_settings(TenantSettings()).allow_anonymous
    with_tenants = TenantSettings(tenants=[spec("acme", "sk-acme")])
    assert not TenantDirectory.from_settings(with_tenants).allow_anonymous
    opened = TenantSettings(tenants=[spec("acme", "sk-acme")], allow_anonymous=True)
    assert TenantDirectory.from_settings(opened).allow_anonymous
    closed = TenantSettings(allow_anonymous=False)
    assert TenantDirectory.from_settings(closed).authenticate(None) is None


def test_the_configured_secret_derives_the_salts() -> None:
    settings = TenantSettings(
        tenants=[spec("acme", "sk-acme")], cache_salt_secret=SecretStr("s3cret")
    )
    acme = TenantDirectory.from_settings(settings).get("acme")
    assert acme is not None
    assert acme.cache_salt == derive_cache_salt(b"s3cret", "tenant:acme")


def test_without_a_secret_salts_are_random_per_directory() -> None:
    settings = TenantSettings(tenants=[spec("acme", "sk-acme")])
    first = TenantDirectory.from_settings(settings).get("acme")
    second = TenantDirectory.from_settings(settings).get("acme")
    assert first is not None
    assert second is not None
    assert first.cache_salt != second.cache_salt


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_tenants_file_is_read_like_the_configuration(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        f"""
[[tenants]]
name = "acme"
api_key_sha256 = ["{api_key_digest("sk-acme")}"]
isolation = "private"

[[tenants]]
name = "gold"
isolation = "dedicated"
pool = "gold-pool"
""",
    )
    specs = read_tenants_file(path)
    assert [s.name for s in specs] == ["acme", "gold"]
    assert specs[0].isolation == "private"
    assert specs[1].pool == "gold-pool"


def test_a_tenants_file_adds_to_the_configured_tenants(tmp_path: Path) -> None:
    path = write(
        tmp_path, f'[[tenants]]\nname = "globex"\napi_key_sha256 = ["{api_key_digest("sk-g")}"]\n'
    )
    settings = TenantSettings(tenants=[spec("acme", "sk-acme")], tenants_file=path)
    tenants = TenantDirectory.from_settings(settings)
    globex = tenants.authenticate("Bearer sk-g")
    assert globex is not None
    assert globex.name == "globex"
    assert not tenants.allow_anonymous


def test_an_empty_tenants_file_has_no_tenants(tmp_path: Path) -> None:
    assert read_tenants_file(write(tmp_path, "")) == []


def test_an_unknown_top_level_key_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, 'tenant = "acme"\n')
    with pytest.raises(ValueError, match="unknown top-level keys"):
        read_tenants_file(path)


def test_an_invalid_tenant_in_a_file_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, '[[tenants]]\nname = "gold"\nisolation = "dedicated"\n')
    with pytest.raises(ValidationError, match="needs a pool"):
        read_tenants_file(path)


def test_no_configuration_joins_another_tenants_own_scope() -> None:
    tenants = directory(
        spec("partners", "sk-partners"),
        spec("globex", "sk-globex", cache_scope="partners"),
        spec("shared", "sk-shared"),
    )
    partners, globex, shared = (tenants.get(name) for name in ("partners", "globex", "shared"))
    assert partners is not None
    assert globex is not None
    assert shared is not None
    assert partners.cache_salt != globex.cache_salt  # "partners" the scope is not its own
    assert shared.cache_salt is not None  # a tenant named "shared" is not the shared scope


def test_a_scopes_generation_never_goes_back() -> None:
    tenants = directory(spec("acme", "sk-acme"))
    original = tenants.get("acme")
    assert original is not None
    tenants.apply_generations({"tenant:acme": 2})
    purged = tenants.get("acme")
    assert purged is not None
    assert purged.cache_salt == derive_cache_salt(SECRET, "tenant:acme", 2)
    tenants.apply_generations({"tenant:acme": 1})  # a read taken before the purge
    after = tenants.get("acme")
    assert after is not None
    assert after.cache_salt == purged.cache_salt
    assert after.cache_salt != original.cache_salt
