"""Model architecture section, in the key names of MindSpeed-RL's model yamls.

A model yaml (configs/model/<name>.yaml) holds one top-level key equal to its file
stem, so a MindSpeed-RL user's file loads unchanged. Keys that would silently do
nothing here are rejected rather than ignored: a user who sets `moe_layer_freq: 2`
must learn that experts every other layer are not built, not discover it in the
loss curve.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mindrl.config.errors import ConfigError
from mindrl.config.paths import MODEL_CONFIGS_DIR
from mindrl.config.values import check_types
from mindrl.config.vision import VisionArch

# Keys MindSpeed-RL model yamls carry that only choose kernels or legacy code paths. They
# change no numbers, so they are accepted and have no effect.
_NO_EFFECT_KEYS = frozenset({
    "use_mcore_models",
    "group_query_attention",
    "no_gradient_accumulation_fusion",
    "use_rotary_position_embeddings",
    # Experts always run as megatron-core's SequentialMLP (the local spec has no grouped-GEMM kernel
    # without Transformer Engine); the products, and so the numbers, are the same.
    "moe_grouped_gemm",
    "moe_permutation_async_comm",
    "use_fused_moe_token_permute_and_unpermute",
})

#: the routers megatron-core builds for the architectures mindrl converts (Qwen2-MoE, Qwen3-MoE)
MOE_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
#: token dispatchers that run on every platform (flex needs DeepEP kernels); MindSpeed's alltoall_seq
#: is megatron-core's alltoall today
MOE_DISPATCHERS = ("alltoall", "allgather", "alltoall_seq")
MOE_ROUTER_DTYPES = ("fp32", "fp64")
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")

_UNSUPPORTED_PREFIXES = {
    "moe_": "a mixture-of-experts option beyond Qwen-MoE and DeepSeek-style routing",
}

#: RoPE scalings mindrl builds (HF's rope_type names; mindrl/models/rope.py), each with the keys it reads
ROPE_SCALINGS = {
    "llama3": ("rope_scaling_factor", "rope_scaling_original_max_position_embeddings", "low_freq_factor",
               "high_freq_factor"),
    "yarn": ("rope_scaling_factor", "rope_scaling_original_max_position_embeddings", "beta_fast", "beta_slow",
             "rope_scaling_mscale", "rope_scaling_mscale_all_dim"),
    "linear": ("rope_scaling_factor",),
    "dynamic": ("rope_scaling_factor",),
}
#: other names of a key in MindSpeed-LLM's model files (its llama3 scaling reads original_max_position_embeddings)
_ALIASES = {"original_max_position_embeddings": "rope_scaling_original_max_position_embeddings"}

#: MindSpeed-LLM's layer specs (`spec: [module, function]`) that describe a layer mindrl builds from the model's own
#: keys, each with the key that must say so: the Qwen3 spec is the GPT layer with Qwen3's per-head q/k RMSNorm
LAYER_SPECS = {("mindspeed_llm.tasks.models.spec.qwen3_spec", "layer_spec"): "qk_layernorm",
               ("mindspeed_llm.tasks.models.spec.deepseek_spec", "layer_spec"): "multi_latent_attention"}
#: the sizes of multi-latent attention (q_lora_rank is optional: without it queries are projected directly)
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


@dataclass(frozen=True)
class ModelArch:
    """A decoder-only transformer: dense (Qwen2/2.5, Qwen3, Llama-2/3 shapes) or, with `num_experts`, a
    mixture of experts in every layer after the first `first_k_dense_replace` (Qwen2-MoE, Qwen3-MoE, GLM-4.5)."""

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    padded_vocab_size: int
    max_position_embeddings: int
    num_query_groups: int | None = None
    kv_channels: int | None = None
    make_vocab_size_divisible_by: int = 1
    untie_embeddings_and_output_weights: bool = False
    add_qkv_bias: bool = False
    disable_bias_linear: bool = True
    attention_bias: bool = False
    qk_layernorm: bool = False
    normalization: str = "RMSNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = True
    position_embedding_type: str = "rope"
    rotary_base: float = 10000.0
    #: the share of each head's dimensions RoPE rotates, the first ones (GLM-4.5: 0.5); the rest carry no position
    rotary_percent: float = 1.0
    attention_softmax_in_fp32: bool = True
    #: outputs of a sequence-classification head in place of the LM head (a reward model has 1); null: a causal LM
    num_labels: int | None = None
    #: routed experts of every MoE layer's MLP; null: a dense model
    num_experts: int | None = None
    moe_router_topk: int = 2
    #: each expert's inner width; null: ffn_hidden_size
    moe_ffn_hidden_size: int | None = None
    #: Qwen2-MoE's always-on shared expert (its inner width); null: none
    moe_shared_expert_intermediate_size: int | None = None
    #: the shared expert's output scaled by sigmoid(gate · x) (Qwen2-MoE)
    moe_shared_expert_gate: bool = False
    #: top-k routing weights renormalised to sum to one (Qwen3-MoE) rather than taken from the softmax over
    #: all experts (Qwen2-MoE)
    norm_topk_prob: bool = False
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_token_dispatcher_type: str = "alltoall"
    #: precision of the router's logits and softmax; null: the model's
    moe_router_dtype: str | None = None
    #: the first k layers keep a dense MLP (ffn_hidden_size), the others are mixtures of experts (DeepSeek-V3: 3,
    #: GLM-4.5: 3); MindSpeed-LLM's `moe_layer_freq: 1` and `n_shared_experts` go with it
    first_k_dense_replace: int = 0
    #: routing scores: softmax over the experts (Qwen) or each expert's sigmoid (DeepSeek-V3, GLM-4.5), whose top-k
    #: are renormalised to sum to one
    moe_router_score_function: str = "softmax"
    #: sigmoid routing picks experts by score + a per-expert bias (DeepSeek-V3's aux-loss-free balancing) and
    #: weighs them by the score alone. The bias is a weight of the checkpoint, frozen in training (docs/moe.md)
    moe_router_enable_expert_bias: bool = False
    #: group-limited routing: the experts in moe_router_num_groups equal groups, each token choosing among the
    #: moe_router_group_topk groups whose top two scores sum highest; null: no groups
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    #: the chosen experts' routing weights multiplied by this (DeepSeek-V3: 2.5); null: 1
    moe_router_topk_scaling_factor: float | None = None
    #: with position_embedding_type mrope: the rotary frequencies (head_dim / 2 of them) given to the temporal,
    #: height and width position, in that order (Qwen2.5-VL's [16, 24, 24])
    mrope_section: tuple[int, ...] | None = None
    #: the vision tower of a vision-language model (a mapping in the yaml); null: a text-only model
    vision: VisionArch | None = None
    #: RoPE scaling, in MindSpeed-LLM's keys (HF's rope_scaling / rope_parameters): llama3, yarn, linear or dynamic
    #: (within max_position_embeddings, where it is plain RoPE); null: none. docs/configuration.md#rope-scaling
    rope_scaling_type: str | None = None
    rope_scaling_factor: float = 1.0
    #: the context the model was pre-trained at (llama3, yarn); null: max_position_embeddings
    rope_scaling_original_max_position_embeddings: int | None = None
    #: llama3: wavelengths beyond original / low_freq_factor are divided by the factor, below original /
    #: high_freq_factor kept, between them blended
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    #: yarn: the correction range between beta_fast and beta_slow rotations over the original context
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    #: yarn: the attention factor is mscale(factor, rope_scaling_mscale) / mscale(factor,
    #: rope_scaling_mscale_all_dim) where both are set (DeepSeek-V3), else 0.1 · ln(factor) + 1
    rope_scaling_mscale: float | None = None
    rope_scaling_mscale_all_dim: float | None = None
    #: DeepSeek-V3's multi-latent attention: keys and values come from one kv_lora_rank-wide latent (and queries
    #: from a q_lora_rank-wide one, if set), each head's query and key are qk_head_dim dimensions without position
    #: and qk_pos_emb_head_dim rotated ones (the key's shared by all heads), its value v_head_dim wide;
    #: qk_layernorm: true are the latents' RMSNorms. docs/configuration.md#multi-latent-attention
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_head_dim: int | None = None
    qk_pos_emb_head_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.vision, Mapping):  # as the yaml and a checkpoint's args hold it
            object.__setattr__(self, "vision", VisionArch.from_dict(self.name, self.vision))
        if self.vision is not None and not isinstance(self.vision, VisionArch):
            raise ConfigError(f"model {self.name}: vision must be a mapping of the vision tower's keys, got "
                              f"{self.vision!r}.")
        if self.mrope_section is not None:
            object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        check_types(f"model {self.name}", self)
        for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "padded_vocab_size", "max_position_embeddings"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model {self.name}: {key} must be a positive integer, got {value!r}.")
        if self.num_attention_heads % self.query_groups:
            raise ConfigError(
                f"model {self.name}: num_query_groups={self.query_groups} must divide "
                f"num_attention_heads={self.num_attention_heads}.")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads and \
                not self.multi_latent_attention:
            raise ConfigError(
                f"model {self.name}: hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; set kv_channels to the head size.")
        if self.num_labels is not None and (not isinstance(self.num_labels, int) or self.num_labels < 1):
            raise ConfigError(f"model {self.name}: num_labels must be a positive integer (1 for a reward model) or "
                              f"null for a causal LM, got {self.num_labels!r}.")
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ConfigError(f"model {self.name}: normalization must be RMSNorm or LayerNorm, "
                              f"got {self.normalization!r}.")
        self._check_mla()
        self._check_positions()
        self._check_moe()

    def _check_mla(self) -> None:
        where = f"model {self.name}"
        if not self.multi_latent_attention:
            given = [key for key in MLA_FIELDS if getattr(self, key) is not None]
            if given:
                raise ConfigError(f"{where}: {given[0]} sizes multi-latent attention, which is off; set "
                                  f"multi_latent_attention: true or remove it.")
            return
        for key in MLA_FIELDS:
            value = getattr(self, key)
            if (value is not None or key != "q_lora_rank") and not (isinstance(value, int) and value > 0):
                raise ConfigError(f"{where}: multi-latent attention needs {key} as a positive integer, got "
                                  f"{value!r}.")
        if self.qk_pos_emb_head_dim % 2:
            raise ConfigError(f"{where}: qk_pos_emb_head_dim={self.qk_pos_emb_head_dim} must be even (RoPE rotates "
                              f"pairs of dimensions).")
        clashes = [what for what, bad in (
            ("num_query_groups (every head has its own key and value)",
             self.num_query_groups not in (None, self.num_attention_heads)),
            ("kv_channels (the head sizes are qk_head_dim, qk_pos_emb_head_dim and v_head_dim)",
             self.kv_channels is not None),
            ("add_qkv_bias", self.add_qkv_bias), ("rotary_percent", self.rotary_percent != 1),
            ("disable_bias_linear: false (DeepSeek's projections have no biases)", not self.disable_bias_linear),
            ("normalization LayerNorm (its latents' norms are RMSNorms)", self.normalization != "RMSNorm"),
            ("qk_layernorm: false (the latents' norms are DeepSeek-V3's; mindrl builds them)", not self.qk_layernorm),
            ("position_embedding_type mrope", self.position_embedding_type != "rope"),
            ("YaRN with rope_scaling_mscale other than rope_scaling_mscale_all_dim (its attention factor would scale "
             "the rotated dimensions alone; DeepSeek's configs set both alike)",
             self.rope_scaling_type == "yarn" and (self.rope_scaling_mscale is None
                                                   or self.rope_scaling_mscale != self.rope_scaling_mscale_all_dim)),
        ) if bad]
        if clashes:
            raise ConfigError(f"{where}: multi-latent attention does not take {clashes[0]}; remove it.")

    def _check_positions(self) -> None:
        where = f"model {self.name}"
        if self.position_embedding_type not in ("rope", "mrope"):
            raise ConfigError(f"{where}: position_embedding_type must be rope (or mrope for a vision-language "
                              f"model), got {self.position_embedding_type!r}.")
        mrope = self.position_embedding_type == "mrope"
        if mrope != (self.mrope_section is not None):
            raise ConfigError(f"{where}: mrope_section goes with position_embedding_type: mrope and only with it; "
                              f"set both or neither.")
        if mrope and (not all(isinstance(n, int) and n > 0 for n in self.mrope_section)
                      or len(self.mrope_section) != 3 or sum(self.mrope_section) * 2 != self.head_dim):
            raise ConfigError(f"{where}: mrope_section={list(self.mrope_section)} must be three positive counts "
                              f"summing to head_dim / 2 = {self.head_dim // 2}.")
        if self.vision is not None and not mrope:
            raise ConfigError(f"{where}: a vision tower needs position_embedding_type: mrope with mrope_section "
                              f"(Qwen2.5-VL's language model rotates by image rows and columns).")
        if self.vision is not None and (self.is_moe or self.has_score_head):
            raise ConfigError(f"{where}: a vision tower on a mixture of experts or a reward model is not built; "
                              f"drop vision: or use a dense causal LM.")
        rotated = self.head_dim * self.rotary_percent
        if not 0 < self.rotary_percent <= 1 or (self.rotary_percent != 1 and (rotated != int(rotated) or rotated % 2)):
            raise ConfigError(f"{where}: rotary_percent={self.rotary_percent!r} must be in (0, 1] and rotate an even "
                              f"number of each head's {self.head_dim} dimensions.")
        if mrope and self.rotary_percent != 1:
            raise ConfigError(f"{where}: partial rotary (rotary_percent) of multimodal RoPE is not built; remove it.")
        self._check_rope_scaling()

    def _check_rope_scaling(self) -> None:
        where = f"model {self.name}"
        if self.rope_scaling_type is None:
            given = [key for key in ROPE_SCALING_KEYS if getattr(self, key) != _DEFAULTS[key]]
            if given:
                raise ConfigError(f"{where}: {given[0]} is set but rope_scaling_type is not, so it would do nothing; "
                                  f"set rope_scaling_type ({', '.join(ROPE_SCALINGS)}) or remove it.")
            return
        if self.rope_scaling_type not in ROPE_SCALINGS:
            raise ConfigError(f"{where}: rope_scaling_type={self.rope_scaling_type!r} is not a RoPE scaling mindrl "
                              f"builds; choose one of {', '.join(ROPE_SCALINGS)}.")
        idle = [key for key in ROPE_SCALING_KEYS if key not in ROPE_SCALINGS[self.rope_scaling_type]
                and getattr(self, key) != _DEFAULTS[key]]
        if idle:
            raise ConfigError(f"{where}: {idle[0]} does nothing with rope_scaling_type {self.rope_scaling_type}, "
                              f"which reads {', '.join(ROPE_SCALINGS[self.rope_scaling_type])}; remove it.")
        if (self.rope_scaling_mscale is None) != (self.rope_scaling_mscale_all_dim is None):
            raise ConfigError(f"{where}: rope_scaling_mscale and rope_scaling_mscale_all_dim set YaRN's attention "
                              f"factor together (alone either does nothing); set both or neither.")
        if self.rope_scaling_type == "yarn" and not self.beta_fast > self.beta_slow > 0:
            raise ConfigError(f"{where}: yarn RoPE scaling needs beta_fast > beta_slow > 0 (rotations bounding its "
                              f"ramp), got {self.beta_fast!r} and {self.beta_slow!r}.")
        if self.position_embedding_type == "mrope":
            raise ConfigError(f"{where}: RoPE scaling of multimodal RoPE is not built; remove rope_scaling_type.")
        if self.rope_scaling_type == "yarn" and self.rotary_percent != 1:
            raise ConfigError(f"{where}: YaRN's attention factor scales the rotated dimensions alone, which mindrl "
                              f"builds for wholly rotated heads (and multi-latent attention) only; drop "
                              f"rope_scaling_type or rotary_percent={self.rotary_percent}.")
        if not self.rope_scaling_factor >= 1:
            raise ConfigError(f"{where}: rope_scaling_factor must be at least 1 (it stretches the context), got "
                              f"{self.rope_scaling_factor!r}.")
        original = self.rope_scaling_original_max_position_embeddings
        if original is not None and (not isinstance(original, int) or original < 1):
            raise ConfigError(f"{where}: rope_scaling_original_max_position_embeddings must be a positive integer, "
                              f"got {original!r}.")
        if self.rope_scaling_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(f"{where}: llama3 RoPE scaling needs 0 < low_freq_factor < high_freq_factor, got "
                              f"{self.low_freq_factor!r} and {self.high_freq_factor!r}.")

    def _check_moe(self) -> None:
        where = f"model {self.name}"
        if self.num_experts is None:
            given = [k for k in MOE_FIELDS if getattr(self, k) != _DEFAULTS[k]]
            if given:
                raise ConfigError(f"{where}: {given[0]} is set but num_experts is not; set num_experts for a "
                                  f"mixture-of-experts model or remove the MoE keys.")
            return
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ConfigError(f"{where}: num_experts must be a positive integer, got {self.num_experts!r}.")
        if not isinstance(self.moe_router_topk, int) or not 1 <= self.moe_router_topk <= self.num_experts:
            raise ConfigError(f"{where}: moe_router_topk={self.moe_router_topk!r} must be between 1 and "
                              f"num_experts={self.num_experts}; choose fewer experts per token.")
        for key in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{where}: {key} must be a positive integer or null, got {value!r}.")
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            raise ConfigError(f"{where}: moe_shared_expert_gate needs a shared expert; set "
                              f"moe_shared_expert_intermediate_size or drop the gate.")
        for key, allowed in (("moe_router_load_balancing_type", MOE_LOAD_BALANCING),
                             ("moe_token_dispatcher_type", MOE_DISPATCHERS),
                             ("moe_router_dtype", (None, *MOE_ROUTER_DTYPES)),
                             ("moe_router_score_function", MOE_SCORE_FUNCTIONS)):
            if getattr(self, key) not in allowed:
                raise ConfigError(f"{where}: {key}={getattr(self, key)!r} is not one mindrl builds; choose one "
                                  f"of {', '.join(map(str, allowed))}.")
        k = self.first_k_dense_replace
        if not isinstance(k, int) or not 0 <= k < self.num_layers:
            raise ConfigError(f"{where}: first_k_dense_replace={k!r} must be a count of dense layers from 0 to "
                              f"num_layers - 1 = {self.num_layers - 1}.")
        self._check_sigmoid_routing()

    def _check_sigmoid_routing(self) -> None:
        where = f"model {self.name}"
        sigmoid = self.moe_router_score_function == "sigmoid"
        if self.moe_router_enable_expert_bias and not sigmoid:
            raise ConfigError(f"{where}: moe_router_enable_expert_bias biases sigmoid scores; set "
                              f"moe_router_score_function: sigmoid or drop the bias.")
        if sigmoid and not self.norm_topk_prob:
            raise ConfigError(f"{where}: sigmoid routing renormalises its top-k weights (megatron-core always does), "
                              f"so norm_topk_prob must be true.")
        if sigmoid and self.moe_router_topk == 1:
            raise ConfigError(f"{where}: sigmoid routing with moe_router_topk 1 weighs the expert by its raw score in "
                              f"megatron-core but by 1 in HF and vLLM; route each token to two experts or more.")
        factor = self.moe_router_topk_scaling_factor
        if factor is not None and not (isinstance(factor, int | float) and factor > 0):
            raise ConfigError(f"{where}: moe_router_topk_scaling_factor must be a positive number or null, got "
                              f"{factor!r}.")
        groups, chosen = self.moe_router_num_groups, self.moe_router_group_topk
        if groups is not None and groups == chosen:  # every group chosen (one group, say): no grouping
            object.__setattr__(self, "moe_router_num_groups", None)
            object.__setattr__(self, "moe_router_group_topk", None)
            return
        if (groups is None) != (chosen is None):
            raise ConfigError(f"{where}: moe_router_num_groups and moe_router_group_topk set group-limited routing "
                              f"together; set both or neither.")
        if groups is None:
            return
        if not (isinstance(groups, int) and isinstance(chosen, int) and 1 <= chosen <= groups):
            raise ConfigError(f"{where}: moe_router_group_topk={chosen!r} must be a count of groups from 1 to "
                              f"moe_router_num_groups={groups!r}.")
        if self.num_experts % groups:
            raise ConfigError(f"{where}: moe_router_num_groups={groups} does not divide num_experts="
                              f"{self.num_experts} into equal groups; choose a divisor of it.")
        if self.moe_router_topk // chosen != 2 or self.moe_router_topk > chosen * (self.num_experts // groups):
            raise ConfigError(f"{where}: group-limited routing ranks each group by its top moe_router_topk // "
                              f"moe_router_group_topk scores (megatron-core), which HF and vLLM fix at two, and picks "
                              f"the top-k from the chosen groups' experts; with moe_router_group_topk={chosen} set "
                              f"moe_router_topk to {2 * chosen} or {2 * chosen + 1}, within the chosen groups' "
                              f"{chosen * (self.num_experts // groups)} experts.")

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def layer_arch(self, index: int) -> ModelArch:
        """Layer `index` alone: an MoE model's first `first_k_dense_replace` layers are those of the dense model of
        the same shapes, so what is named, cut or counted per layer (the HF mapping, the TP cut, FLOPs) reads one
        kind of layer at a time."""
        return _dense_layers(self) if self.is_moe and index < self.first_k_dense_replace else self

    @property
    def router_dtype(self) -> str | None:
        """The router's precision: moe_router_dtype, else fp32 for sigmoid routing (HF and vLLM compute DeepSeek's
        and GLM-4.5's router in fp32; in bf16 a score near 0.5 moves in steps of 0.002, coarse beside the bias)."""
        return self.moe_router_dtype or ("fp32" if self.moe_router_score_function == "sigmoid" else None)

    @property
    def moe_layers(self) -> range:
        """The layers holding experts."""
        return range(self.first_k_dense_replace, self.num_layers) if self.is_moe else range(0)

    @property
    def moe_layer_pattern(self) -> list[int]:
        """Megatron's moe_layer_freq as a list: 1 for each layer holding experts, 0 for a dense one."""
        return [int(i in self.moe_layers) for i in range(self.num_layers)]

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def query_groups(self) -> int:
        """Key-value heads; without GQA every query head has its own."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Each head's query and key width (multi-latent attention: with the rotated part)."""
        if self.multi_latent_attention:
            return self.qk_head_dim + self.qk_pos_emb_head_dim
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def value_head_dim(self) -> int:
        """Each head's value width: head_dim but under multi-latent attention."""
        return self.v_head_dim if self.multi_latent_attention else self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head RoPE rotates (the first ones; multi-latent attention keeps them apart)."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return round(self.head_dim * self.rotary_percent)

    @property
    def has_score_head(self) -> bool:
        """A sequence classifier (reward model): `rm_head` scores hidden states; there is no LM head."""
        return self.num_labels is not None

    @property
    def tied_embeddings(self) -> bool:
        """The LM head is the embedding (no output layer of its own)."""
        return not self.untie_embeddings_and_output_weights and not self.has_score_head

    @property
    def has_output_layer(self) -> bool:
        """An LM head with weights of its own."""
        return self.untie_embeddings_and_output_weights and not self.has_score_head

    def vocab_size_for(self, tensor_parallel_size: int) -> int:
        """Rows of the embedding table: padded so every TP rank holds an equal slice."""
        return self.padded_rows(self.padded_vocab_size, self.make_vocab_size_divisible_by, tensor_parallel_size)

    @staticmethod
    def padded_rows(vocab: int, divisible_by: int, tensor_parallel_size: int) -> int:
        """Megatron's padding: up to a multiple of make_vocab_size_divisible_by × TP."""
        multiple = divisible_by * tensor_parallel_size
        return -(-vocab // multiple) * multiple

    @classmethod
    def from_dict(cls, name: str, values: Mapping[str, Any]) -> ModelArch:
        """Build from a model-yaml mapping; unknown or unsupported keys are errors."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"name"}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            key = _ALIASES.get(key, key)
            if key in fields:
                kwargs[key] = value
            elif key in _NO_EFFECT_KEYS:
                continue
            elif key == "spec":
                _check_spec(name, value, values)
            elif key in _DEEPSEEK_SWITCHES:
                _check_deepseek_switch(name, key, value, values)
            elif key == "n_shared_experts":
                continue  # read below, with the expert width it multiplies
            else:
                feature = next((what for prefix, what in _UNSUPPORTED_PREFIXES.items()
                                if key.startswith(prefix)), None)
                if feature:
                    raise ConfigError(f"model {name}: key {key!r} asks for {feature}, which mindrl "
                                      f"does not build yet; remove it or pick a dense architecture.")
                raise ConfigError(f"model {name}: unknown key {key!r}; known keys are "
                                  f"{', '.join(sorted(fields | _NO_EFFECT_KEYS))}.")
        if values.get("n_shared_experts"):
            kwargs.update(_shared_experts(name, values))
        if values.get("use_mcore_models") is False:
            raise ConfigError(f"model {name}: use_mcore_models: false is not supported; mindrl always "
                              f"builds megatron-core models, so set it to true or remove it.")
        if values.get("group_query_attention") is False and "num_query_groups" in values:
            kwargs.pop("num_query_groups")
        if kwargs.get("attention_bias") and kwargs.get("disable_bias_linear", True):
            raise ConfigError(f"model {name}: attention_bias: true contradicts disable_bias_linear: "
                              f"true; use add_qkv_bias for a QKV-only bias.")
        for key in ("norm_epsilon", "moe_aux_loss_coeff", "moe_z_loss_coeff"):
            if isinstance(kwargs.get(key), str):  # YAML 1.1 reads `1e-6` as a string
                try:
                    kwargs[key] = float(kwargs[key])
                except ValueError:
                    raise ConfigError(f"model {name}: {key} must be a number, got {kwargs[key]!r}.") from None
        try:
            return cls(name=name, **kwargs)
        except TypeError as err:
            raise ConfigError(f"model {name}: {err}; add the missing keys to its model yaml.") from None


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelArch)}
#: the fields only a mixture of experts has
MOE_FIELDS = tuple(f.name for f in dataclasses.fields(ModelArch) if f.name.startswith("moe_") or
                   f.name in ("num_experts", "norm_topk_prob", "first_k_dense_replace"))


@functools.lru_cache(maxsize=32)
def _dense_layers(arch: ModelArch) -> ModelArch:
    return dataclasses.replace(arch, **{name: _DEFAULTS[name] for name in MOE_FIELDS})


#: MindSpeed-LLM's DeepSeek switches read here: where the MoE layers are (mindrl builds experts in every layer after
#: first_k_dense_replace) and which balancing loss
_DEEPSEEK_SWITCHES = ("moe_layer_freq", "seq_aux")


def _check_deepseek_switch(name: str, key: str, value: object, values: Mapping[str, Any]) -> None:
    """`moe_layer_freq: 1` (experts in every layer after the dense ones) and `seq_aux` (MindSpeed-LLM's switch for
    the sequence-level balancing loss, which moe_router_load_balancing_type: seq_aux_loss chooses here) are read;
    what else they could say is not built."""
    if key == "moe_layer_freq" and value != 1:
        raise ConfigError(f"model {name}: moe_layer_freq={value!r} places experts every few layers, which mindrl "
                          f"does not build; it builds dense layers first (first_k_dense_replace) and experts in every "
                          f"layer after them (moe_layer_freq: 1).")
    if key == "seq_aux" and value and values.get("moe_router_load_balancing_type") != "seq_aux_loss":
        raise ConfigError(f"model {name}: seq_aux: true asks for the sequence-level balancing loss; set "
                          f"moe_router_load_balancing_type: seq_aux_loss (with moe_aux_loss_coeff) instead.")


def _shared_experts(name: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """MindSpeed-LLM's `n_shared_experts` (DeepSeek's count of expert-sized shared experts, un-gated) as the width
    of one shared expert."""
    count, expert = values["n_shared_experts"], values.get("moe_ffn_hidden_size") or values.get("ffn_hidden_size")
    if not isinstance(count, int) or count < 1 or not isinstance(expert, int):
        raise ConfigError(f"model {name}: n_shared_experts={count!r} must be a positive count of shared experts, "
                          f"each moe_ffn_hidden_size wide.")
    width = values.get("moe_shared_expert_intermediate_size")
    if width is not None and width != count * expert:
        raise ConfigError(f"model {name}: n_shared_experts={count} makes a shared expert {count * expert} wide, but "
                          f"moe_shared_expert_intermediate_size={width}; keep one of the two.")
    return {"moe_shared_expert_intermediate_size": count * expert}
#: the fields that configure rope_scaling_type
ROPE_SCALING_KEYS = ("rope_scaling_factor", "rope_scaling_original_max_position_embeddings", "low_freq_factor",
                     "high_freq_factor", "beta_fast", "beta_slow", "rope_scaling_mscale", "rope_scaling_mscale_all_dim")


def _check_spec(name: str, spec: object, values: Mapping[str, Any]) -> None:
    """A MindSpeed-LLM layer spec is accepted where mindrl's own layer, built from the model's keys, is that layer."""
    parts = tuple(spec) if isinstance(spec, list | tuple) else tuple(str(spec).split())
    needs = LAYER_SPECS.get(parts)
    named = ".".join(map(str, parts))
    if needs is None:
        raise ConfigError(f"model {name}: spec {named} names a MindSpeed-LLM layer that mindrl does not build yet (it "
                          f"builds {', '.join('.'.join(s) for s in LAYER_SPECS)} from the model's keys); pick an "
                          f"architecture mindrl builds.")
    if not values.get(needs):
        raise ConfigError(f"model {name}: spec {named} is the layer with {needs}, but the model sets {needs}: "
                          f"{values.get(needs)!r}; set {needs}: true (or remove the spec).")


def load_model_arch(name: str, config_dir: str | Path | None = None) -> ModelArch:
    """Read configs/model/<name>.yaml (OmegaConf, so `1e-6` is a float as in Hydra)."""
    path = Path(config_dir or MODEL_CONFIGS_DIR) / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"no model architecture named {name!r} in {path.parent}; "
                          f"known: {', '.join(known)}.")
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(data, dict) or name not in data:
        raise ConfigError(f"{path} must hold one top-level key {name!r} with the architecture under it.")
    return ModelArch.from_dict(name, data[name])
