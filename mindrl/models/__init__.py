"""Model construction (megatron-core GPTModel from a ModelArch) and weight layouts."""

from mindrl.models.gpt import build_gpt_model, transformer_config

__all__ = ["build_gpt_model", "transformer_config"]
