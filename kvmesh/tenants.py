"""Tenants: who may call the gateway, with which key, limits and models.

The tenants file is YAML:

    tenants:
      - name: acme
        key_sha256: 3f1c...        # hex SHA-256 of the API key; the key itself is never stored
        tokens_per_minute: 20000   # 0 or absent: unlimited
        daily_tokens: 2000000      # 0 or absent: unlimited
        max_concurrent: 16         # 0 or absent: unlimited
        models: ["*"]              # tiers the tenant may use; "*" for all, "auto" for routing
        highest_priority: interactive   # or batch: the tenant may only send batch work
        shared_cache: false        # share response-cache entries with other opted-in tenants
        cache_salt: acme           # prefix-cache isolation salt (default: the name)
        admin: false               # may read other tenants' usage

Both token budgets count the prompt and generated tokens of every request a model ran; a
response-cache hit runs no model and counts 0 against them (it is priced, at a thousandth of
a generated token per token delivered, in the usage's cost).
"""

from __future__ import annotations

import enum
import hashlib
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

ALL_MODELS = "*"
"""Entry of `models` that allows every tier."""

LOCAL_TENANT_NAME = "local"
"""The tenant every caller becomes when the gateway runs without a tenants file."""

KEY_PREFIX = "kvm_"
"""Start of every generated API key, so a leaked key is easy to recognise."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class TenantFileError(ValueError):
    """The tenants file is missing, unreadable or malformed; the message names the entry."""


class PriorityClass(enum.IntEnum):
    """Scheduling classes in order of precedence (lower value goes first)."""

    INTERACTIVE = 0
    BATCH = 1

    @classmethod
    def parse(cls, text: str) -> PriorityClass:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            names = ", ".join(p.name.lower() for p in cls)
            raise ValueError(f"unknown priority {text!r} (expected one of {names})") from None


@dataclass(slots=True, frozen=True)
class Tenant:
    """One tenant and its limits (0 means unlimited)."""

    name: str
    key_sha256: str
    tokens_per_minute: int = 0
    daily_tokens: int = 0
    max_concurrent: int = 0
    models: tuple[str, ...] = (ALL_MODELS,)
    highest_priority: PriorityClass = PriorityClass.INTERACTIVE
    shared_cache: bool = False
    cache_salt: str = ""
    admin: bool = False

    def may_use_model(self, model: str) -> bool:
        return ALL_MODELS in self.models or model in self.models

    def may_use_priority(self, priority: PriorityClass) -> bool:
        return priority >= self.highest_priority

    @property
    def salt(self) -> bytes:
        """The prefix-cache salt: tenants share KV blocks only when they share a salt."""
        return (self.cache_salt or self.name).encode()


def hash_key(api_key: str) -> str:
    """Hex SHA-256 of an API key, as stored in the tenants file."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def new_api_key() -> str:
    """A fresh random API key (256 bits of entropy)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def local_tenant() -> Tenant:
    """The single unlimited tenant of a gateway started without a tenants file."""
    return Tenant(name=LOCAL_TENANT_NAME, key_sha256="", admin=True)


class TenantRegistry:
    """Tenants by key hash; `local` set means every caller is the local tenant."""

    def __init__(self, tenants: Iterable[Tenant], local: Tenant | None = None) -> None:
        self._by_hash = {t.key_sha256: t for t in tenants}
        self._by_name = {t.name: t for t in self._by_hash.values()}
        self.local = local
        if local is not None:
            self._by_name[local.name] = local

    @classmethod
    def open_local(cls) -> TenantRegistry:
        return cls((), local=local_tenant())

    @classmethod
    def from_file(cls, path: Path) -> TenantRegistry:
        return cls(load_tenants(path))

    def by_key(self, api_key: str) -> Tenant | None:
        """The tenant owning `api_key`, or None."""
        return self._by_hash.get(hash_key(api_key))

    def by_name(self, name: str) -> Tenant | None:
        return self._by_name.get(name)

    def __len__(self) -> int:
        return len(self._by_name)


def load_tenants(path: Path) -> list[Tenant]:
    """Parses the tenants file; raises TenantFileError naming the bad entry."""
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as error:
        raise TenantFileError(f"{path}: {error}") from error
    entries = document.get("tenants") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise TenantFileError(f"{path}: expected a top-level 'tenants:' list")
    tenants = [_parse_entry(entry, f"{path}: tenants[{i}]") for i, entry in enumerate(entries)]
    _check_unique(tenants, path)
    return tenants


def _check_unique(tenants: list[Tenant], path: Path) -> None:
    names = [t.name for t in tenants]
    hashes = [t.key_sha256 for t in tenants]
    for label, values in (("name", names), ("key_sha256", hashes)):
        duplicates = sorted({v for v in values if values.count(v) > 1})
        if duplicates:
            raise TenantFileError(f"{path}: duplicate {label}: {', '.join(duplicates)}")


def _parse_entry(entry: Any, where: str) -> Tenant:
    if not isinstance(entry, dict):
        raise TenantFileError(f"{where}: expected a mapping")
    known = set(Tenant.__dataclass_fields__)
    unknown = sorted(set(entry) - known)
    if unknown:
        raise TenantFileError(f"{where}: unknown fields {', '.join(map(str, unknown))}")
    try:
        return _tenant_from_mapping(entry)
    except (KeyError, TypeError, ValueError) as error:
        raise TenantFileError(f"{where}: {error}") from error


def _tenant_from_mapping(entry: Mapping[str, Any]) -> Tenant:
    name = str(entry["name"])
    if not _NAME.match(name):
        raise ValueError(f"name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
    key_hash = str(entry["key_sha256"]).lower()
    if not re.fullmatch(r"[0-9a-f]{64}", key_hash):
        raise ValueError("key_sha256 must be 64 hex digits")
    models = entry.get("models", [ALL_MODELS])
    if isinstance(models, str) or not all(isinstance(m, str) for m in models):
        raise ValueError("models must be a list of tier names")
    return Tenant(
        name=name,
        key_sha256=key_hash,
        tokens_per_minute=_limit(entry, "tokens_per_minute"),
        daily_tokens=_limit(entry, "daily_tokens"),
        max_concurrent=_limit(entry, "max_concurrent"),
        models=tuple(models),
        highest_priority=PriorityClass.parse(str(entry.get("highest_priority", "interactive"))),
        shared_cache=_flag(entry, "shared_cache"),
        cache_salt=str(entry.get("cache_salt", "")),
        admin=_flag(entry, "admin"),
    )


def _limit(entry: Mapping[str, Any], name: str) -> int:
    value = entry.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer")
    return value


def _flag(entry: Mapping[str, Any], name: str) -> bool:
    value = entry.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false")
    return value


def tenant_to_mapping(tenant: Tenant) -> dict[str, Any]:
    """The YAML form of a tenant (inverse of parsing)."""
    fields = asdict(tenant)
    fields["models"] = list(tenant.models)
    fields["highest_priority"] = tenant.highest_priority.name.lower()
    return fields


def add_tenant(path: Path, tenant_without_key: Tenant) -> tuple[Tenant, str]:
    """Adds a tenant with a fresh key to the file (created if absent); returns it and the key.

    The key is returned once, to be shown to the operator; only its hash is written.
    """
    existing = load_tenants(path) if path.exists() else []
    if any(t.name == tenant_without_key.name for t in existing):
        raise TenantFileError(f"{path}: a tenant named {tenant_without_key.name!r} exists")
    api_key = new_api_key()
    entry = _tenant_from_mapping(
        {**tenant_to_mapping(tenant_without_key), "key_sha256": hash_key(api_key)}
    )
    document = {"tenants": [tenant_to_mapping(t) for t in [*existing, entry]]}
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    temporary.replace(path)  # atomic: a gateway reading the file never sees half of it
    return entry, api_key
