"""The `args` of a Megatron rank file: written by mindrl, read from mindrl, Megatron-LM and
MindSpeed-LLM.

mindrl writes Megatron-LM's argument names (so Megatron-LM tools can read its checkpoints)
plus `mindrl_arch`, the exact ModelArch. A checkpoint without `mindrl_arch` is read from
the Megatron-LM names alone, through the same table (mindrl.models.arch_fields); args that
ask for something mindrl does not build are refused by name rather than dropped.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from mindrl.config import ConfigError, ModelArch, ParallelConfig
from mindrl.config.parallel import without_noop_layers
from mindrl.models import arch_fields as af

# Megatron-LM / MindSpeed-LLM args that change the weights or the numbers in ways mindrl
# does not convert, and what they ask for. A value other than None / False / 0 means "on".
_UNSUPPORTED = {
    "mtp_num_layers": "multi-token-prediction layers",
    "num_nextn_predict_layers": "multi-token-prediction layers (older MindSpeed-LLM)",
    "schedules_method": "a DualPipeV schedule, whose rank files hold V-ordered model chunks (MindSpeed-LLM)",
    "rotary_interleaved": "interleaved rotary embeddings",
    "apply_layernorm_1p": "zero-centered layer-norm weights",
    "layernorm_zero_centered_gamma": "zero-centered layer-norm weights",
    "apply_residual_connection_post_layernorm": "post-layernorm residuals",
    "post_norm": "post-norm layers (MindSpeed-LLM)",
    "moe_tp_extend_ep": "whole experts spread over the tensor-parallel ranks (MindSpeed-LLM)",
    "embed_layernorm": "an embedding layer norm",
    "add_dense_bias": "a bias on the attention output projection",
    "heterogeneous_layers_config_path": "heterogeneous layers",
    "pipeline_model_parallel_layout": "a custom pipeline layout",
    "account_for_embedding_in_pipeline_split": "a pipeline split that counts the embedding",
    "account_for_loss_in_pipeline_split": "a pipeline split that counts the loss",
    "use_legacy_models": "legacy (non-mcore) models",
    "squared_relu": "a squared-ReLU activation",
    "openai_gelu": "OpenAI's GeLU",
}


class ArgsIncomplete(ConfigError):
    """The args do not describe the architecture (absent, or lacking required names)."""


def checkpoint_args(arch: ModelArch, par: ParallelConfig, params_dtype: torch.dtype,
                    **extra: Any) -> argparse.Namespace:
    """Megatron-named arguments describing the architecture and layout, plus mindrl's own."""
    return argparse.Namespace(
        **af.megatron_arch_args(arch, par.tp),
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        expert_model_parallel_size=par.ep,
        # recorded as Megatron does; CP cuts sequences, not weights, so a checkpoint loads at any CP
        context_parallel_size=par.cp,
        num_layer_list=",".join(map(str, par.num_layer_list)) if par.num_layer_list else None,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        mindrl_arch=dataclasses.asdict(arch),
        # Megatron-LM places the dense layers by pattern, where MindSpeed-LLM reads first_k_dense_replace
        **({"moe_layer_freq": arch.moe_layer_pattern} if arch.first_k_dense_replace else {}),
        **extra,
    )


def is_mindrl(args: Any) -> bool:
    return isinstance(args, argparse.Namespace) and isinstance(getattr(args, "mindrl_arch", None), dict)


