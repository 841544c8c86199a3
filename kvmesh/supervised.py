"""A service started by `kvmesh up` dies with it, even when the supervisor is killed outright.

The child asks for this itself, first thing, instead of the supervisor arranging it between
fork and exec: a `preexec_fn` makes Python fork() where it would vfork(), and then gRPC's fork
handlers restart its poller in the child, whose descriptors `close_fds` closes before exec, so
while the supervisor's own gRPC calls are in flight about one child in five aborted before it
ran (grpc/grpc#43055).
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Mapping

# The supervisor's pid, set by it in each child's environment.
SUPERVISOR_PID_ENV = "KVMESH_SUPERVISOR_PID"
_PR_SET_PDEATHSIG = 1


class SupervisorGone(RuntimeError):
    """The supervisor that started this process has already exited."""


def die_with_supervisor(environ: Mapping[str, str]) -> None:
    """Has the kernel SIGTERM this process when its supervisor dies (nothing when no supervisor
    started it); SupervisorGone when it died before this could be asked."""
    value = environ.get(SUPERVISOR_PID_ENV)
    if value is None:
        return
    if not value.isdigit():
        raise SupervisorGone(f"{SUPERVISOR_PID_ENV} must be a process id, got {value!r}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    # Checked after the prctl: a supervisor that died before it never sends the signal, and the
    # orphan has been handed to another parent by then.
    if os.getppid() != int(value):
        raise SupervisorGone(f"the supervisor (pid {value}) that started it has exited")
