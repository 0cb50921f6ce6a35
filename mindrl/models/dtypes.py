"""The parameter dtypes mindrl accepts, by their config / command-line names."""

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
