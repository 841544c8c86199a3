"""Who a call comes from, inside one stack.

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

from kvmesh.mesh_keys import MeshKeys

ROLE_METADATA = "kvmesh-member-role"
NAME_METADATA = "kvmesh-member-name"
TOKEN_METADATA = "kvmesh-member-token"


class MeshRole(StrEnum):
    """What a member of the stack is."""

    GATEWAY = "gateway"
    ROUTER = "router"
    WORKER = "worker"
    CACHE = "cache"


@dataclass(slots=True, frozen=True)
class Caller:
    """The verified caller of one RPC."""

    role: str
    name: str


ROUTER_MEMBER_NAME = "router"
"""The mesh name of a router (the gateway's is "gateway", a worker's its advertised address)."""

ANONYMOUS = Caller("", "")
"""A caller that proved nothing."""


@dataclass(slots=True, frozen=True)
class MeshMember:
    """This process as a member of its stack: what it sends with every call it makes."""

    role: MeshRole
    name: str
    keys: MeshKeys

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
