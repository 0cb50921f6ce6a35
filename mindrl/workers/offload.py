"""Offloading training state to host memory and back, by storage.

Megatron's parameters and gradients are views into a few large contiguous buffers, and
the distributed optimizer's state holds views too. Moving tensors one by one would break
that sharing; moving *storages* keeps it: each distinct storage is copied to a host
buffer and resized to zero (its device memory is released), and on onload resized back
and refilled. Every view sees its data again, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class StorageOffloader:
    """Holds host copies of the storages it freed, until onload."""

    def __init__(self) -> None:
        self._saved: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}

    @property
    def offloaded_bytes(self) -> int:
        return sum(host.numel() for _, host in self._saved.values())

    def offload(self, tensors: Iterable[torch.Tensor], keep: set[int] | None = None) -> int:
        """Free the storages of `tensors` (except those whose data_ptr is in `keep`); returns bytes freed."""
        freed = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            ptr, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or ptr in self._saved or (keep and ptr in keep):
                continue
            host = torch.empty(size, dtype=torch.uint8, device="cpu")
            host.copy_(_bytes_view(storage))
            self._saved[ptr] = (storage, host)
            storage.resize_(0)
            freed += size
        return freed

    def onload(self) -> int:
        """Reallocate and refill every freed storage; returns bytes restored."""
        restored = 0
        for storage, host in self._saved.values():
            storage.resize_(host.numel())
            _bytes_view(storage).copy_(host)
            restored += host.numel()
        self._saved.clear()
        return restored


def storage_ptrs(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().nbytes()}
