"""THE table of architecture names: each ModelArch field as Megatron-LM's checkpoint args,
megatron-core's TransformerConfig and HF's config.json call it.

Checkpoint args (written by mindrl, read from mindrl, Megatron-LM and MindSpeed-LLM), the
TransformerConfig of every model mindrl builds, and the HF config.json the converter reads
and writes are all produced from this one table, so a field cannot be renamed, negated or
defaulted in one place and forgotten in another. Plain renames are data; the few values
that are computed (key-value heads, head size, the padded vocabulary, the activation, the
RoPE base of an HF config) are the explicit functions below the table.

`attention_bias` has no entry: no checkpoint or config stores it (ModelArch.from_dict only
checks it against disable_bias_linear).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F

from mindrl.config import ConfigError, ModelArch

MEGATRON, CONFIG, HF = "megatron", "config", "hf"
REQUIRED = object()  # a default meaning: no default, the name must be present


@dataclass(frozen=True)
class Link:
    """One ModelArch field's names on the other sides (empty / None: no counterpart there)."""

    #: Megatron-LM args names; written under the first, read from the first one present
    #: (newer Megatron-LM renamed norm_epsilon to layernorm_epsilon)
    megatron: tuple[str, ...] = ()
    config: str | None = None
    hf: str | None = None
    #: sides that store `not value` (ModelArch's disable_bias_linear is Megatron's add_bias_linear)
    negated: frozenset[str] = frozenset()
    #: what Megatron-LM assumed when args saved by an older version lack the name
    megatron_default: Any = REQUIRED
    hf_default: Any = REQUIRED
    #: whether the field changes tensor names or shapes (False: only the numbers computed)
    structural: bool = True
    cast: Callable[[Any], Any] | None = None
    #: a mixture-of-experts field: written on no side for a dense model, so its files stay as they were
    moe: bool = False
    #: a multi-latent attention field: written on no side for a model without it
    mla: bool = False


