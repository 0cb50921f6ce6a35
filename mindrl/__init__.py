"""mindrl: Megatron-backed reinforcement-learning post-training for LLMs."""

import warnings

__version__ = "0.1.0"

# megatron-core announces at import that it falls back to torch implementations when apex /
# Transformer Engine are absent, and torch deprecates the collective names megatron-core
# calls. Neither is actionable for a mindrl user (docs/platforms.md explains the fallbacks).
for _message in ("Apex is not installed", "Transformer Engine and Apex are not installed",
                 r".*`torch.distributed.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"):
    warnings.filterwarnings("ignore", message=_message)
