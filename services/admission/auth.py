"""Who is calling: the tenant named by the `authorization: Bearer <key>` metadata."""

from __future__ import annotations

from collections.abc import Iterable

from kvmesh.errors import PermissionDenied, Unauthenticated
from kvmesh.tenants import PriorityClass, Tenant, TenantRegistry

AUTHORIZATION = "authorization"
_SCHEME = "bearer "


def bearer_key(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The API key of the first `authorization: Bearer <key>` entry, or None."""
    for name, value in metadata:
        if name.lower() != AUTHORIZATION:
            continue
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        if text[: len(_SCHEME)].lower() == _SCHEME:
            return text[len(_SCHEME) :].strip() or None
        return None
    return None


def authenticate(registry: TenantRegistry, metadata: Iterable[tuple[str, str | bytes]]) -> Tenant:
    """The calling tenant; raises Unauthenticated for a missing or unknown key."""
    if registry.local is not None:
        return registry.local
    key = bearer_key(metadata)
    if key is None:
        raise Unauthenticated("missing credentials: send 'authorization: Bearer <api key>'")
    tenant = registry.by_key(key)
    if tenant is None:
        raise Unauthenticated("invalid API key")
    return tenant


def authorize_model(tenant: Tenant, model: str) -> None:
    """Raises PermissionDenied when the tenant may not use `model`."""
    if not tenant.may_use_model(model):
        allowed = ", ".join(tenant.models) or "none"
        raise PermissionDenied(
            f"tenant {tenant.name!r} may not use model {model!r} (allowed: {allowed})"
        )


def authorize_priority(tenant: Tenant, priority: PriorityClass) -> None:
    """Raises PermissionDenied when `priority` is above the tenant's highest allowed class."""
    if not tenant.may_use_priority(priority):
        raise PermissionDenied(
            f"tenant {tenant.name!r} may not send {priority.name.lower()} requests "
            f"(highest allowed: {tenant.highest_priority.name.lower()})"
        )


def authorize_usage_read(tenant: Tenant, target: str) -> None:
    """Only admins read other tenants' usage."""
    if target != tenant.name and not tenant.admin:
        raise PermissionDenied(f"tenant {tenant.name!r} may only read its own usage")