LINKS: dict[str, Link] = {
    "num_layers": Link(("num_layers",), "num_layers", "num_hidden_layers"),
    "hidden_size": Link(("hidden_size",), "hidden_size", "hidden_size"),
    "ffn_hidden_size": Link(("ffn_hidden_size",), "ffn_hidden_size", "intermediate_size"),
    "num_attention_heads": Link(("num_attention_heads",), "num_attention_heads", "num_attention_heads"),
    "num_query_groups": Link(("num_query_groups",), "num_query_groups", "num_key_value_heads",
                             megatron_default=None, hf_default=None),
    "kv_channels": Link(("kv_channels",), "kv_channels", "head_dim", megatron_default=None, hf_default=None),
    "padded_vocab_size": Link(("vocab_size",), None, "vocab_size", megatron_default=None, structural=False),
    "make_vocab_size_divisible_by": Link(("make_vocab_size_divisible_by",), megatron_default=128,
                                         structural=False),
    "max_position_embeddings": Link(("max_position_embeddings",), None, "max_position_embeddings",
                                    hf_default=4096, structural=False),
    "untie_embeddings_and_output_weights": Link(("untie_embeddings_and_output_weights",), None,
                                                "tie_word_embeddings", negated=frozenset({HF}),
                                                megatron_default=False, hf_default=False),
    "add_qkv_bias": Link(("add_qkv_bias",), "add_qkv_bias", megatron_default=False),
    "disable_bias_linear": Link(("add_bias_linear",), "add_bias_linear", negated=frozenset({MEGATRON, CONFIG}),
                                megatron_default=True),
    "qk_layernorm": Link(("qk_layernorm",), "qk_layernorm", megatron_default=False),
    "normalization": Link(("normalization",), "normalization", megatron_default="LayerNorm"),
    "norm_epsilon": Link(("norm_epsilon", "layernorm_epsilon"), "layernorm_epsilon", "rms_norm_eps",
                         megatron_default=1e-5, hf_default=1e-6, structural=False, cast=float),
    "swiglu": Link(("swiglu",), "gated_linear_unit", megatron_default=False),
    "position_embedding_type": Link(("position_embedding_type",), megatron_default="learned_absolute",
                                    structural=False),
    "rotary_base": Link(("rotary_base",), None, "rope_theta", megatron_default=10000, structural=False,
                        cast=float),
    "attention_softmax_in_fp32": Link(("attention_softmax_in_fp32",), "attention_softmax_in_fp32",
                                      megatron_default=False, structural=False),
    # HF keeps it as id2label under a *ForSequenceClassification architecture: hf_mapping reads and writes it.
    "num_labels": Link(("num_labels",), megatron_default=None),
    # Mixture of experts (Qwen2-MoE / Qwen3-MoE); an HF config keeps the experts' count as num_experts
    # (transformers >= 5 saves Qwen3-MoE's as num_local_experts: both are read).
    "num_experts": Link(("num_experts",), "num_moe_experts", "num_experts", megatron_default=None,
                        hf_default=None, moe=True),
    "moe_router_topk": Link(("moe_router_topk",), "moe_router_topk", "num_experts_per_tok", megatron_default=2,
                            hf_default=2, moe=True),
    "moe_ffn_hidden_size": Link(("moe_ffn_hidden_size",), "moe_ffn_hidden_size", "moe_intermediate_size",
                                megatron_default=None, hf_default=None, moe=True),
    "moe_shared_expert_intermediate_size": Link(("moe_shared_expert_intermediate_size",),
                                                "moe_shared_expert_intermediate_size",
                                                "shared_expert_intermediate_size", megatron_default=None,
                                                hf_default=None, moe=True),
    "moe_shared_expert_gate": Link(("moe_shared_expert_gate",), "moe_shared_expert_gate", megatron_default=False,
                                   moe=True),
    # Megatron's pre-softmax router takes the top-k of the softmax over all experts (not renormalised);
    # without it the softmax runs over the top-k logits, which renormalises them.
    "norm_topk_prob": Link(("moe_router_pre_softmax",), "moe_router_pre_softmax", "norm_topk_prob",
                           negated=frozenset({MEGATRON, CONFIG}), megatron_default=False, hf_default=False,
                           structural=False, moe=True),
    "moe_router_load_balancing_type": Link(("moe_router_load_balancing_type",), "moe_router_load_balancing_type",
                                           megatron_default="aux_loss", structural=False, moe=True),
    # Copied as is, in Megatron's meaning (MindSpeed-RL users set it so): a load-balancing loss per layer, each
    # 1 / top-k of HF's formula on that layer; HF pools one over all layers (only with output_router_logits), so
    # the same number pulls ≈ layers / top-k times harder on each layer here (docs/moe.md)
    "moe_aux_loss_coeff": Link(("moe_aux_loss_coeff",), "moe_aux_loss_coeff", "router_aux_loss_coef",
                               megatron_default=0.0, hf_default=0.0, structural=False, cast=float, moe=True),
    "moe_z_loss_coeff": Link(("moe_z_loss_coeff",), "moe_z_loss_coeff", megatron_default=None, structural=False,
                             moe=True),
    "moe_token_dispatcher_type": Link(("moe_token_dispatcher_type",), "moe_token_dispatcher_type",
                                      megatron_default="allgather", structural=False, moe=True),
    "moe_router_dtype": Link(("moe_router_dtype",), "moe_router_dtype", megatron_default=None, structural=False,
                             moe=True),  # effective: fp32 for sigmoid routing (ModelArch.router_dtype)
    # DeepSeek-style routing (DeepSeek-V3, GLM-4.5), in MindSpeed-LLM's args names; an HF config names them by family
    # (hf_mapping reads and writes them)
    "first_k_dense_replace": Link(("first_k_dense_replace",), megatron_default=0, moe=True),
    "moe_router_score_function": Link(("moe_router_score_function",), "moe_router_score_function",
                                      megatron_default="softmax", structural=False, moe=True),
    # megatron-core would keep it as a buffer and update it; mindrl adds it as a frozen parameter (models/moe.py)
    "moe_router_enable_expert_bias": Link(("moe_router_enable_expert_bias",), megatron_default=False, moe=True),
    "moe_router_num_groups": Link(("moe_router_num_groups",), "moe_router_num_groups", megatron_default=None,
                                  structural=False, moe=True),
    "moe_router_group_topk": Link(("moe_router_group_topk",), "moe_router_group_topk", megatron_default=None,
                                  structural=False, moe=True),
    "moe_router_topk_scaling_factor": Link(("moe_router_topk_scaling_factor",), "moe_router_topk_scaling_factor",
                                           megatron_default=None, structural=False, cast=float, moe=True),
    # megatron-core takes it as the GPTModel's rotary_percent; an HF config as partial_rotary_factor (hf_mapping)
    "rotary_percent": Link(("rotary_percent",), megatron_default=1.0, structural=False, cast=float),
    # Vision-language (Qwen2.5-VL): Megatron-LM's --mrope-section; the vision tower has no Megatron-LM args, so
    # its fields are kept as one mapping. An HF config nests both (hf_mapping reads and writes them).
    "mrope_section": Link(("mrope_section",), "mrope_section", megatron_default=None, structural=False),
    "vision": Link(("vision_config",), megatron_default=None),
    # RoPE scaling, in MindSpeed-LLM's args names (Megatron-LM's use_rope_scaling is read below); an HF config nests
    # them in rope_scaling / rope_parameters under its own names (_HF_ROPE)
    "rope_scaling_type": Link(("rope_scaling_type",), megatron_default=None, structural=False),
    "rope_scaling_factor": Link(("rope_scaling_factor",), megatron_default=1.0, structural=False, cast=float),
    # MindSpeed-LLM's llama3 scaling reads original_max_position_embeddings, its yarn the rope_scaling_ name
    "rope_scaling_original_max_position_embeddings": Link(("rope_scaling_original_max_position_embeddings",
                                                           "original_max_position_embeddings"),
                                                          megatron_default=None, structural=False),
    "low_freq_factor": Link(("low_freq_factor",), megatron_default=1.0, structural=False, cast=float),
    "high_freq_factor": Link(("high_freq_factor",), megatron_default=4.0, structural=False, cast=float),
    "beta_fast": Link(("beta_fast", "rope_scaling_beta_fast"), megatron_default=32.0, structural=False, cast=float),
    "beta_slow": Link(("beta_slow", "rope_scaling_beta_slow"), megatron_default=1.0, structural=False, cast=float),
    "rope_scaling_mscale": Link(("rope_scaling_mscale",), megatron_default=None, structural=False, cast=float),
    "rope_scaling_mscale_all_dim": Link(("rope_scaling_mscale_all_dim",), megatron_default=None, structural=False,
                                        cast=float),
    # Multi-latent attention (DeepSeek-V3), in Megatron-LM's args names; mindrl builds its own attention module
    # (models/mla.py), so none goes to the TransformerConfig. HF's deepseek_v3 calls qk_head_dim qk_nope_head_dim.
    "multi_latent_attention": Link(("multi_latent_attention",), megatron_default=False, mla=True),
    "q_lora_rank": Link(("q_lora_rank",), None, "q_lora_rank", megatron_default=None, hf_default=None, mla=True),
    "kv_lora_rank": Link(("kv_lora_rank",), None, "kv_lora_rank", megatron_default=None, hf_default=None, mla=True),
    "qk_head_dim": Link(("qk_head_dim",), None, "qk_nope_head_dim", megatron_default=None, hf_default=None,
                        mla=True),
    "qk_pos_emb_head_dim": Link(("qk_pos_emb_head_dim",), None, "qk_rope_head_dim", megatron_default=None,
                                hf_default=None, mla=True),
    "v_head_dim": Link(("v_head_dim",), None, "v_head_dim", megatron_default=None, hf_default=None, mla=True),
}

