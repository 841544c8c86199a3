"""Markers come from the directory a test lives in (tests/conftest.py)."""

from __future__ import annotations

import pytest


def test_a_unit_test_is_marked_unit_and_nothing_else(request: pytest.FixtureRequest) -> None:
    names = {marker.name for marker in request.node.iter_markers()}
    assert "unit" in names
    assert not names & {"service", "e2e"}
