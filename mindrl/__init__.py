"""mindrl: Megatron-backed reinforcement-learning post-training for LLMs."""

import warnings

__version__ = "0.1.0"

# Notices megatron-core gives on every run without apex / Transformer Engine (it falls back to
# torch; docs/platforms.md explains), and torch's deprecation of the collective names
# megatron-core calls. Neither is actionable for a mindrl user. Each filter matches one
# message from the one module that issues it, so the same words from anywhere else still show.
for _message, _category, _module in (
    ("Apex is not installed. Falling back to Torch Norm", UserWarning, r"megatron\.core\."),
    ("Transformer Engine and Apex are not installed. ", UserWarning, r"megatron\.core\."),
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated\.", FutureWarning,
     r"torch\.distributed\.c10d_logger$"),
):
    warnings.filterwarnings("ignore", message=_message, category=_category, module=_module)