#: ModelArch's RoPE-scaling fields → their keys in HF's rope_scaling, and the keys HF's initialiser of each
#: rope_type reads (what is written for it)
_HF_ROPE = {"rope_scaling_factor": "factor",
            "rope_scaling_original_max_position_embeddings": "original_max_position_embeddings",
            "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor", "beta_fast": "beta_fast",
            "beta_slow": "beta_slow", "rope_scaling_mscale": "mscale", "rope_scaling_mscale_all_dim": "mscale_all_dim"}
_HF_ROPE_KEYS = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                 "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                          "mscale_all_dim"),
                 "linear": ("factor",), "dynamic": ("factor",)}
#: keys of an HF rope dict that are not scaling parameters
_HF_ROPE_OTHER = ("rope_type", "type", "rope_theta", "mrope_section", "partial_rotary_factor")

# Values every other side holds in place of the raw field: the effective count or size.
_EFFECTIVE: dict[str, Callable[[ModelArch], Any]] = {
    "num_query_groups": lambda arch: arch.query_groups,
    "kv_channels": lambda arch: arch.head_dim,
    "moe_ffn_hidden_size": lambda arch: arch.expert_ffn_hidden_size if arch.is_moe else None,
    "moe_router_dtype": lambda arch: arch.router_dtype,
    # megatron-core has one alltoall dispatcher; MindSpeed's alltoall_seq was folded into it
    "moe_token_dispatcher_type": lambda arch: ("alltoall" if arch.moe_token_dispatcher_type == "alltoall_seq"
                                               else arch.moe_token_dispatcher_type),
    "mrope_section": lambda arch: list(arch.mrope_section) if arch.mrope_section else None,
    "vision": lambda arch: dataclasses.asdict(arch.vision) if arch.vision else None,
    # the context the scaling was pre-trained at, where the scaling reads one (null means max_position_embeddings)
    "rope_scaling_original_max_position_embeddings": lambda arch: (
        arch.rope_scaling_original_max_position_embeddings or arch.max_position_embeddings
        if arch.rope_scaling_type in ("llama3", "yarn") else None),
}


