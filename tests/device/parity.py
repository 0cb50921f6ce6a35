"""Megatron's logits and gradients against HF transformers' on the device: a dense (Qwen2), an MoE (Qwen3-MoE) and a
vision-language (Qwen2.5-VL) model, in fp32 and in bf16, from the same random weights.

The loss is the logits weighted by fixed random weights, summed (tests/test_vision_language.py's): its gradient
reaches every parameter and depends on no loss kernel of either side. HF in fp32 on the device is the reference.
fp32 must match it to 1e-4 of each tensor's largest value (TF32 is turned off for it); bf16 cannot, so Megatron's
bf16 error is held against HF's own bf16 error on the same device: at most twice it, or 2 % (bf16 keeps 8 bits).
"""

from __future__ import annotations

import copy

import torch

from tests.device.sizes import Sizes

#: name → HF kind (tests/hf_models.py)
MODELS = {"dense": "qwen2", "moe": "qwen3_moe", "vision_language": "qwen2_5_vl"}
FP32_TOLERANCE = 1e-4
BF16_FACTOR, BF16_FLOOR = 2.0, 0.02


def _build(kind: str, sizes: Sizes):
    from tests.hf_models import build_hf_model, build_hf_vl_model

    if kind == "qwen2_5_vl":
        return build_hf_vl_model(seed=3)
    overrides = {"qwen2": sizes.dense, "qwen3_moe": sizes.moe}[kind]
    return build_hf_model(kind, seed=7, **overrides)


def _batch(kind: str, hf, sizes: Sizes) -> dict[str, torch.Tensor]:
    if kind == "qwen2_5_vl":
        from tests.test_vision_language import image_batch

        return image_batch()
    vocab = hf.config.vocab_size
    tokens = torch.randint(0, vocab, (sizes.parity_rows, sizes.parity_seq), generator=torch.Generator().manual_seed(5))
    return {"tokens": tokens}


def _hf_pass(hf, kind: str, batch: dict, weights: torch.Tensor, dtype: torch.dtype, device: torch.device):
    """HF's logits and its gradients under the checkpoint's names (fp32, on the host)."""
    from tests.hf_models import checkpoint_state
    from tests.test_vision_language import hf_forward

    model = copy.deepcopy(hf).to(device=device, dtype=dtype)
    on_device = {k: v.to(device) for k, v in batch.items()}
    if kind == "qwen2_5_vl":
        on_device["pixel_values"] = on_device["pixel_values"].to(dtype)
        logits = hf_forward(model, on_device)
    else:
        logits = model(on_device["tokens"]).logits
    (logits.float() * weights.to(device)).sum().backward()
    grads = {name: p.grad.float().cpu() for name, p in model.named_parameters()}
    return logits.detach().float().cpu(), checkpoint_state(hf, grads)


def _megatron_pass(arch, full: dict, kind: str, batch: dict, weights: torch.Tensor, dtype: torch.dtype):
    """Megatron's logits and its gradients under HF's names (fp32, on the host), at TP = PP = 1."""
    from torch.nn.functional import pad

    from mindrl.config import ParallelConfig
    from mindrl.distributed import init_model_parallel, release_model_parallel
    from mindrl.models import sharding
    from mindrl.models.forward import run_microbatches
    from mindrl.models.gpt import build_gpt_model, load_stage_weights
    from mindrl.models.vision import mrope_positions
    from mindrl.platform import get_platform
    from tests.hf_models import mcore_to_hf_state

    par = ParallelConfig(1, 1)
    release_model_parallel()
    init_model_parallel(par, arch=arch)
    model = build_gpt_model(arch, par, dtype)
    load_stage_weights(model, sharding.shard_state_dict(full, arch, par, 0, 0))
    device = get_platform().device()
    micro = {k: v.to(device) for k, v in batch.items()}
    if kind == "qwen2_5_vl":
        micro["pixel_values"] = micro["pixel_values"].to(dtype)
        micro["position_ids"] = mrope_positions(batch["tokens"], batch["image_grid_thw"], arch.vision).to(device)
    captured = []

    def weighted_sum(logits: torch.Tensor, _: dict) -> tuple[torch.Tensor, dict]:
        captured.append(logits.detach().float().cpu())
        full_weights = pad(weights, (0, logits.shape[-1] - weights.shape[-1])).to(device)
        return (logits.float() * full_weights).sum(), {}

    run_microbatches(model, [micro], weighted_sum)
    grads = {name: p.grad.float().cpu() for name, p in model.named_parameters()}
    merged = sharding.merge_state_dicts({(0, 0): grads}, arch, par)
    return captured[0][..., :weights.shape[-1]], mcore_to_hf_state(merged, arch)


def _errors(logits: torch.Tensor, grads: dict, reference: tuple[torch.Tensor, dict]) -> dict[str, float]:
    """The largest difference over the largest value: of the logits, and of the worst parameter's gradient."""
    ref_logits, ref_grads = reference

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()

    worst = max((relative(grads[name], grad), name) for name, grad in ref_grads.items() if grad.abs().max() > 0)
    return {"logits": relative(logits, ref_logits), "grads": worst[0], "worst_grad": worst[1]}


def check_model(rank: int, name: str, sizes: Sizes) -> dict:
    """One model's figures (in a rank: Megatron needs its process groups)."""
    from mindrl.models import hf_mapping as hfm
    from mindrl.platform import get_platform
    from tests.hf_models import checkpoint_state, hf_to_mcore_state

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    kind, device = MODELS[name], get_platform().device()
    hf = _build(kind, sizes)
    arch = hfm.arch_from_hf_config(hf.config.to_dict(), kind, name=kind)
    full = hf_to_mcore_state(checkpoint_state(hf), arch)
    batch = _batch(kind, hf, sizes)
    vocab = hf.config.get_text_config().vocab_size
    weights = torch.randn(*batch["tokens"].shape, vocab, generator=torch.Generator().manual_seed(11))
    reference = _hf_pass(hf, kind, batch, weights, torch.float32, device)
    hf_bf16 = _errors(*_hf_pass(hf, kind, batch, weights, torch.bfloat16, device), reference)
    out = {"params": sum(p.numel() for p in hf.parameters()), "tokens": batch["tokens"].numel(),
           "hf_bf16": hf_bf16}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        errors = _errors(*_megatron_pass(arch, full, kind, batch, weights, dtype), reference)
        if dtype == torch.float32:
            limit = {"logits": FP32_TOLERANCE, "grads": FP32_TOLERANCE}
        else:
            limit = {key: max(BF16_FACTOR * hf_bf16[key], BF16_FLOOR) for key in ("logits", "grads")}
        out[label] = {**errors, "limit": limit, "passed": all(errors[k] <= limit[k] for k in limit)}
    out["passed"] = out["fp32"]["passed"] and out["bf16"]["passed"]
    return out


def run(device: str, sizes: Sizes) -> dict:
    from mindrl.launch import run_ranks

    return {name: run_ranks(check_model, 1, name, sizes, device=device)[0] for name in MODELS}
