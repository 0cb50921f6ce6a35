"""THE mapping between HF transformers checkpoints and megatron-core GPT weights.

Both directions live here and nowhere else: the checkpoint converter and the rollout
weight resharder call these functions, and the exactness tests check them. Tensors are
only reordered and concatenated, never computed on, so a round trip is bit-exact.

Megatron layout (local spec, TP=1 names):
- `linear_qkv` fuses Q, K, V per query group: for each of the `g` groups, that group's
  `heads/g` query heads, then its key head, then its value head (rows of `head_dim`).
  Tensor parallelism then cuts whole groups, which is why TP must divide `g`.
- `linear_fc1` stacks SwiGLU's gate projection over its up projection.
- An MoE layer's router is HF's `mlp.gate`; routed expert e (`mlp.experts.<e>.*`) is Megatron's
  `mlp.experts.local_experts.<e>.*` (numbered over all experts here, per EP rank in a stage), its gate and up
  projections stacked like the dense MLP's; Qwen2-MoE's shared expert and its sigmoid gate are
  `mlp.shared_experts.*` and `mlp.shared_experts.gate_weight`.
- A reward model (HF `*ForSequenceClassification`, converted with `--orm`) has no LM head; its
  `score` head [num_labels, hidden] is Megatron's `rm_head`, replicated on every TP rank of the
  last stage (one output cannot be cut).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import torch

from mindrl.config import ConfigError, ModelArch
from mindrl.config.vision import VisionArch
from mindrl.models import arch_fields as af
from mindrl.models import sharding
from mindrl.models.vision import vision_param_shapes

# HF model_type of each --model-type-hf name the converter accepts (qwen25: MindSpeed-LLM's name).
HF_MODEL_TYPES = {"qwen2": "qwen2", "qwen25": "qwen2", "llama2": "llama", "llama3": "llama", "qwen3": "qwen3",
                  "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe", "qwen2_5_vl": "qwen2_5_vl",
                  "qwen25_vl": "qwen2_5_vl", "glm4_moe": "glm4_moe", "glm45": "glm4_moe",
                  "deepseek_v3": "deepseek_v3", "deepseekv3": "deepseek_v3"}
HF_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "glm4_moe": "Glm4MoeForCausalLM",
                    "deepseek_v3": "DeepseekV3ForCausalLM"}
_CAUSAL_LM, _SEQ_CLS = "ForCausalLM", "ForSequenceClassification"
# The optional tensors each HF family has: (QKV-only biases, QK layer norms, experts, a gated shared expert,
# a vision tower, DeepSeek-style routing: the sigmoid router's expert bias, un-gated shared experts, dense layers
# first; multi-latent attention, whose QK layer norms are its latents'). None: as the family's config says (GLM-4.5's
# attention_bias, use_qk_norm).
_FAMILY_TENSORS = {"qwen2": (True, False, False, False, False, False, False),
                   "llama": (False, False, False, False, False, False, False),
                   "qwen3": (False, True, False, False, False, False, False),
                   "qwen2_moe": (True, False, True, True, False, False, False),
                   "qwen3_moe": (False, True, True, False, False, False, False),
                   "qwen2_5_vl": (True, False, False, False, True, False, False),
                   "glm4_moe": (None, None, True, False, False, True, False),
                   "deepseek_v3": (False, True, True, False, False, True, True)}
#: the families' config keys of the tensors they may or may not have
_FAMILY_SWITCHES = {"glm4_moe": ("attention_bias", "use_qk_norm")}
#: tensors kept in fp32 whatever the model's dtype: the expert bias picks experts by differences far below bf16's
#: resolution (megatron-core and HF both keep it so)
FP32_TENSORS = ("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias")


def tensor_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype tensor `name` (HF's or Megatron's) is kept in by a model or checkpoint of `dtype`."""
    return torch.float32 if name.endswith(FP32_TENSORS) else dtype

EMBEDDING = ("model.embed_tokens.weight", "embedding.word_embeddings.weight")
FINAL_NORM = ("model.norm.weight", "decoder.final_layernorm.weight")
OUTPUT = ("lm_head.weight", "output_layer.weight")
SCORE = ("score.weight", "rm_head.weight")
#: the vision tower's prefix: HF's (as Qwen2.5-VL checkpoints store it), Megatron's
VISION = ("visual.", sharding.VISION_PREFIX)

# One-to-one renames inside a decoder layer: HF suffix → Megatron suffix.
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}


