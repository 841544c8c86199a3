"""BlockFiles: the entry store the vLLM backend and its connector share."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from services.worker.backends.kv_files import BlockFiles

BLOCK = 8


def key() -> str:
    return uuid.uuid4().hex


def test_whole_entry_round_trips_and_deletes(tmp_path: Path) -> None:
    files = BlockFiles(tmp_path, BLOCK)
    k = key()
    files.write_entry(k, [b"a" * BLOCK, b"b" * BLOCK, b"c" * BLOCK])
    assert files.keys() == [k]
    assert files.num_blocks(k) == 3
    assert files.read_blocks(k, [2, 0]) == [b"c" * BLOCK, b"a" * BLOCK]
    assert files.delete(k)
    assert not files.delete(k)
    assert files.keys() == []


def test_blocks_fill_a_created_entry(tmp_path: Path) -> None:
    files = BlockFiles(tmp_path, BLOCK)
    k = key()
    files.create(k, 2)
    assert files.read_blocks(k, [1]) == [bytes(BLOCK)]
    files.write_block(k, 1, b"z" * BLOCK)
    assert files.read_blocks(k, [0, 1]) == [bytes(BLOCK), b"z" * BLOCK]


def test_refusals(tmp_path: Path) -> None:
    files = BlockFiles(tmp_path, BLOCK)
    k = key()
    with pytest.raises(KeyError):
        files.read_blocks(k, [0])
    with pytest.raises(ValueError, match="bad entry key"):
        files.create("../escape", 1)
    with pytest.raises(ValueError, match="expected 8"):
        files.write_entry(k, [b"short"])
    assert files.keys() == []  # the half-written entry never became visible
    files.create(k, 1)
    with pytest.raises(ValueError, match="outside the entry's 1 blocks"):
        files.write_block(k, 1, b"x" * BLOCK)
