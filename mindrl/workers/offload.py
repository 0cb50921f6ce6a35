"""Offloading training state to host memory and back, by storage.

Megatron's parameters and gradients are views into a few large contiguous buffers, and
the distributed optimizer's state holds views too. Moving tensors one by one would break
that sharing; moving *storages* keeps it: each distinct storage is copied to a host
buffer and resized to zero (its device memory is released), and on onload resized back
and refilled. Every view sees its data again, bit for bit.

Offload happens every step, so nothing is paid twice: host buffers are allocated once and reused (pinned on
accelerators, where pageable copies run at a fraction of the link's speed and stall), the copies of one call
are issued together and waited for once, gradients are freed without a copy (the next update zeroes them
before it reads them), and a frozen model's host copy from an earlier offload is reused as it is.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mindrl.platform import Platform


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _key(storage: torch.UntypedStorage) -> int:
    """The storage's identity: its data pointer changes when it is resized, its implementation does not."""
    return storage._cdata


class StorageOffloader:
    """Holds host copies of the storages it freed, until onload; keeps the host buffers for the next offload."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        #: storage key → (storage, its size, its host buffer; None where its contents were discarded)
        self._saved: dict[int, tuple[torch.UntypedStorage, int, torch.Tensor | None]] = {}
        #: storage key → host buffer, kept across offloads
        self._host: dict[int, torch.Tensor] = {}
        #: keys whose host buffer holds the storage's current bytes (a frozen model's, copied once)
        self._current: set[int] = set()
        #: device → host bytes copied so far (what the offloads cost)
        self.copied_bytes = 0

    @property
    def offloaded_bytes(self) -> int:
        return sum(size for _, size, _ in self._saved.values())

    def offload(self, tensors: Iterable[torch.Tensor], keep: set[int] | None = None, discard: bool = False,
                frozen: bool = False) -> int:
        """Free the storages of `tensors` (except those whose data_ptr is in `keep`); returns bytes freed.
        `discard`: their contents are dead until rewritten, so nothing is copied and onload gives zeros.
        `frozen`: they never change, so a host copy made by an earlier offload is used again."""
        freed, moving = 0, []
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key, size = _key(storage), storage.nbytes()
            if size == 0 or key in self._saved or (keep and storage.data_ptr() in keep):
                continue
            host = None
            if not discard:
                host = self._buffer(key, size)
                if not (frozen and key in self._current):
                    host.copy_(_bytes_view(storage), non_blocking=True)
                    self.copied_bytes += size
                if frozen:
                    self._current.add(key)
            self._saved[key] = (storage, size, host)
            moving.append(storage)
            freed += size
        if moving:
            self.platform.synchronize()  # every copy has landed before the device memory goes
        for storage in moving:
            storage.resize_(0)
        return freed

    def forget_copies(self) -> None:
        """Weights offloaded as frozen were loaded anew (a checkpoint's): their next offload copies them again."""
        self._current.clear()

    def _buffer(self, key: int, size: int) -> torch.Tensor:
        host = self._host.get(key)
        if host is None or host.numel() != size:
            host = torch.empty(size, dtype=torch.uint8, pin_memory=self.platform.pin_memory)
            self._host[key] = host
        return host

    def onload(self, keep_off: set[int] | frozenset[int] = frozenset()) -> int:
        """Reallocate and refill every freed storage but those in `keep_off` (storage_keys; zeros where discarded);
        returns bytes restored."""
        back = [key for key in self._saved if key not in keep_off]
        if not back:
            return 0  # called for every worker after every rollout, offloaded or not: no device sync for nothing
        restored = 0
        for key in back:
            storage, size, host = self._saved.pop(key)
            storage.resize_(size)
            if host is None:
                _bytes_view(storage).zero_()
            else:
                _bytes_view(storage).copy_(host, non_blocking=True)
            restored += size
        self.platform.synchronize()
        return restored


def storage_keys(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The identities of the tensors' storages, the same whether they are on the device or offloaded."""
    return {_key(t.untyped_storage()) for t in tensors}


def storage_ptrs(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().nbytes()}
