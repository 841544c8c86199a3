"""Typed service configuration, read once at start: CLI flags > environment > defaults.

Each service declares one dataclass deriving from `ServerConfig`, with a docstring under
every field. `load_config` turns the fields into `--flag-name` options (help text taken from
those docstrings) and `<ENV_PREFIX><FIELD_NAME>` environment variables, and returns a frozen
instance. A field whose type is itself a dataclass (the worker's engine settings) is nested:
each of its fields is a flag and a variable of the same form, under the service's prefix.
Nothing is read at import time.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

Config = TypeVar("Config", bound="ServerConfig")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


@dataclasses.dataclass(slots=True, frozen=True)
class ServerConfig:
    """Settings every gRPC service shares. Subclasses add their own fields."""

    env_prefix: ClassVar[str] = "KVMESH_"

    host: str = "127.0.0.1"
    """Address the gRPC server binds (0.0.0.0 to listen on every interface)."""
    port: int = 0
    """gRPC port; 0 picks a free one (printed in the ready line)."""
    metrics_port: int = 0
    """Prometheus metrics HTTP port; 0 picks a free one, -1 disables the endpoint."""
    metrics_host: str = ""
    """Address the metrics endpoint binds; empty: the gRPC host. 127.0.0.1 keeps /metrics
    (per-tenant names, tokens and cost) to this machine while gRPC listens on every interface."""
    grace_s: float = 5.0
    """Seconds in-flight RPCs get to finish after SIGTERM before they are cancelled."""
    log_level: str = "INFO"
    """Python logging level."""
    mesh_secret_file: Path | None = None
    """File holding the stack's shared secret (`kvmesh up` and compose generate one, readable
    by its owner only): it signs KV leases and KV bytes, and the router, cache and workers then
    take calls only from members of the stack. None: no secret, an open mesh (anyone who
    reaches a port can call it, and sign)."""
    tls_cert_file: Path | None = None
    """This service's TLS certificate (PEM; `kvmesh up --tls` makes one per service): it serves
    over TLS and shows it on the calls it makes. Its common name "role:name" names it in the
    mesh. None: plaintext."""
    tls_key_file: Path | None = None
    """The private key of tls_cert_file (PEM)."""
    tls_ca_file: Path | None = None
    """The stack's CA certificate (PEM): verifies the services this one calls and, on the
    router, cache and workers, the certificate every caller must show (mutual TLS)."""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field, through the class hierarchy."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(inspect.getsource(klass).strip())
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
        for node, following in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def env_var(cls: type[ServerConfig], name: str) -> str:
    """The environment variable that sets field `name` of config class `cls`."""
    return f"{cls.env_prefix}{name.upper()}"


def _base_type(annotation: Any) -> Any:
    """`int | None` -> int; `Path` -> Path; `tuple[str, ...]` -> tuple."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    return origin or annotation


def _parse_value(kind: Any, raw: str, name: str) -> Any:
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise ValueError(f"{name}: expected a boolean, got {raw!r}")
    if kind is tuple:
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if kind is Path:
        return Path(raw).expanduser()
    try:
        return kind(raw)
    except ValueError as exc:
        raise ValueError(f"{name}: expected {kind.__name__}, got {raw!r}") from exc


def _program() -> str | None:
    """`python -m services.router` for usage lines, when run with -m (else argparse's own)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is None:
        return None
    return f"python -m {spec.name.removesuffix('.__main__')}"


def _default(f: dataclasses.Field[Any]) -> str:
    """A field's default as a flag would spell it."""
    if f.default is not dataclasses.MISSING:
        value: Any = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if isinstance(value, tuple):
        value = ",".join(str(part) for part in value)
    return repr(value) if value == "" else str(value)


@dataclasses.dataclass(slots=True, frozen=True)
class _Setting:
    """One flag / environment variable: a field, of the config or of a nested dataclass."""

    field: dataclasses.Field[Any]
    kind: Any
    doc: str
    nested_in: str | None
    """The config field holding the nested dataclass; None for the config's own fields."""


def _settings(cls: type) -> list[_Setting]:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    settings: list[_Setting] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            nested_hints = typing.get_type_hints(hint)
            nested_docs = field_docs(hint)
            settings.extend(
                _Setting(g, _base_type(nested_hints[g.name]), nested_docs.get(g.name, ""), f.name)
                for g in dataclasses.fields(hint)
                if g.init
            )
        else:
            settings.append(_Setting(f, _base_type(hint), docs.get(f.name, ""), None))
    names = [setting.field.name for setting in settings]
    clashes = sorted({name for name in names if names.count(name) > 1})
    if clashes:
        raise TypeError(f"{cls.__name__}: settings named twice: {', '.join(clashes)}")
    return settings


def load_config(
    cls: type[Config],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    description: str | None = None,
) -> Config:
    """Builds `cls` from flags (highest), then environment variables, then field defaults."""
    environ = os.environ if environ is None else environ
    settings = _settings(cls)
    parser = argparse.ArgumentParser(prog=_program(), description=description or cls.__doc__)
    for setting in settings:
        name = setting.field.name
        flag = "--" + name.replace("_", "-")
        help_text = f"{setting.doc} [env {env_var(cls, name)}; default {_default(setting.field)}]"
        if setting.kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, type=str, help=help_text, metavar=name.upper())
    args = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for setting in settings:
        name, kind = setting.field.name, setting.kind
        target = values if setting.nested_in is None else nested.setdefault(setting.nested_in, {})
        raw = args[name]
        if raw is not None:
            target[name] = raw if kind is bool else _parse_value(kind, raw, name)
        elif (env := environ.get(env_var(cls, name))) is not None:
            target[name] = _parse_value(kind, env, env_var(cls, name))
    hints = typing.get_type_hints(cls)
    for holder, fields in nested.items():
        values[holder] = hints[holder](**fields)
    return cls(**values)