def arch_from_args(args: Any, name: str = "checkpoint", hf_vocab: int | None = None) -> ModelArch:
    """The ModelArch of a checkpoint's args: mindrl's exact one, else read from Megatron-LM's names.

    Raises ConfigError naming what is missing when the args do not describe the architecture.
    """
    if is_mindrl(args):
        return ModelArch(**args.mindrl_arch)
    if not isinstance(args, argparse.Namespace):
        raise ArgsIncomplete(f"{name} stores no args (an argparse.Namespace) describing its architecture; "
                          f"pass --hf-config-dir with the model's HF config.json and --model-type-hf.")
    for key, feature in _UNSUPPORTED.items():
        value = getattr(args, key, None)
        if value not in (None, False, 0, "", "none"):
            raise ConfigError(f"{name} was trained with {key}={value!r} ({feature}), which mindrl does not "
                              f"convert; only GPT models with RoPE (dense, or with Qwen-MoE or DeepSeek-style "
                              f"experts, and multi-latent attention) are supported.")
    if getattr(args, "use_mcore_models", None) is False and not hasattr(args, "use_legacy_models"):
        raise ConfigError(f"{name} is a legacy (non-mcore) Megatron model (use_mcore_models=False); mindrl reads "
                          f"megatron-core checkpoints only, so convert it to mcore with Megatron-LM first.")
    values, missing = af.arch_values_from_megatron(with_mla_names(args))
    if values.get("multi_latent_attention"):
        values["kv_channels"] = None  # Megatron-LM's kv_channels is unused there: the MLA sizes are the head widths
        _check_mla_rope(name, args, values)
    values.update(_deepseek_layers(name, args, values))
    noop_split = _noop_split(args)
    if noop_split is not None:
        values["num_layers"] = noop_split[0]
    if missing:
        raise ArgsIncomplete(f"{name}'s args lack {', '.join(missing)}, so they do not describe the architecture; "
                          f"pass --hf-config-dir with the model's HF config.json and --model-type-hf.")
    padded, multiple = af.vocab_from_megatron(args, int(getattr(args, "tensor_model_parallel_size", 1) or 1),
                                              hf_vocab)
    values.update(padded_vocab_size=padded, make_vocab_size_divisible_by=multiple)
    return ModelArch(name=name, **values)


#: older MindSpeed-LLM's multi-latent attention args (HF's names) → Megatron-LM's
_MINDSPEED_MLA_NAMES = {"qk_nope_head_dim": "qk_head_dim", "qk_rope_head_dim": "qk_pos_emb_head_dim"}