def _hf_rope(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """An HF config's RoPE type and parameters: rope_scaling (transformers < 5; transformers 5 too takes it first
    where a config has both) or rope_parameters."""
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    return params.get("rope_type") or params.get("type") or "default", params


def rope_theta(config: Mapping[str, Any]) -> float:
    """RoPE base of an HF config: top level (transformers < 5) or in rope_parameters."""
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise ConfigError("HF config has no rope_theta (top level or in rope_parameters); add it.")
    return float(theta)


def rope_scaling_from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    """ModelArch's RoPE-scaling fields from an HF config (none for plain RoPE; Qwen2.5-VL's published configs call
    theirs "mrope"); a scaling or a parameter mindrl does not build is one sentence."""
    rope_type, params = _hf_rope(config)
    if rope_type in ("default", "mrope"):
        return {}
    if rope_type not in _HF_ROPE_KEYS:
        raise ConfigError(f"HF config uses RoPE scaling {rope_type!r}, which mindrl does not build; it builds "
                          f"{', '.join(_HF_ROPE_KEYS)}.")
    if params.get("factor") is None:
        raise ConfigError(f"HF config's {rope_type} RoPE scaling has no factor; add it (vLLM needs it too).")
    unknown = sorted(key for key, value in params.items() if key not in (*_HF_ROPE_OTHER, *_HF_ROPE_KEYS[rope_type])
                     and value is not None and not (key == "truncate" and value is True))
    if unknown:
        raise ConfigError(f"HF config's {rope_type} RoPE scaling sets {', '.join(unknown)}, which mindrl does not "
                          f"build; only {', '.join(_HF_ROPE_KEYS[rope_type])} are read.")
    out = {"rope_scaling_type": rope_type}
    for name, key in _HF_ROPE.items():
        if key in _HF_ROPE_KEYS[rope_type] and params.get(key) is not None:
            out[name] = _read(name, HF, params[key])
    return out


def hf_rope_scaling(arch: ModelArch) -> dict[str, Any] | None:
    """HF's rope_scaling for `arch` (None without scaling), as the published configs write it: the keys HF's
    initialiser of that type reads, YaRN's correction bounds only where they are not HF's defaults."""
    rope_type = arch.rope_scaling_type
    if rope_type is None:
        return None
    out: dict[str, Any] = {"rope_type": rope_type}
    for name, key in _HF_ROPE.items():
        value = effective(arch, name)
        if key in _HF_ROPE_KEYS[rope_type] and value is not None and \
                not (key in ("beta_fast", "beta_slow") and value == LINKS[name].megatron_default):
            out[key] = value
    return out


def _hf_head_dim(config: Mapping[str, Any]) -> int | None:
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    return head_dim if head_dim * heads != hidden else None


# HF values that are not a plain copy of one key.
_FROM_HF: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "num_experts": lambda config: (config.get("num_experts") or config.get("num_local_experts")
                                   or config.get("n_routed_experts")),
    "num_query_groups": lambda config: config.get("num_key_value_heads") or config["num_attention_heads"],
    "kv_channels": _hf_head_dim,
    "rotary_base": rope_theta,
}


