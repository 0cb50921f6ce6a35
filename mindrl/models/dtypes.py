"""The parameter dtypes mindrl accepts, by their config / command-line names."""

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: the rollout engine's dtypes by generate_config.dtype's names (vLLM's)
ENGINE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
