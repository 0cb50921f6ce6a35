"""glibc settings for the benches that measure peak memory by RSS, and that measurement.

Every freed block above 64 KiB goes back to the system, so a process's RSS follows what is live rather than what
the allocator keeps: without them the same recompute run's peak varied by half (808 and 522 MiB). They cost speed
(each large block is mapped afresh: a packed update ran 1.7x slower), so the speed benches run without them. A
process reads them when it starts: set them before the launcher's rank server starts, or in a child's environment.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable

ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def rss() -> int:
    """This process's resident bytes now (Linux)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def timed_peak(run: Callable[[], object]) -> tuple[float, float]:
    """`run()`'s seconds and the MiB its process's peak RSS rose above the RSS before it (0 if the peak came
    earlier)."""
    baseline = rss()
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return seconds, max(peak - baseline, 0) / 2**20
