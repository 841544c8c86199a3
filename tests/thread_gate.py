"""Gate: holds a function on whatever thread calls it until the test opens it.

Used to make an engine step (or a block copy) last as long as a test needs, unmistakably:
the engine thread sits inside the gated call until `opened` is set.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
GATE_TIMEOUT_S = 30.0
"""A gate nobody opens must not hang the suite: the gated call fails after this long."""


class Gate:
    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def wrap(self, fn: Callable[..., T]) -> Callable[..., T]:
        def gated(*args: Any, **kwargs: Any) -> T:
            self.entered.set()
            assert self.opened.wait(GATE_TIMEOUT_S), "the test never opened the gate"
            return fn(*args, **kwargs)

        return gated

    async def wait_entered(self) -> None:
        """Until some thread is inside the gated call."""
        assert await asyncio.to_thread(self.entered.wait, GATE_TIMEOUT_S)
