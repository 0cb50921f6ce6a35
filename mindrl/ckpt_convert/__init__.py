"""HF ⇄ Megatron checkpoint conversion and Megatron re-sharding (the library behind cli/convert_ckpt.py)."""

from mindrl.ckpt_convert.hf2mcore import hf_to_mcore
from mindrl.ckpt_convert.mcore2hf import mcore_to_hf
from mindrl.ckpt_convert.mcore2mcore import mcore_to_mcore

__all__ = ["hf_to_mcore", "mcore_to_hf", "mcore_to_mcore"]