def effective(arch: ModelArch, name: str) -> Any:
    return _EFFECTIVE[name](arch) if name in _EFFECTIVE else getattr(arch, name)


def _side_value(arch: ModelArch, name: str, side: str) -> Any:
    value = effective(arch, name)
    return (not value) if side in LINKS[name].negated else value


def _read(name: str, side: str, value: Any) -> Any:
    link = LINKS[name]
    if side in link.negated:
        value = not value
    return link.cast(value) if link.cast and value is not None else value


def _links(arch: ModelArch) -> dict[str, Link]:
    """The fields `arch` has on the other sides: the MoE ones only for an MoE model, the multi-latent attention ones
    only with it."""
    return {name: link for name, link in LINKS.items()
            if (arch.is_moe or not link.moe) and (arch.multi_latent_attention or not link.mla)}


def megatron_arch_args(arch: ModelArch, tp: int) -> dict[str, Any]:
    """The architecture in Megatron-LM's argument names, vocabulary padded for `tp` as Megatron pads it."""
    out = {link.megatron[0]: _side_value(arch, name, MEGATRON) for name, link in _links(arch).items()
           if link.megatron}
    out["group_query_attention"] = arch.query_groups != arch.num_attention_heads
    out["padded_vocab_size"] = arch.vocab_size_for(tp)
    out["add_position_embedding"] = False  # no learned absolute positions with RoPE; Megatron-LM checks it
    return out


def transformer_config_kwargs(arch: ModelArch) -> dict[str, Any]:
    """The architecture as megatron-core TransformerConfig keywords."""
    out = {link.config: _side_value(arch, name, CONFIG) for name, link in _links(arch).items() if link.config}
    out["activation_func"] = F.silu if arch.swiglu else F.gelu
    return out


def hf_config_values(arch: ModelArch) -> dict[str, Any]:
    """The architecture's entries of an HF config.json (family keys are the caller's)."""
    values = {link.hf: _side_value(arch, name, HF) for name, link in _links(arch).items() if link.hf}
    if arch.rope_scaling_type is not None:
        values["rope_scaling"] = hf_rope_scaling(arch)
    # an absent MoE option (Qwen3-MoE's shared expert) is no key in HF's configs
    return {key: value for key, value in values.items() if value is not None or not _moe_hf_key(key)}


def _moe_hf_key(key: str) -> bool:
    return any(link.moe and link.hf == key for link in LINKS.values())


def arch_values_from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    """ModelArch keywords from an HF config.json (family-implied fields excluded)."""
    missing = [link.hf for name, link in LINKS.items() if link.hf and link.hf_default is REQUIRED
               and name not in _FROM_HF and link.hf not in config]
    if missing:
        raise ConfigError(f"config.json lacks {', '.join(missing)}; it is not a causal-LM config.")
    out = {}
    for name, link in LINKS.items():
        if link.hf is None:
            continue
        if name in _FROM_HF:
            out[name] = _FROM_HF[name](config)
        else:
            out[name] = _read(name, HF, config.get(link.hf, link.hf_default))
    out.update(rope_scaling_from_hf(config))
    return _dense_without_moe_fields(out)


def _dense_without_moe_fields(values: dict[str, Any]) -> dict[str, Any]:
    """A dense model's values without the MoE fields, whose defaults differ between the sides."""
    if values.get("num_experts") is not None:
        return values
    return {name: value for name, value in values.items() if not LINKS[name].moe}


