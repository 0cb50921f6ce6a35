"""HF ⇄ Megatron checkpoint conversion (the library behind cli/convert_ckpt.py)."""

from mindrl.ckpt_convert.hf2mcore import hf_to_mcore
from mindrl.ckpt_convert.mcore2hf import mcore_to_hf

__all__ = ["hf_to_mcore", "mcore_to_hf"]
