"""glibc settings for the benches that measure peak memory by RSS.

Every freed block above 64 KiB goes back to the system, so a process's RSS follows what is live rather than what
the allocator keeps: without them the same recompute run's peak varied by half (808 and 522 MiB). They cost speed
(each large block is mapped afresh: a packed update ran 1.7x slower), so the speed benches run without them. A
process reads them when it starts: set them before the launcher's rank server starts, or in a child's environment.
"""

ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
