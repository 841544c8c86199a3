"""Placement policies: how a tier picks the worker that runs a prompt.

A tier names its policy in the pools file (`placement: prefix-affinity`, the default); the
decode worker of a split request is always the least loaded one, since it has no prefix to be
near. A new policy is one module here with a class that has `pick`, one line in `POLICIES`,
and one test.
"""

from __future__ import annotations

from collections.abc import Callable

from services.router.policies.base import PlacementPolicy
from services.router.policies.least_load import LeastLoad
from services.router.policies.prefix_affinity import PrefixAffinity
from services.router.policies.round_robin import RoundRobin

POLICIES: dict[str, Callable[[], PlacementPolicy]] = {
    "prefix-affinity": PrefixAffinity,
    "least-load": LeastLoad,
    "round-robin": RoundRobin,
}
"""Policy names the pools file may give a tier's `placement`, and how to make each."""
DEFAULT_POLICY = "prefix-affinity"
