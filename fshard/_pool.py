"""A pool of CPU scratch buffers that a training step makes again every step.

Used by :mod:`fshard.parallel.groups` (replicate / DDP gradient buckets) and
:mod:`fshard.optim` (the update buffers of the Adam / momentum kernels). Not used for
FSDP's gather and reduce-scatter buffers: measured on the bench Transformer, pooling those
too kept ~20 MiB more per rank between steps and gained nothing measurable.
"""

from __future__ import annotations

import torch

__all__ = ["BufferPool", "POOL"]


class BufferPool:
    """CPU flat buffers (gradient buckets, optimizer updates) reused across steps.

    torch has no caching allocator for CPU memory: a fresh multi-MB tensor comes from
    malloc as new pages, and the first write to each page faults (measured on the 2-core
    CI VM: filling a fresh 14 MB tensor 6.8 ms, the same tensor again 0.6 ms). A step
    makes the same buffers every time, so they are kept here and handed out again.

    A buffer is handed out only as a view, and is free again when no tensor but the pool's
    own shares its storage (the view, a gradient or parameter aliasing it, a collective in
    flight all hold the storage): nothing anyone can still read is ever overwritten.
    Only CPU buffers are pooled (CUDA has its own caching allocator), at most
    ``max_bytes`` in all; least recently used ones go first.
    """

    def __init__(self, max_bytes: int = 512 * 2**20) -> None:
        self.max_bytes = max_bytes
        self._bufs: dict[tuple, list[torch.Tensor]] = {}  # insertion order = least recently used first
        self._bytes = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous 1-D tensor of ``numel`` elements, contents undefined."""
        if device.type != "cpu" or numel == 0:
            return torch.empty(numel, dtype=dtype, device=device)
        key = (numel, dtype)
        bufs = self._bufs.pop(key, [])
        self._bufs[key] = bufs  # most recently used last
        for buf in bufs:
            # 2 = the pool's tensor + the temporary storage object of this query.
            if torch._C._storage_Use_Count(buf.untyped_storage()._cdata) <= 2:
                return buf.view(-1)
        buf = torch.empty(numel, dtype=dtype)
        nbytes = numel * buf.element_size()
        if nbytes > self.max_bytes:
            return buf
        self._evict(self.max_bytes - nbytes)
        bufs.append(buf)
        self._bytes += nbytes
        return buf.view(-1)

    def _evict(self, budget: int) -> None:
        for key in list(self._bufs):
            if self._bytes <= budget:
                return
            bufs = self._bufs[key]
            for buf in list(bufs):
                if self._bytes > budget and torch._C._storage_Use_Count(buf.untyped_storage()._cdata) <= 2:
                    bufs.remove(buf)
                    self._bytes -= buf.numel() * buf.element_size()
            if not bufs:
                del self._bufs[key]

    def clear(self) -> None:
        self._bufs.clear()
        self._bytes = 0


POOL = BufferPool()
