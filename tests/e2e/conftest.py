"""The e2e suite's log scan: ordinary cancels, deadlines, disconnects and kills log no ERROR."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.procs import STARTED, alarming_lines


@pytest.fixture(scope="session", autouse=True)
def no_error_in_any_service_log() -> Iterator[None]:
    yield
    found = {
        f"{process.name} {process.address}": lines
        for process in STARTED
        if (lines := alarming_lines(process.log()))
    }
    assert not found, f"ERROR lines or tracebacks in service logs: {found}"
