"""A run's final weights as an HF model beside its checkpoints, for evaluation and release."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from mindrl.console import say

#: beside `<save>/hf` (the merged weights) after a LoRA run: its adapters alone, as PEFT saves them
ADAPTER_DIR = "hf_lora_adapter"


def export_hf(save: str | Path, tokenizer: str | Path | None) -> Path | None:
    """`<save>/hf` from the checkpoint `save`'s tracker names (safetensors, config, and the tokenizer); a LoRA
    run's adapters are merged there, and also written to `<save>/hf_lora_adapter` (a few MB, for PEFT users).
    An adapters-only run that started from random weights has no base checkpoint to merge into: one line says so
    and nothing is written (None), rather than ending the finished run with an error."""
    from mindrl.checkpoint import files, publish
    from mindrl.checkpoint import megatron as mg
    from mindrl.ckpt_convert import dist_format

    save = Path(save)
    if not dist_format.is_dist(save):
        return _export(save, save, tokenizer)
    common = files.first_state(save, mg.read_tracker(save))
    if (common.get("lora") or {}).get("adapters_only") and not dist_format.adapters_base(common):
        return _no_base(save)
    # a scratch folder the next save's clean-up removes, should the run be killed before this one does
    scratch = Path(tempfile.mkdtemp(prefix=f"{publish.TMP}export-", dir=save))
    try:  # megatron-core reads the distributed files into legacy ones of the whole model, exported from there
        return _export(dist_format.dist_to_legacy(save, scratch / "whole"), save, tokenizer)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _export(checkpoint: Path, save: Path, tokenizer: str | Path | None) -> Path | None:
    from mindrl.ckpt_convert.mcore2hf import mcore_to_hf
    from mindrl.ckpt_convert.megatron_source import open_megatron

    source = open_megatron(checkpoint)
    if source.adapters_only and not source.initial_weights:
        return _no_base(save)
    adapter = save / ADAPTER_DIR if source.lora else None
    if adapter is not None:
        from mindrl.ckpt_convert.lora_export import peft_cannot_place

        unplaceable = peft_cannot_place(source)
        if unplaceable:
            say(f"LoRA adapters not written as a PEFT folder ({unplaceable}); the merged HF weights hold them")
            adapter = None
    target = mcore_to_hf(checkpoint, save / "hf", overwrite=True, progress=False, tokenizer_model=tokenizer,
                         lora_adapter_dir=adapter)
    say(f"final weights exported to {target} (HF format)" + (f", LoRA adapters to {adapter}" if adapter else ""))
    return target


def _no_base(save: Path) -> None:
    say(f"final weights not exported to HF: {save} holds LoRA adapters only and the run started from random "
        f"weights, so there is no base checkpoint to merge them into")