#: multi-latent attention's tensors (DeepSeek-V3): one-to-one renames, HF suffix → Megatron suffix
_MLA_RENAMES = {
    "self_attn.q_proj.weight": "self_attention.linear_q_proj.weight",
    "self_attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
    "self_attn.q_a_layernorm.weight": "self_attention.q_layernorm.weight",
    "self_attn.q_b_proj.weight": "self_attention.linear_q_up_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "self_attention.linear_kv_down_proj.weight",
    "self_attn.kv_a_layernorm.weight": "self_attention.kv_layernorm.weight",
    "self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
}


def hf_layer_prefix(index: int) -> str:
    return f"model.layers.{index}."


def mcore_layer_prefix(index: int) -> str:
    return f"decoder.layers.{index}."


def _hf_shared_prefix(arch: ModelArch) -> str:
    """Qwen2-MoE's gated shared expert is `shared_expert`, DeepSeek's un-gated ones `shared_experts`."""
    return "mlp.shared_expert." if arch.moe_shared_expert_gate else "mlp.shared_experts."


def _hf_mlp_names(arch: ModelArch) -> list[str]:
    if not arch.is_moe:
        return ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    names = ["mlp.gate.weight"]
    if arch.moe_router_enable_expert_bias:
        names.append("mlp.gate.e_score_correction_bias")
    for e in range(arch.num_experts):
        names += [f"mlp.experts.{e}.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")]
    if arch.moe_shared_expert_intermediate_size:
        names += [f"{_hf_shared_prefix(arch)}{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")]
        if arch.moe_shared_expert_gate:
            names.append("mlp.shared_expert_gate.weight")
    return names


def hf_layer_names(arch: ModelArch) -> list[str]:
    """HF tensor names inside one decoder layer of `arch` (without the layer prefix); of an MoE model with dense
    layers first, pass the layer's own architecture (`arch.layer_arch(index)`)."""
    if arch.multi_latent_attention:
        query = (["self_attn.q_proj.weight"] if arch.q_lora_rank is None else
                 ["self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight"])
        return ["input_layernorm.weight", *query, "self_attn.kv_a_proj_with_mqa.weight",
                "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight",
                "post_attention_layernorm.weight", *_hf_mlp_names(arch)]
    names = ["input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
             "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
             *_hf_mlp_names(arch)]
    if arch.add_qkv_bias:
        names += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    if arch.qk_layernorm:
        names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    return names


def hf_param_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of `arch` with its shape, in checkpoint order."""
    shapes = {EMBEDDING[0]: (arch.padded_vocab_size, arch.hidden_size)}
    for i in range(arch.num_layers):
        layer = _layer_shapes(arch.layer_arch(i))
        shapes.update({hf_layer_prefix(i) + n: layer[n] for n in hf_layer_names(arch.layer_arch(i))})
    shapes[FINAL_NORM[0]] = (arch.hidden_size,)
    if arch.has_output_layer:
        shapes[OUTPUT[0]] = (arch.padded_vocab_size, arch.hidden_size)
    if arch.has_score_head:
        shapes[SCORE[0]] = (arch.num_labels, arch.hidden_size)
    if arch.vision is not None:
        shapes.update({VISION[0] + name: shape
                       for name, shape in vision_param_shapes(arch.vision, arch.hidden_size).items()})
    return shapes


def hf_layer_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a decoder layer of `arch` might hold, by name inside the layer (hf_layer_names picks
    from them)."""
    return dict(_layer_shapes(arch))


@lru_cache(maxsize=32)
def _layer_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    h, hd, ffn = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    q_rows, kv_rows = arch.num_attention_heads * hd, arch.query_groups * hd
    layer = {
        "input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q_rows, h),
        "self_attn.k_proj.weight": (kv_rows, h), "self_attn.v_proj.weight": (kv_rows, h),
        "self_attn.o_proj.weight": (h, arch.num_attention_heads * arch.value_head_dim),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (ffn, h), "mlp.up_proj.weight": (ffn, h), "mlp.down_proj.weight": (h, ffn),
        "self_attn.q_proj.bias": (q_rows,), "self_attn.k_proj.bias": (kv_rows,),
        "self_attn.v_proj.bias": (kv_rows,), "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
    }
    if arch.multi_latent_attention:
        layer.update(_mla_shapes(arch))
    if arch.is_moe:
        expert, shared = arch.expert_ffn_hidden_size, arch.moe_shared_expert_intermediate_size or 0
        layer["mlp.gate.weight"] = (arch.num_experts, h)
        layer["mlp.gate.e_score_correction_bias"] = (arch.num_experts,)
        for e in range(arch.num_experts):
            layer.update({f"mlp.experts.{e}.gate_proj.weight": (expert, h), f"mlp.experts.{e}.up_proj.weight":
                          (expert, h), f"mlp.experts.{e}.down_proj.weight": (h, expert)})
        shared_prefix = _hf_shared_prefix(arch)
        layer.update({f"{shared_prefix}gate_proj.weight": (shared, h), f"{shared_prefix}up_proj.weight": (shared, h),
                      f"{shared_prefix}down_proj.weight": (h, shared), "mlp.shared_expert_gate.weight": (1, h)})
    return layer


