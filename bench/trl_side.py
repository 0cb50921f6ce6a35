"""What bench/trl_grpo.py and bench/trl_dpo.py set up alike for TRL: the policy folder and a step timer."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import transformers

from mindrl.config import load_model_arch
from mindrl.models import hf_mapping as hfm


def save_policy(model: str, folder: Path) -> str:
    """configs/model/<model>_qwen.yaml as a Qwen2 model with random weights (seed 0), saved where TRL loads it:
    TRL builds its reference from the same folder, so the two start equal."""
    arch = load_model_arch(f"{model}_qwen")
    config = transformers.Qwen2Config(**hfm.hf_config_from_arch(arch, "qwen2", torch.float32))
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    return str(folder)


class StepTimer(transformers.TrainerCallback):
    """Seconds of each optimizer step, gradient accumulation included."""

    def __init__(self) -> None:
        self.steps: list[float] = []

    def on_step_begin(self, *_: object, **__: object) -> None:
        self.start = time.perf_counter()

    def on_step_end(self, *_: object, **__: object) -> None:
        self.steps.append(time.perf_counter() - self.start)
