"""What `bf16: auto` picks on the device, and the line the run prints for it (in a rank: the device is the rank's)."""

from __future__ import annotations


def auto_choice(rank: int) -> tuple[bool, str]:
    from mindrl.platform import get_platform
    from mindrl.platform.precision import choose

    chosen = choose("auto", get_platform().bf16_speed(), "actor_config")
    return chosen.bf16, chosen.line
