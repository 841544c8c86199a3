"""The address a worker advertises for its KV leases (services/worker/__main__.py)."""

from __future__ import annotations

import socket

from services.worker.__main__ import own_address


def test_an_address_with_a_host_or_none_is_kept() -> None:
    assert own_address("") == ""
    assert own_address("prefill-0:50061") == "prefill-0:50061"
    assert own_address("[fd00::2]:50061") == "[fd00::2]:50061"


def test_a_port_alone_takes_this_machines_own_address() -> None:
    """Each replica of a compose service (one environment for all) advertises its own IP."""
    own = socket.gethostbyname(socket.gethostname())
    assert own_address(":50061") == f"{own}:50061"
