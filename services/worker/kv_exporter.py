"""The prefill side of the KV hand-off: leases on held prompts, their blocks served, released.

After the worker half of vLLM's KV connector: the engine holds a finished prompt's blocks
under a KvHandle; the exporter names it on the wire with a KvLease (its LeaseRecord in the
LeaseTable), signs it, streams the blocks a decode worker pulls (each with its keyed digest, a
few blocks read at a time), and gives the handle back to the engine when the lease is released,
expires, or its Prefill answer never reached the caller. A lease serves only the mesh members it
was granted for. Imports no gRPC: the servicer turns the RPCs into these calls.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from kvmesh.errors import InvalidArgument, NotFound
from kvmesh.mesh_keys import MeshKeys
from kvmesh.v1 import common_pb2
from services.worker import metrics
from services.worker.engine.api import KvHandle
from services.worker.kv_transfer import Pacer, check_compatible, chunk_block
from services.worker.leases import LeaseRecord, LeaseTable

if TYPE_CHECKING:
    from services.worker.engine.api import EngineBackend

PULL_READ_BYTES = 8 << 20
"""Most KV bytes a PullKv reads out of the engine at once (at least one block): a pull of any
size holds this much, not the whole lease."""


class KvExporter:
    """Grants, serves and releases this worker's KV leases over one engine."""

    def __init__(
        self,
        engine: EngineBackend,
        leases: LeaseTable,
        layout: common_pb2.KvLayout,
        address: Callable[[], str],
        keys: MeshKeys,
        spawn: Callable[[Coroutine[Any, Any, object]], None],
        *,
        chunk_bytes: int,
        send_max_bytes_s: float,
    ) -> None:
        self.engine = engine
        self.leases = leases
        self.layout = layout
        self._address = address
        self.keys = keys
        self._spawn = spawn
        self._chunk_bytes = chunk_bytes
        self._send_max_bytes_s = send_max_bytes_s

    def grant(
        self, handle: KvHandle, holders: frozenset[str], ttl_s: float | None
    ) -> common_pb2.KvLease:
        """A signed lease on a held prompt for `holders`, as the wire names it."""
        lease = self.leases.grant(
            handle.handle_id, handle.block_hashes, handle.num_tokens, holders, ttl_s
        )
        metrics.LEASES.labels("granted").inc()
        metrics.LEASES_ACTIVE.set(len(self.leases))
        proto = common_pb2.KvLease(
            lease_id=lease.lease_id,
            worker_address=self._address(),
            block_hashes=lease.block_hashes,
            num_tokens=lease.num_tokens,
            model_fingerprint=self.engine.fingerprint,
            layout=self.layout,
            expires_unix_ms=lease.expires_unix_ms,
        )
        proto.signature = self.keys.sign_lease(proto)
        return proto

    async def blocks(
        self,
        lease_id: str,
        caller: str,
        indices: Sequence[int],
        fingerprint: str,
        layout: common_pb2.KvLayout,
    ) -> AsyncIterator[common_pb2.KvChunk]:
        """The chunks of the lease's blocks at `indices` (all when empty) for `caller`, paced to
        the send cap."""
        lease = self.leases.get(lease_id, caller)
        check_compatible(self.engine.fingerprint, self.layout, fingerprint, layout)
        wanted = _pull_indices(indices, len(lease.block_hashes))
        pacer = Pacer(self._send_max_bytes_s)
        # Read off the engine thread (held blocks do not change), so a pull does not wait for
        # the engine's current step; a few blocks per read keep the thread hops few and the
        # bytes held at once bounded, whatever the pull's size.
        per_read = max(1, PULL_READ_BYTES // max(1, self.engine.layout.block_bytes))
        for start in range(0, len(wanted), per_read):
            group = wanted[start : start + per_read]
            try:
                blobs = await self.engine.export_blocks(lease.handle_id, group)
            except KeyError:
                raise NotFound(f"KV lease {lease_id!r} expired during the pull") from None
            for index, data in zip(group, blobs, strict=True):
                metrics.KV_TRANSFER_BYTES.labels("sent").inc(len(data))
                metrics.KV_TRANSFER_BLOCKS.labels("sent").inc()
                block_hash = lease.block_hashes[index]
                digest = self.keys.block_digest(lease.lease_id, index, block_hash, data)
                for chunk in chunk_block(index, block_hash, data, digest, self._chunk_bytes):
                    yield chunk
                    await pacer.sent(len(chunk.data))
            del blobs

    async def release(self, lease_id: str, caller: str) -> int:
        """Ends a lease for `caller` (ReleaseKv); returns the blocks the engine got back."""
        released = await self._release(self.leases.take(lease_id, caller))
        metrics.LEASES.labels("released").inc()
        return released

    def release_undelivered(self, lease_id: str) -> None:
        """Ends at once a lease whose Prefill answer never reached the caller (if still held);
        the engine gets its blocks back in the background."""
        lease = self.leases.drop(lease_id)
        if lease is not None:
            self._spawn(self._release(lease))
            metrics.LEASES.labels("released").inc()

    async def expire(self, lease: LeaseRecord) -> None:
        """The lease sweeper's release callback."""
        await self._release(lease)
        metrics.LEASES.labels("expired").inc()

    async def close(self) -> None:
        """Releases every lease (at shutdown)."""
        for lease in self.leases.take_all():
            await self._release(lease)

    async def _release(self, lease: LeaseRecord) -> int:
        """Unpins a lease's blocks in the engine (already taken out of the table)."""
        metrics.LEASES_ACTIVE.set(len(self.leases))
        try:
            return await self.engine.release(lease.handle_id)
        except KeyError:
            return 0


def _pull_indices(requested: Sequence[int], count: int) -> list[int]:
    """The blocks a PullKv asks for (all when none are named), each named once and in range."""
    if not requested:
        return list(range(count))
    indices = list(requested)
    if len(set(indices)) != len(indices):
        raise InvalidArgument("block_indices", "each block may be asked for once")
    out_of_range = [i for i in indices if i >= count]
    if out_of_range:
        shown = out_of_range[:8]
        raise InvalidArgument(
            "block_indices",
            f"{len(out_of_range)} out of range for a {count}-block lease (e.g. {shown})",
        )
    return indices
