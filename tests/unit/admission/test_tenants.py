"""Tenants file parsing, key hashing, `add_tenant`, and authentication / authorization."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvmesh.errors import PermissionDenied, Unauthenticated
from kvmesh.tenants import (
    PriorityClass,
    Tenant,
    TenantFileError,
    TenantRegistry,
    add_tenant,
    hash_key,
    load_tenants,
)
from services.admission.auth import (
    authenticate,
    authorize_model,
    authorize_priority,
    authorize_usage_read,
    bearer_key,
)


def write(path: Path, document: object) -> Path:
    path.write_text(yaml.safe_dump(document))
    return path


def test_add_tenant_writes_only_the_hash_and_the_key_authenticates(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    tenant, key = add_tenant(
        path, Tenant(name="acme", key_sha256="", tokens_per_minute=500, models=("tiny",))
    )
    _, other_key = add_tenant(path, Tenant(name="beta", key_sha256=""))
    text = path.read_text()
    assert key not in text and other_key not in text
    assert hash_key(key) in text
    registry = TenantRegistry.from_file(path)
    found = authenticate(registry, [("authorization", f"Bearer {key}")])
    assert found == tenant
    assert found.tokens_per_minute == 500 and found.models == ("tiny",)
    assert authenticate(registry, [("authorization", f"bearer {other_key}")]).name == "beta"


def test_add_tenant_refuses_a_duplicate_name(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    add_tenant(path, Tenant(name="acme", key_sha256=""))
    with pytest.raises(TenantFileError, match="exists"):
        add_tenant(path, Tenant(name="acme", key_sha256=""))


def test_missing_or_wrong_key_is_unauthenticated(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    add_tenant(path, Tenant(name="acme", key_sha256=""))
    registry = TenantRegistry.from_file(path)
    with pytest.raises(Unauthenticated, match="missing"):
        authenticate(registry, [])
    with pytest.raises(Unauthenticated, match="missing"):
        authenticate(registry, [("authorization", "Basic abc")])
    with pytest.raises(Unauthenticated, match="invalid"):
        authenticate(registry, [("authorization", "Bearer kvm_not-a-key")])


def test_without_a_file_every_caller_is_the_local_tenant() -> None:
    registry = TenantRegistry.open_local()
    tenant = authenticate(registry, [])
    assert tenant.name == "local" and tenant.admin and tenant.tokens_per_minute == 0


def test_bearer_key_parsing() -> None:
    assert bearer_key([("x-other", "1"), ("Authorization", b"Bearer  k1 ")]) == "k1"
    assert bearer_key([("authorization", "Bearer ")]) is None
    assert bearer_key([]) is None


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"name": "a b", "key_sha256": "0" * 64}, "name"),
        ({"name": "a", "key_sha256": "xyz"}, "key_sha256"),
        ({"name": "a", "key_sha256": "0" * 64, "tokens_per_minute": -1}, "tokens_per_minute"),
        ({"name": "a", "key_sha256": "0" * 64, "highest_priority": "urgent"}, "priority"),
        ({"name": "a", "key_sha256": "0" * 64, "shared_cache": "yes"}, "shared_cache"),
        ({"name": "a", "key_sha256": "0" * 64, "models": "tiny"}, "models"),
        ({"name": "a", "key_sha256": "0" * 64, "colour": "red"}, "unknown fields colour"),
        ({"key_sha256": "0" * 64}, "name"),
    ],
)
def test_malformed_entries_are_named(
    tmp_path: Path, entry: dict[str, object], message: str
) -> None:
    path = write(tmp_path / "t.yaml", {"tenants": [entry]})
    with pytest.raises(TenantFileError, match=message) as raised:
        load_tenants(path)
    assert "tenants[0]" in str(raised.value)


def test_duplicates_and_shape_errors(tmp_path: Path) -> None:
    same = {"name": "a", "key_sha256": "0" * 64}
    with pytest.raises(TenantFileError, match="duplicate name"):
        load_tenants(
            write(tmp_path / "d.yaml", {"tenants": [same, {**same, "key_sha256": "1" * 64}]})
        )
    with pytest.raises(TenantFileError, match="top-level"):
        load_tenants(write(tmp_path / "s.yaml", ["not", "a", "mapping"]))
    with pytest.raises(TenantFileError):
        load_tenants(tmp_path / "absent.yaml")


def test_authorization_rules() -> None:
    batch_only = Tenant(
        name="b", key_sha256="", models=("tiny",), highest_priority=PriorityClass.BATCH
    )
    authorize_model(batch_only, "tiny")
    with pytest.raises(PermissionDenied, match="model 'big'"):
        authorize_model(batch_only, "big")
    authorize_priority(batch_only, PriorityClass.BATCH)
    with pytest.raises(PermissionDenied, match="interactive"):
        authorize_priority(batch_only, PriorityClass.INTERACTIVE)
    authorize_usage_read(batch_only, "b")
    with pytest.raises(PermissionDenied):
        authorize_usage_read(batch_only, "other")
    authorize_usage_read(Tenant(name="root", key_sha256="", admin=True), "other")


def test_salt_defaults_to_the_name() -> None:
    assert Tenant(name="acme", key_sha256="").salt == b"acme"
    assert Tenant(name="acme", key_sha256="", cache_salt="team").salt == b"team"
