"""A random HF model of an architecture in configs/model/, for the recipes of the CPU-sized ones
(tiny_qwen, small_qwen, facts_qwen, tiny_qwen3_moe, tiny_qwen25_vl), which have no published weights to convert.

    python tools/ckpt_convert/random_hf.py tiny_qwen ./hf/tiny_qwen [--seed 0] [--dtype fp32]

config.json comes from the converter's own mapping (mindrl.models.hf_mapping), so the model is exactly
the one the yaml describes, and transformers writes the folder as it writes any model. Every tensor is
drawn at random, norm weights around 1 and biases non-zero: a conversion that swaps or mis-cuts a
tensor cannot hide behind HF's all-ones and all-zeros initialisation. It is for checking conversions;
training from random weights needs no HF model (`load: null`).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import transformers

from mindrl.config import ConfigError, load_model_arch
from mindrl.models import hf_mapping

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(arch_name: str, out: str | Path, seed: int = 0, dtype: str = "fp32") -> Path:
    """Save a random causal LM (or vision-language model) of configs/model/<arch_name>.yaml into the absent or
    empty folder `out`."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} is not empty; pick a new folder for the HF model.")
    arch = load_model_arch(arch_name)
    config = hf_mapping.hf_config_from_arch(arch, hf_mapping.model_type_hf_of(arch), DTYPES[dtype])
    config.pop("torch_dtype", None), config.pop("dtype", None)  # transformers takes the dtype as an argument
    hf_config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(seed)
    auto = transformers.AutoModelForImageTextToText if arch.vision else transformers.AutoModelForCausalLM
    model = auto.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.02)
            if "norm" in name or "ln_q" in name:
                param.add_(1.0)
    model.to(DTYPES[dtype]).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arch", help="an architecture of configs/model/, e.g. tiny_qwen")
    parser.add_argument("out", help="output folder (absent or empty)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = parser.parse_args(argv)
    try:
        build(args.arch, args.out, args.seed, args.dtype)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote a random {args.arch} ({args.dtype}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