def _mla_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Multi-latent attention's tensors under HF's names: Megatron's (sharding), renamed one to one."""
    megatron = sharding.mla_param_shapes(arch)
    return {hf: megatron[mg] for hf, mg in _MLA_RENAMES.items() if mg in megatron}


def vision_names(arch: ModelArch) -> list[tuple[str, str]]:
    """(HF name, Megatron name) of every vision-tower tensor: a rename, the tensor as stored."""
    if arch.vision is None:
        return []
    return [(VISION[0] + name, VISION[1] + name) for name in vision_param_shapes(arch.vision, arch.hidden_size)]


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    groups, per_group = arch.query_groups, arch.num_attention_heads // arch.query_groups
    hd = arch.head_dim
    tail = q.shape[1:]
    q = q.reshape(groups, per_group * hd, *tail)
    k = k.reshape(groups, hd, *tail)
    v = v.reshape(groups, hd, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def _split_qkv(qkv: torch.Tensor, arch: ModelArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, per_group = arch.query_groups, arch.num_attention_heads // arch.query_groups
    hd = arch.head_dim
    tail = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per_group + 2) * hd, *tail)
    q, k, v = torch.split(grouped, [per_group * hd, hd, hd], dim=1)
    return (q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(),
            v.reshape(-1, *tail).contiguous())


def _mlp_pairs(arch: ModelArch) -> list[tuple[str, str]]:
    """(HF MLP prefix, Megatron MLP prefix) of every gated MLP in a layer: the dense one, or each routed expert
    and the shared expert."""
    if not arch.is_moe:
        return [("mlp.", "mlp.")]
    pairs = [(f"mlp.experts.{e}.", sharding.expert_prefix(e)) for e in range(arch.num_experts)]
    if arch.moe_shared_expert_intermediate_size:
        pairs.append((_hf_shared_prefix(arch), "mlp.shared_experts."))
    return pairs


def _renames(arch: ModelArch) -> dict[str, str]:
    """One-to-one renames inside a decoder layer of `arch`: HF suffix → Megatron suffix."""
    renames = dict(_LAYER_RENAMES)
    del renames["mlp.down_proj.weight"]
    if arch.multi_latent_attention:
        del renames["self_attn.q_norm.weight"], renames["self_attn.k_norm.weight"]
        renames.update(_MLA_RENAMES)
    renames.update({hf + "down_proj.weight": mg + "linear_fc2.weight" for hf, mg in _mlp_pairs(arch)})
    if arch.is_moe:
        renames["mlp.gate.weight"] = "mlp.router.weight"
        renames["mlp.gate.e_score_correction_bias"] = "mlp.router.expert_bias"
        renames["mlp.shared_expert_gate.weight"] = "mlp.shared_experts.gate_weight"
    return renames


