"""KV blocks kept as files, shared by the vLLM backend and its connector across processes.

vLLM runs its scheduler and its model worker in processes of their own, so the blocks a
prefill publishes under a lease, and the blocks a decode pulls before vLLM loads them, live
in a directory all three processes see (RAM-backed /dev/shm where there is one). One file
per entry, named by an opaque key, holds the entry's blocks back to back, each `block_bytes`
long. Whole files are written under a temporary name and renamed, so a reader never sees a
half-written export.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

SHM_DIR = Path("/dev/shm")
_KEY = re.compile(r"^[0-9a-f]{32}$")


def make_store_dir() -> Path:
    """A fresh private directory for one engine's entries (RAM-backed when possible)."""
    parent = SHM_DIR if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="kvmesh-vllm-", dir=parent))


class BlockFiles:
    """Entries of whole KV blocks, one file per key (a 32-hex-digit id the backend makes)."""

    def __init__(self, root: Path, block_bytes: int) -> None:
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        self.root = root
        self.block_bytes = block_bytes

    def write_entry(self, key: str, blocks: Iterable[bytes | memoryview]) -> None:
        """Write a whole entry at once; readers see it complete or not at all."""
        path = self._path(key)
        partial = path.with_suffix(".partial")
        with partial.open("wb") as file:
            for block in blocks:
                if len(block) != self.block_bytes:
                    raise ValueError(f"block of {len(block)} bytes, expected {self.block_bytes}")
                file.write(block)
        partial.rename(path)

    def create(self, key: str, num_blocks: int) -> None:
        """An entry of `num_blocks` zeroed blocks, to be filled one block at a time."""
        with self._path(key).open("xb") as file:
            file.truncate(num_blocks * self.block_bytes)

    def write_block(self, key: str, index: int, data: bytes) -> None:
        """Fill one block of an entry made by `create` (KeyError: no such entry)."""
        if len(data) != self.block_bytes:
            raise ValueError(f"block of {len(data)} bytes, expected {self.block_bytes}")
        self._check_index(key, index)
        with self._open(key, "r+b") as file:
            file.seek(index * self.block_bytes)
            file.write(data)

    def read_blocks(self, key: str, indices: Sequence[int]) -> list[bytes]:
        """Some blocks of an entry, in the order asked (KeyError: no such entry)."""
        for index in indices:
            self._check_index(key, index)
        blocks = []
        with self._open(key, "rb") as file:
            for index in indices:
                file.seek(index * self.block_bytes)
                blocks.append(file.read(self.block_bytes))
        return blocks

    def num_blocks(self, key: str) -> int:
        """Blocks in an entry (KeyError: no such entry)."""
        try:
            return self._path(key).stat().st_size // self.block_bytes
        except FileNotFoundError:
            raise KeyError(key) from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> bool:
        """Remove an entry; False when there was none."""
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def keys(self) -> list[str]:
        """Keys of the complete entries."""
        return sorted(path.stem for path in self.root.glob("*.kv"))

    def _check_index(self, key: str, index: int) -> None:
        count = self.num_blocks(key)
        if not 0 <= index < count:
            raise ValueError(f"block index {index} outside the entry's {count} blocks")

    def _open(self, key: str, mode: str) -> IO[Any]:
        try:
            return self._path(key).open(mode)
        except FileNotFoundError:
            raise KeyError(key) from None

    def _path(self, key: str) -> Path:
        if not _KEY.match(key):
            raise ValueError(f"bad entry key {key!r}")
        return self.root / f"{key}.kv"