def arch_values_from_megatron(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """ModelArch keywords from Megatron-LM / MindSpeed-LLM args, and the required names they lack.

    The vocabulary is left to `vocab_from_megatron`, which needs the TP size and, where known,
    the unpadded vocabulary.
    """
    out, missing = {}, []
    for name, link in LINKS.items():
        if not link.megatron or name == "padded_vocab_size":
            continue
        value = megatron_value(args, name)
        if value is not None:
            out[name] = value
        elif link.megatron_default is REQUIRED:
            missing.append(link.megatron[0])
        else:
            out[name] = _read(name, MEGATRON, link.megatron_default)
    if getattr(args, "group_query_attention", True) is False:
        out["num_query_groups"] = None  # Megatron ignores num_query_groups (default 1) without GQA
    out.update(_megatron_rope_scaling(args, out))
    if getattr(args, "padded_vocab_size", None) is None:
        missing.append("padded_vocab_size")
    return _dense_without_moe_fields(out), missing


def megatron_value(args: argparse.Namespace, name: str) -> Any:
    """ModelArch field `name` as Megatron args store it (under the first of its names present), or None."""
    present = [n for n in LINKS[name].megatron if getattr(args, n, None) is not None]
    return _read(name, MEGATRON, getattr(args, present[0])) if present else None


def _megatron_rope_scaling(args: argparse.Namespace, read: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE scaling of Megatron args: MindSpeed-LLM's rope_scaling_type with its keys, or Megatron-LM's
    use_rope_scaling (llama3's with megatron-core's fixed bounds: 1, 4 over 8192 positions). Without either,
    Megatron-LM's rope_scaling_factor (8 by default) means nothing, so none of the keys is kept."""
    rope_type = read.get("rope_scaling_type")
    if rope_type is not None:
        if rope_type == "llama3" and read.get("rope_scaling_original_max_position_embeddings") is None:
            raise ConfigError("checkpoint args set llama3 RoPE scaling without its original context "
                              "(original_max_position_embeddings); pass --hf-config-dir with the model's HF config.")
        if not (read.get("rope_scaling_mscale") and read.get("rope_scaling_mscale_all_dim")):
            # MindSpeed-LLM stores its defaults, 1 and 0, which YaRN's attention factor reads only as a pair
            return {"rope_scaling_mscale": None, "rope_scaling_mscale_all_dim": None}
        return {}
    defaults = {name: LINKS[name].megatron_default for name in _HF_ROPE}
    if getattr(args, "use_rope_scaling", False):
        return {**defaults, "rope_scaling_type": "llama3", "rope_scaling_original_max_position_embeddings": 8192,
                "rope_scaling_factor": float(getattr(args, "rope_scaling_factor", 8.0))}
    return defaults


def vocab_from_megatron(args: argparse.Namespace, tp: int, hf_vocab: int | None) -> tuple[int, int]:
    """(padded_vocab_size, make_vocab_size_divisible_by) of a ModelArch for Megatron args.

    Megatron stores the padded row count; the unpadded vocabulary is the HF config's if given,
    else args.vocab_size where set. Those two are kept, so re-sharding pads again as Megatron
    would; a row count they cannot reproduce (a custom --padded-vocab-size) is kept as is.
    """
    rows = int(args.padded_vocab_size)
    multiple = int(getattr(args, "make_vocab_size_divisible_by", None) or 1)
    vocab = hf_vocab or getattr(args, "vocab_size", None)
    if isinstance(vocab, int) and 0 < vocab <= rows:
        if ModelArch.padded_rows(vocab, multiple, tp) == rows:
            return vocab, multiple
    return rows, 1


def arch_differences(stored: ModelArch, expected: ModelArch, tp: int, structural_only: bool = False,
                     label: str = "model") -> list[str]:
    """'field=stored (label: expected)' for every field whose effective value differs.

    Vocabulary rows are compared as padded for `tp`; the unpadded size, the padding multiple
    and softmax precision are bookkeeping of a run, not of its weights, and are not compared.
    """
    diffs = []
    for name, link in LINKS.items():
        if name in ("padded_vocab_size", "make_vocab_size_divisible_by", "attention_softmax_in_fp32"):
            continue
        if structural_only and not link.structural:
            continue
        a, b = effective(stored, name), effective(expected, name)
        if a != b:
            diffs.append(f"{name}={a!r} ({label}: {b!r})")
    if not structural_only and stored.vocab_size_for(tp) != expected.vocab_size_for(tp):
        diffs.append(f"vocabulary rows={stored.vocab_size_for(tp)} ({label}: {expected.vocab_size_for(tp)})")
    return diffs