def with_mla_names(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with older MindSpeed-LLM's MLA flag and sizes under Megatron-LM's names. Where it set its own flag,
    its sizes win over Megatron-LM's same-meaning args, which its argparse may also hold at their defaults."""
    if not getattr(args, "multi_head_latent_attention", False):
        return args
    renamed = {new: getattr(args, old) for old, new in _MINDSPEED_MLA_NAMES.items()
               if getattr(args, old, None) is not None}
    return argparse.Namespace(**{**vars(args), **renamed, "multi_latent_attention": True})


def _check_mla_rope(name: str, args: argparse.Namespace, values: dict[str, Any]) -> None:
    """Megatron-LM keeps an MLA model's YaRN in keys of its own (`rope_type`, yarn by default, with
    `rotary_scaling_factor`, `mscale`, …), which mindrl does not read: read as plain RoPE they would build another
    model, so such args need the HF config."""
    if values.get("rope_scaling_type") is None and hasattr(args, "rotary_scaling_factor") and \
            getattr(args, "rope_type", None) != "rope":
        raise ArgsIncomplete(f"{name} is a Megatron-LM multi-latent attention checkpoint whose RoPE is in "
                             f"Megatron-LM's own keys (rope_type={getattr(args, 'rope_type', None)!r}, "
                             f"rotary_scaling_factor={args.rotary_scaling_factor!r}), which mindrl does not read; "
                             f"pass --hf-config-dir with the model's HF config.json and --model-type-hf deepseek_v3.")


def _deepseek_layers(name: str, args: argparse.Namespace, values: dict[str, Any]) -> dict[str, Any]:
    """MindSpeed-LLM's `n_shared_experts` as the shared expert's width, and Megatron-LM's `moe_layer_freq` pattern as
    dense layers first (the one pattern mindrl builds)."""
    out: dict[str, Any] = {}
    shared = getattr(args, "n_shared_experts", None)
    if shared and not values.get("moe_shared_expert_intermediate_size"):
        out["moe_shared_expert_intermediate_size"] = shared * (values.get("moe_ffn_hidden_size")
                                                               or values["ffn_hidden_size"])
    freq, layers = getattr(args, "moe_layer_freq", 1), values.get("num_layers")
    if freq in (None, 1) or not values.get("num_experts") or not isinstance(layers, int):
        return out
    pattern = list(freq) if isinstance(freq, list | tuple) else [int(i % freq == 0) for i in range(layers)]
    dense = pattern.index(1) if 1 in pattern else layers
    if pattern != [0] * dense + [1] * (layers - dense):
        raise ConfigError(f"{name} was trained with moe_layer_freq={freq!r} (experts every few layers), which mindrl "
                          f"does not convert; it builds dense layers first and experts in every layer after them.")
    if values.get("first_k_dense_replace") not in (None, 0, dense):
        raise ConfigError(f"{name}'s args disagree on its dense layers: first_k_dense_replace="
                          f"{values['first_k_dense_replace']} but moe_layer_freq={freq!r} makes {dense}; fix the args.")
    out["first_k_dense_replace"] = dense
    return out


def parallel_from_args(args: argparse.Namespace) -> ParallelConfig:
    """TP, PP and the per-stage layer counts (MindSpeed-LLM's num_layer_list, or Megatron-LM's
    decoder_first/last_pipeline_num_layers turned into one)."""
    tp = int(getattr(args, "tensor_model_parallel_size", None) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", None) or 1)
    layers = getattr(args, "num_layer_list", None)
    first = getattr(args, "decoder_first_pipeline_num_layers", None)
    last = getattr(args, "decoder_last_pipeline_num_layers", None)
    if not layers and (first or last) and pp > 1:
        layers = _uneven_split(int(args.num_layers), pp, first, last)
    noop_split = _noop_split(args)
    if noop_split is not None:
        if layers:
            raise ConfigError(f"checkpoint args have both noop_layers={args.noop_layers!r} and a per-stage layer "
                              f"split ({layers}); they disagree on how the stages are sized, so fix the args.")
        layers = ",".join(map(str, noop_split[1]))
    ep = int(getattr(args, "expert_model_parallel_size", None) or 1)
    expert_tp = getattr(args, "expert_tensor_parallel_size", None)
    if expert_tp not in (None, tp):
        raise ConfigError(f"checkpoint args have expert_tensor_parallel_size={expert_tp} with "
                          f"tensor_model_parallel_size={tp}; mindrl reads experts cut like the dense layers, so "
                          f"re-shard it with expert_tensor_parallel_size = tensor_model_parallel_size first.")
    return ParallelConfig(tp, pp, num_layer_list=layers or None, expert_model_parallel_size=ep)


def _noop_split(args: Any) -> tuple[int, tuple[int, ...]] | None:
    """MindSpeed-LLM's no-op layers as the real layer count and each stage's layers (None without them): its
    checkpoints hold no weights for them, and a stage's layers are numbered as in a stage of that many."""
    noops = getattr(args, "noop_layers", None)
    if noops is None or noops == "" or (isinstance(noops, list | tuple | set) and not noops) or \
            getattr(args, "num_layers", None) is None:
        return None
    return without_noop_layers(noops, int(args.num_layers), int(getattr(args, "pipeline_model_parallel_size", None)
                                                                  or 1))


def virtual_stages(args: Any) -> int:
    """Model chunks per pipeline rank (1 without a virtual pipeline)."""
    return int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)


def _uneven_split(num_layers: int, pp: int, first: int | None, last: int | None) -> str:
    """Megatron-LM's rule: the first / last stage get their counts, the others share the rest evenly."""
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if middle < 0 or (middle == 0 and rest) or (middle and rest % middle):
        raise ConfigError(f"decoder_first/last_pipeline_num_layers={first}/{last} do not split "
                          f"num_layers={num_layers} over {pp} stages; the checkpoint args are inconsistent.")
    counts = [rest // middle] * middle if middle else []
    if first is not None:
        counts.insert(0, first)
    if last is not None:
        counts.append(last)
    return ",".join(map(str, counts))
