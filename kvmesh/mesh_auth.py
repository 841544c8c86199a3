"""Who a call comes from, inside one stack, and who may call what.

A mesh member is a role (gateway, router, worker, cache) and a name (a worker's name is the
address it advertises, the one the router dials and a lease names). A call proves its caller
in one of two ways:

- over mutual TLS, by the client certificate, whose common name is "role:name";
- without TLS, by three metadata entries: the role, the name and a token made from both with
  the stack's member key (mesh_keys.py), which only holders of the mesh secret can make.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from enum import StrEnum

import grpc

from kvmesh.errors import PermissionDenied, Unauthenticated
from kvmesh.mesh_keys import MeshKeys
from kvmesh.tls import TlsFiles

ROLE_METADATA = "kvmesh-member-role"
NAME_METADATA = "kvmesh-member-name"
TOKEN_METADATA = "kvmesh-member-token"


class MeshRole(StrEnum):
    """What a member of the stack is."""

    GATEWAY = "gateway"
    ROUTER = "router"
    WORKER = "worker"
    CACHE = "cache"
    OPERATOR = "operator"
    """`kvmesh up` and the CLI of the user who started the stack (it can read the secret)."""


@dataclass(slots=True, frozen=True)
class Caller:
    """The verified caller of one RPC."""

    role: str
    name: str


ROUTER_MEMBER_NAME = "router"
"""The mesh name of a router (a worker's is the address it advertises)."""
GATEWAY_MEMBER_NAME = "gateway"
OPERATOR_MEMBER_NAME = "operator"

ANONYMOUS = Caller("", "")
"""A caller that proved nothing."""


@dataclass(slots=True, frozen=True)
class MeshMember:
    """This process as a member of its stack: what it sends with every call it makes."""

    role: MeshRole
    name: str
    keys: MeshKeys
    tls: TlsFiles | None = None
    """Its certificate (the stack's CA with it): its calls go over mutual TLS."""

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata entries that prove this member to a callee without TLS."""
        return (
            (ROLE_METADATA, self.role.value),
            (NAME_METADATA, self.name),
            (TOKEN_METADATA, self.keys.member_token(self.role.value, self.name)),
        )


def certificate_name(role: MeshRole, name: str) -> str:
    """The common name of a member's certificate."""
    return f"{role.value}:{name}"


def caller_of(context: grpc.aio.ServicerContext, keys: MeshKeys) -> Caller:
    """The caller the call proves: by its TLS certificate, else by its member token;
    ANONYMOUS when it proves neither."""
    common_names = context.auth_context().get("x509_common_name")
    if common_names:
        role, _, name = common_names[0].decode(errors="replace").partition(":")
        return Caller(role, name)
    metadata = {key: value for key, value in context.invocation_metadata() or ()}
    role, name, token = (
        metadata.get(ROLE_METADATA),
        metadata.get(NAME_METADATA),
        metadata.get(TOKEN_METADATA),
    )
    if not (isinstance(role, str) and isinstance(name, str) and isinstance(token, str)):
        return ANONYMOUS
    if not hmac.compare_digest(keys.member_token(role, name), token):
        return ANONYMOUS
    return Caller(role, name)


ALL_METHODS = frozenset({"*"})

MESH_POLICY: dict[str, dict[str, frozenset[str]]] = {
    "kvmesh.v1.Router": {
        MeshRole.GATEWAY: frozenset({"Generate", "GenerateMany", "ListModels", "Status"}),
        MeshRole.OPERATOR: frozenset({"Status", "ListModels", "AddWorker", "RemoveWorker"}),
    },
    "kvmesh.v1.Cache": {MeshRole.GATEWAY: ALL_METHODS},
    "kvmesh.v1.Worker": {
        MeshRole.ROUTER: ALL_METHODS,
        MeshRole.WORKER: frozenset({"PullKv", "ReleaseKv"}),
    },
    **{
        reflection: dict.fromkeys(MeshRole, ALL_METHODS)
        for reflection in (
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        )
    },
}
"""Who may call what inside a stack: service -> role -> methods. The gateway calls the router
and the cache; the router calls the workers (their control RPCs too); workers pull KV from
workers; the operator's tools (`kvmesh up`, `kvmesh status`) manage the router's pools. Any
member may read the schema (reflection)."""

OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})
"""Served to anyone: health checks come from load balancers and compose, outside the stack."""


@dataclass(slots=True, frozen=True)
class MeshGuard:
    """The check every internal RPC passes before its servicer runs (in kvmesh's one server
    interceptor, grpc_server.py): the caller must be a member of the stack whose role
    MESH_POLICY lets call the method."""

    keys: MeshKeys

    def check(self, method: str, context: grpc.aio.ServicerContext) -> Caller:
        """The caller of `method` ("/package.Service/Method"); Unauthenticated when it proves
        no membership, PermissionDenied when its role may not call the method."""
        service, _, name = method.lstrip("/").partition("/")
        if service in OPEN_SERVICES:
            return caller_of(context, self.keys)
        caller = caller_of(context, self.keys)
        if caller == ANONYMOUS:
            raise Unauthenticated(
                f"{method} is internal to a kvmesh stack: only its members may call it "
                "(the stack's certificate or mesh secret)"
            )
        allowed = MESH_POLICY.get(service, {}).get(caller.role, frozenset())
        if allowed != ALL_METHODS and name not in allowed:
            raise PermissionDenied(
                f"{caller.role or 'a caller'} {caller.name!r} may not call {method}"
            )
        return caller


def mesh_guard(keys: MeshKeys, tls: TlsFiles | None) -> MeshGuard | None:
    """The guard of an internal service: None (an open mesh) when the stack has neither a
    secret nor TLS."""
    return MeshGuard(keys) if keys.secret_set or tls is not None else None