def hf_to_mcore_layer(hf: Mapping[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """One decoder layer: HF suffix → tensor, to Megatron suffix → tensor (TP=1)."""
    renames = _renames(arch)
    out = {renames[name]: tensor for name, tensor in hf.items() if name in renames}
    if not arch.multi_latent_attention:
        out["self_attention.linear_qkv.weight"] = _fuse_qkv(
            hf["self_attn.q_proj.weight"], hf["self_attn.k_proj.weight"], hf["self_attn.v_proj.weight"], arch)
    if arch.add_qkv_bias:
        out["self_attention.linear_qkv.bias"] = _fuse_qkv(
            hf["self_attn.q_proj.bias"], hf["self_attn.k_proj.bias"], hf["self_attn.v_proj.bias"], arch)
    for hf_mlp, mg_mlp in _mlp_pairs(arch):
        out[mg_mlp + "linear_fc1.weight"] = torch.cat([hf[hf_mlp + "gate_proj.weight"],
                                                       hf[hf_mlp + "up_proj.weight"]], dim=0)
    return out


def mcore_to_hf_layer(mcore: Mapping[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """One decoder layer: Megatron suffix → tensor, to HF suffix → tensor (inverse of the above)."""
    back = {m: h for h, m in _renames(arch).items()}
    out = {back[name]: tensor for name, tensor in mcore.items() if name in back}
    if not arch.multi_latent_attention:
        q, k, v = _split_qkv(mcore["self_attention.linear_qkv.weight"], arch)
        out.update({"self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v})
    if arch.add_qkv_bias:
        q, k, v = _split_qkv(mcore["self_attention.linear_qkv.bias"], arch)
        out.update({"self_attn.q_proj.bias": q, "self_attn.k_proj.bias": k, "self_attn.v_proj.bias": v})
    for hf_mlp, mg_mlp in _mlp_pairs(arch):
        gate, up = mcore[mg_mlp + "linear_fc1.weight"].chunk(2, dim=0)
        out[hf_mlp + "gate_proj.weight"] = gate.contiguous()
        out[hf_mlp + "up_proj.weight"] = up.contiguous()
    return {name: out[name] for name in hf_layer_names(arch)}


def lora_to_hf_layer(adapters: Mapping[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """One decoder layer's whole LoRA tensors (Megatron suffix, `self_attention.linear_qkv.adapter.lora_B`) under
    PEFT's names on the HF model (`self_attn.q_proj.lora_B.weight`): a fused layer's A serves each of its parts
    (q = W_q·x + B_q·A·x), and its B is cut into them as its weight's rows are."""
    back = {m.removesuffix(".weight"): h.removesuffix(".weight") for h, m in _renames(arch).items()}
    fc1 = {mg + "linear_fc1": hf for hf, mg in _mlp_pairs(arch)}
    out = {}
    for name, tensor in adapters.items():
        module, _, half = name.rpartition(".adapter.")
        if module == "self_attention.linear_qkv":
            parts = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
            pieces = _split_qkv(tensor, arch) if half == "lora_B" else (tensor,) * 3
        elif module in fc1:
            parts = [fc1[module] + "gate_proj", fc1[module] + "up_proj"]
            pieces = tensor.chunk(2, dim=0) if half == "lora_B" else (tensor,) * 2
        else:
            parts, pieces = [back[module]], (tensor,)
        out.update({f"{part}.{half}.weight": piece.contiguous() for part, piece in zip(parts, pieces, strict=True)})
    return out


def hf_model_type(model_type_hf: str) -> str:
    """The HF model_type of a --model-type-hf name, or one sentence listing the names."""
    if model_type_hf not in HF_MODEL_TYPES:
        raise ConfigError(f"--model-type-hf {model_type_hf!r} is not supported; choose one of "
                          f"{', '.join(HF_MODEL_TYPES)}.")
    return HF_MODEL_TYPES[model_type_hf]


def _tensors_of(arch: ModelArch) -> tuple[bool, bool, bool, bool, bool, bool, bool]:
    """`arch`'s optional tensors, as _FAMILY_TENSORS lists them."""
    return (arch.add_qkv_bias, arch.qk_layernorm, arch.is_moe,
            bool(arch.moe_shared_expert_intermediate_size and arch.moe_shared_expert_gate), arch.vision is not None,
            arch.moe_router_enable_expert_bias, arch.multi_latent_attention)


def _holds(family: str, arch: ModelArch) -> bool:
    return all(f is None or f == a for f, a in zip(_FAMILY_TENSORS[family], _tensors_of(arch), strict=True))


def model_type_hf_of(arch: ModelArch) -> str:
    """The --model-type-hf whose HF family holds exactly `arch`'s optional tensors."""
    for name in ("qwen2", "llama3", "qwen3", "qwen2_moe", "qwen3_moe", "qwen2_5_vl", "glm4_moe", "deepseek_v3"):
        if _holds(HF_MODEL_TYPES[name], arch):
            return name
    raise ConfigError(f"model {arch.name} has a mix of QKV biases, QK layer norms, experts and routing that no HF "
                      f"family mindrl converts ({', '.join(HF_MODEL_TYPES)}) holds.")


def check_hf_can_hold(arch: ModelArch, model_type_hf: str) -> None:
    """Refuse an architecture whose weights the HF family could not load (before any work)."""
    family = hf_model_type(model_type_hf)
    qkv_bias, qk_norm, experts, gated_shared, vision, deepseek, mla = _FAMILY_TENSORS[family]
    if arch.add_qkv_bias and qkv_bias is False:
        raise ConfigError(f"HF {family} models have no QKV-only bias, so model {arch.name}'s QKV biases would "
                          f"not load back into HF transformers; a Qwen2-family model takes --model-type-hf qwen2.")
    problems = [what for what, bad in (
        ("multi-latent attention (only HF deepseek_v3 has it)", arch.multi_latent_attention and not mla),
        ("no multi-latent attention (HF deepseek_v3 has it)", mla and not arch.multi_latent_attention),
        ("no QKV biases (HF qwen2 has them)", qkv_bias and not arch.add_qkv_bias),
        ("QK layer norms (HF qwen3 and glm4_moe have them)", arch.qk_layernorm and qk_norm is False),
        ("no QK layer norms (HF qwen3 has them)", qk_norm and not arch.qk_layernorm),
        ("a sigmoid router with an expert bias (only HF glm4_moe and deepseek_v3 have one)",
         arch.moe_router_enable_expert_bias and not deepseek),
        ("a router without the expert bias (HF glm4_moe and deepseek_v3 have one)",
         deepseek and not arch.moe_router_enable_expert_bias),
        ("dense layers before the experts (only HF glm4_moe and deepseek_v3 have them)",
         bool(arch.first_k_dense_replace) and not deepseek),
        ("a gated shared expert (HF glm4_moe's are un-gated)", deepseek and arch.moe_shared_expert_gate),
        ("experts (only HF qwen2_moe / qwen3_moe / glm4_moe / deepseek_v3 have them)", arch.is_moe and not experts),
        ("no experts (HF qwen2_moe / qwen3_moe / glm4_moe / deepseek_v3 are mixtures of experts)",
         experts and not arch.is_moe),
        ("no gated shared expert (HF qwen2_moe has one)", experts and gated_shared and not _tensors_of(arch)[3]),
        ("a shared expert (HF qwen3_moe has none)", experts and not gated_shared and not deepseek and
         bool(arch.moe_shared_expert_intermediate_size)),
        ("no shared experts (HF glm4_moe has them)", deepseek and not arch.moe_shared_expert_intermediate_size),
        ("sigmoid routing, expert groups or a routing scale (only HF glm4_moe and deepseek_v3 have them)",
         not deepseek and (arch.moe_router_score_function != "softmax" or arch.moe_router_num_groups is not None
                           or arch.moe_router_topk_scaling_factor is not None)),
        ("partial rotary embeddings (only HF glm4_moe has them)",
         not (deepseek and not mla) and arch.rotary_percent != 1),
        ("a shared expert whose width is not a multiple of the experts' (HF glm4_moe counts them, n_shared_experts)",
         deepseek and bool((arch.moe_shared_expert_intermediate_size or 0) % (arch.expert_ffn_hidden_size or 1))),
        ("biases on every linear layer", not arch.disable_bias_linear),
        (f"{arch.normalization} instead of RMSNorm", arch.normalization != "RMSNorm"),
        ("an activation other than SwiGLU", not arch.swiglu),
        ("a vision tower (only HF qwen2_5_vl has one)", arch.vision is not None and not vision),
        ("no vision tower (HF qwen2_5_vl is a vision-language model)", vision and arch.vision is None),
    ) if bad]
    if problems:
        raise ConfigError(f"model {arch.name} has {problems[0]}, which HF {family} (--model-type-hf "
                          f"{model_type_hf}) cannot hold; pass the --model-type-hf of its family.")


def hf_num_labels(config: Mapping[str, Any]) -> int | None:
    """Outputs of the classification head of a *ForSequenceClassification config (HF saves them as
    id2label, and leaves out its default of two); None for a causal LM."""
    architectures = config.get("architectures") or []
    if not any(a.endswith(_SEQ_CLS) for a in architectures):
        return None
    labels = config.get("id2label")
    return len(labels) if labels else int(config.get("num_labels", 2))


def _sliding_window_layers(config: Mapping[str, Any]) -> list[int]:
    """Layers an HF config gives a sliding window: its layer_types where saved (transformers ≥ 5),
    else the layers from max_window_layers on when use_sliding_window is set, as Qwen2/Qwen3 read it."""
    layer_types = config.get("layer_types")
    if layer_types:
        return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    if not (config.get("use_sliding_window") and config.get("sliding_window")):
        return []
    return list(range(config.get("max_window_layers", 0), config["num_hidden_layers"]))


def arch_from_hf_config(config: Mapping[str, Any], model_type_hf: str, name: str = "hf_model",
                        add_qkv_bias: bool = False, orm: bool | None = False) -> ModelArch:
    """The ModelArch of an HF config.json, checked against the --model-type-hf the user named and
    against `orm` (a reward model expected: True; a causal LM: False; either: None)."""
    expected = hf_model_type(model_type_hf)
    num_labels = hf_num_labels(config)
    kinds = ", ".join(config.get("architectures") or ["none"])
    if orm and num_labels is None:
        raise ConfigError(f"--orm converts reward models (*{_SEQ_CLS} with a score head), but config.json names "
                          f"architectures {kinds}; drop --orm for a causal LM or point at the reward model.")
    if orm is False and num_labels is not None:
        raise ConfigError(f"config.json names architectures {kinds}, a reward/classification model with a score "
                          f"head; pass --orm to convert it.")
    if config.get("model_type") != expected:
        raise ConfigError(f"config.json has model_type {config.get('model_type')!r} but --model-type-hf "
                          f"{model_type_hf} expects {expected!r}; pass the matching --model-type-hf.")
    qkv_bias, qk_norm, experts, gated_shared, vision, deepseek, mla = _FAMILY_TENSORS[expected]
    full_config, config = config, (text_config_of(config) if vision else config)
    switches = _FAMILY_SWITCHES.get(expected)
    if switches:
        qkv_bias, qk_norm = (bool(config.get(key)) for key in switches)
    if experts and not deepseek:
        _check_every_layer_moe(config)
    if add_qkv_bias and not qkv_bias and switches:
        raise ConfigError(f"--add-qkv-bias does not fit config.json, whose {switches[0]} is false (no QKV biases); "
                          f"drop --add-qkv-bias.")
    if add_qkv_bias and not qkv_bias:
        raise ConfigError(f"--add-qkv-bias does not fit --model-type-hf {model_type_hf}: HF {expected} models "
                          f"have no QKV-only bias, so the weights would not load back into HF transformers; "
                          f"a Qwen2-family model takes --model-type-hf qwen2, which implies it.")
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"HF config has hidden_act {config['hidden_act']!r}; mindrl converts SwiGLU "
                          f"(silu) models only.")
    if (config.get("attention_bias") and not switches) or config.get("mlp_bias"):
        raise ConfigError("HF config sets attention_bias/mlp_bias (biases on every projection); "
                          "mindrl converts QKV-only biases (Qwen2) or no biases (Llama).")
    sliding = _sliding_window_layers(config)
    if sliding:
        raise ConfigError(f"HF config uses sliding-window attention (window {config.get('sliding_window')}) in "
                          f"{len(sliding)} of its {config['num_hidden_layers']} layers, which mindrl's models do "
                          f"not compute; use a model with full attention in every layer (use_sliding_window: "
                          f"false).")
    values = af.arch_values_from_hf(config)
    if gated_shared and values.get("moe_shared_expert_intermediate_size"):
        values["moe_shared_expert_gate"] = True
    if deepseek:
        values.update(_deepseek_routing_from_hf(config, values, _FAMILY_DEFAULTS[expected]))
    if mla:
        values.update(_mla_from_hf(config))
    if vision:
        values.update(position_embedding_type="mrope", mrope_section=_mrope_section(config),
                      vision=_vision_from_hf(full_config, values["hidden_size"]))
    return ModelArch(name=name, add_qkv_bias=qkv_bias, qk_layernorm=qk_norm, num_labels=num_labels, **values)


#: the values transformers gives a family's keys where its config.json leaves them out
_FAMILY_DEFAULTS = {"glm4_moe": {"first_k_dense_replace": 1, "n_shared_experts": 1, "partial_rotary_factor": 0.5,
                                 "norm_topk_prob": True},
                    "deepseek_v3": {"first_k_dense_replace": 3, "n_shared_experts": 1, "norm_topk_prob": True,
                                    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5}}


def _mla_from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    """Multi-latent attention from a deepseek_v3 config: its head_dim is the rotated part's width (read as
    qk_rope_head_dim), and its rotated dimensions come in interleaved pairs, which mindrl's module reads
    (models/mla.py); a config that says otherwise is refused."""
    if config.get("rope_interleave", True) is not True:
        raise ConfigError("HF config sets rope_interleave: false (rotated dimensions in halves), but mindrl's "
                          "multi-latent attention reads DeepSeek-V3's interleaved pairs; use a checkpoint saved with "
                          "rope_interleave: true.")
    sizes = {field: config.get(key, default) for field, key, default in _MLA_HF_DEFAULTS}
    # DeepSeek's own configs say which balancing loss it was trained with (seq_aux); transformers reads none
    balancing = {"moe_router_load_balancing_type": "seq_aux_loss"} if config.get("seq_aux") else {}
    return {"multi_latent_attention": True, "kv_channels": None, **sizes, **balancing}


#: multi-latent attention's ModelArch fields, their deepseek_v3 config keys and transformers' values where a config
#: leaves a key out (DeepSeek-V2-Lite writes q_lora_rank: null: no query latent)
_MLA_HF_DEFAULTS = (("q_lora_rank", "q_lora_rank", 1536), ("kv_lora_rank", "kv_lora_rank", 512),
                    ("qk_head_dim", "qk_nope_head_dim", 128), ("qk_pos_emb_head_dim", "qk_rope_head_dim", 64),
                    ("v_head_dim", "v_head_dim", 128))


def _deepseek_routing_from_hf(config: Mapping[str, Any], values: Mapping[str, Any],
                              defaults: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSeek-style routing and GLM-4.5's partial rotary from an HF config: sigmoid scores with the expert bias,
    expert groups (one group: none), the routing scale (1: none), `n_shared_experts` expert-sized shared experts."""
    config = {**defaults, **{key: value for key, value in config.items() if value is not None}}
    groups, scale = config.get("n_group") or 1, config.get("routed_scaling_factor", 1.0)
    shared = config.get("n_shared_experts") or 0
    rotary = config.get("partial_rotary_factor")
    if "partial_rotary_factor" in (config.get("rope_parameters") or {}):
        rotary = config["rope_parameters"]["partial_rotary_factor"]
    return {"first_k_dense_replace": config["first_k_dense_replace"], "moe_router_score_function": "sigmoid",
            "norm_topk_prob": bool(config["norm_topk_prob"]),
            "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": groups if groups > 1 else None,
            "moe_router_group_topk": config.get("topk_group") if groups > 1 else None,
            "moe_router_topk_scaling_factor": float(scale) if scale != 1 else None,
            "moe_shared_expert_intermediate_size": shared * values["moe_ffn_hidden_size"] if shared else None,
            "rotary_percent": float(rotary) if rotary is not None else 1.0}


def _deepseek_routing_to_hf(arch: ModelArch) -> dict[str, Any]:
    """The HF config keys of _deepseek_routing_from_hf's fields."""
    return {"n_routed_experts": arch.num_experts, "first_k_dense_replace": arch.first_k_dense_replace,
            "n_group": arch.moe_router_num_groups or 1, "topk_group": arch.moe_router_group_topk or 1,
            "routed_scaling_factor": arch.moe_router_topk_scaling_factor or 1.0,
            "n_shared_experts": arch.moe_shared_expert_intermediate_size // arch.expert_ffn_hidden_size,
            # vLLM's DeepSeek reads the routing from the keys DeepSeek's own configs carry (transformers assumes it)
            **({"head_dim": arch.qk_pos_emb_head_dim, "rope_interleave": True, "scoring_func": "sigmoid",
                "topk_method": "noaux_tc", "seq_aux": arch.moe_router_load_balancing_type == "seq_aux_loss"}
               if arch.multi_latent_attention else
               {"partial_rotary_factor": arch.rotary_percent, "use_qk_norm": arch.qk_layernorm}),
            "attention_bias": arch.add_qkv_bias, MTP_KEY: 0}


#: an HF config's count of multi-token-prediction layers (DeepSeek-V3, GLM-4.5), stored after the decoder layers
MTP_KEY = "num_nextn_predict_layers"
#: where conversion keeps them, in the checkpoint's HF side files: carried through as stored, not trained
MTP_FILE = "mtp_layers.safetensors"


def mtp_names(names: set[str], arch: ModelArch, config: Mapping[str, Any]) -> list[str]:
    """The tensors of an HF checkpoint's multi-token-prediction layers: those of layers num_layers …
    num_layers + num_nextn_predict_layers − 1 (transformers' own saves drop them, so there may be none)."""
    layers = range(arch.num_layers, arch.num_layers + int(config.get(MTP_KEY) or 0))
    prefixes = tuple(hf_layer_prefix(i) for i in layers)
    return sorted(name for name in names if prefixes and name.startswith(prefixes))


def text_config_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config's language-model keys in one mapping: a vision-language config's are at the top level in Qwen's
    published configs and under text_config as transformers >= 5 saves them."""
    top = {key: value for key, value in config.items() if key not in ("text_config", "vision_config")}
    return {**top, **(config.get("text_config") or {})}


def _mrope_section(text: Mapping[str, Any]) -> tuple[int, ...]:
    for key in ("rope_parameters", "rope_scaling"):
        section = (text.get(key) or {}).get("mrope_section")
        if section:
            return tuple(section)
    raise ConfigError("the vision-language config.json has no mrope_section (in rope_parameters or rope_scaling); "
                      "it is not a Qwen2.5-VL config.")


# VisionArch field → the HF vision_config key, where they differ
_VISION_HF_KEYS = {"in_channels": ("in_channels", "in_chans")}


def _vision_from_hf(config: Mapping[str, Any], text_hidden: int) -> VisionArch:
    vision = config.get("vision_config") or {}
    if vision.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"vision_config has hidden_act {vision['hidden_act']!r}; mindrl builds Qwen2.5-VL's "
                          f"SwiGLU (silu) vision blocks only.")
    if vision.get("out_hidden_size", text_hidden) != text_hidden:
        raise ConfigError(f"vision_config.out_hidden_size={vision['out_hidden_size']} differs from the language "
                          f"model's hidden_size={text_hidden}; the config.json is not one model's.")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(VisionArch):
        if f.name == "rotary_base":
            values[f.name] = float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0))
            continue
        where = config if f.name.endswith("token_id") else vision
        key = next((k for k in _VISION_HF_KEYS.get(f.name, (f.name,)) if k in where), None)
        if key is not None:
            values[f.name] = where[key]
        elif f.default is dataclasses.MISSING:
            raise ConfigError(f"the vision-language config.json lacks {f.name}; it is not a Qwen2.5-VL config.")
    return VisionArch(**values)


def _vision_to_hf(arch: ModelArch) -> dict[str, Any]:
    """The vision_config and the vision token ids of a config.json, as transformers >= 5 writes them."""
    vision = dataclasses.asdict(arch.vision)
    ids = {key: vision.pop(key) for key in list(vision) if key.endswith("token_id")}
    theta = vision.pop("rotary_base")
    return {"vision_config": {"model_type": "qwen2_5_vl_vision", "hidden_act": "silu", **vision,
                              "fullatt_block_indexes": list(arch.vision.fullatt_block_indexes),
                              "out_hidden_size": arch.hidden_size,
                              "rope_parameters": {"rope_type": "axial", "rope_theta": theta}}, **ids}


def _check_every_layer_moe(config: Mapping[str, Any]) -> None:
    """A Qwen-MoE config's dense layers may sit anywhere (mindrl builds them first only, as GLM-4.5 and DeepSeek
    place them)."""
    step, dense = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise ConfigError(f"HF config keeps some layers dense (decoder_sparse_step={step}, mlp_only_layers="
                          f"{dense}), which mindrl builds only as the first layers (GLM-4.5's first_k_dense_replace); "
                          f"use a model with experts in every layer.")


def hf_config_from_arch(arch: ModelArch, model_type_hf: str, dtype: torch.dtype) -> dict[str, Any]:
    """A config.json for `arch` when the original HF config is not at hand."""
    check_hf_can_hold(arch, model_type_hf)
    model_type = hf_model_type(model_type_hf)
    architecture = HF_ARCHITECTURES[model_type]
    labels = {}
    if arch.has_score_head:
        architecture = architecture.replace(_CAUSAL_LM, _SEQ_CLS)
        labels = {"id2label": {str(i): f"LABEL_{i}" for i in range(arch.num_labels)},
                  "label2id": {f"LABEL_{i}": i for i in range(arch.num_labels)}}
    text = {
        "hidden_act": "silu",
        **af.hf_config_values(arch),
        **({"decoder_sparse_step": 1, "mlp_only_layers": []} if arch.is_moe else {}),
        "attention_bias": False,
    }
    if _FAMILY_TENSORS[model_type][5]:
        for key in ("num_experts", "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size"):
            text.pop(key, None)
        text.update(_deepseek_routing_to_hf(arch))
    head = {"architectures": [architecture], "model_type": model_type, **labels}
    dtype_name = str(dtype).removeprefix("torch.")
    if arch.vision is None:
        return {**head, **text, "torch_dtype": dtype_name}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": text.pop("rope_theta"),
                               "mrope_section": list(arch.mrope_section)}
    return {**head, "text_config": {"model_type": "qwen2_5_vl_text", **text}, **_vision_to_hf(arch),
            "tie_word_embeddings": text["tie_word_embeddings"], "dtype": dtype_name}
