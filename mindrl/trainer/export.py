"""A run's final weights as an HF model beside its checkpoints, for evaluation and release."""

from __future__ import annotations

from pathlib import Path

from mindrl.console import say


def export_hf(save: str | Path, tokenizer: str | Path | None) -> Path:
    """`<save>/hf` from the checkpoint `save`'s tracker names (safetensors, config, and the tokenizer)."""
    from mindrl.ckpt_convert.mcore2hf import mcore_to_hf

    save = Path(save)
    target = mcore_to_hf(save, save / "hf", overwrite=True, progress=False, tokenizer_model=tokenizer)
    say(f"final weights exported to {target} (HF format)")
    return target
