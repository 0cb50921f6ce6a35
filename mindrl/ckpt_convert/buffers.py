"""Output tensors reused from one rank file to the next.

The TP ranks of a pipeline stage hold tensors of the same shapes, and so do the decoder layers
of every stage, so a converter that writes one rank file at a time can fill the next into the
memory of the last: fresh memory costs more than the copy into it (the kernel zero-fills every
page on first touch), and what is held stays about one rank file.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class RankBuffers:
    """Tensors handed out for one rank file, taken back once that file is written."""

    def __init__(self) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = defaultdict(list)
        self._lent: list[torch.Tensor] = []

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` and `dtype` with undefined contents: a free one if there is one."""
        free = self._free[(tuple(shape), dtype)]
        tensor = free.pop() if free else torch.empty(shape, dtype=dtype)
        self._lent.append(tensor)
        return tensor

    def reuse(self) -> None:
        """Take back every tensor handed out; the rank file they were filled for is written."""
        for tensor in self._lent:
            self._free[(tuple(tensor.shape), tensor.dtype)].append(tensor)
        self._lent = []
