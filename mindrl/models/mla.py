"""Multi-latent attention (DeepSeek-V2/V3) on megatron-core's parallel linear layers, with mindrl's attention core.

Keys and values come from one narrow latent per token (kv_lora_rank wide, RMS-normed), queries from another
(q_lora_rank, optional); each head's query and key hold qk_head_dim dimensions without position and
qk_pos_emb_head_dim rotated ones, the rotated key part shared by every head, and its value is v_head_dim wide.

megatron-core's MLASelfAttention rotates by sequence index from a table of its own (mindrl rotates packed rows and
context-parallel shares by each token's position, with its RoPE scaling), and its local-spec build is broken
upstream. This module keeps its parameter names and tensor-parallel cut (the down projections column-parallel and
gathered, the up projections cut by heads) and lays each head's query and key out as [rotated | not rotated]: the
dot product does not see the order, so the GPTModel's own rotary table, megatron-core's partial RoPE and the Megatron
rollout engine's KV cache apply as to any head of head_dim with rotary_dim rotated.

HF stores the rotated dimensions interleaved (pairs of neighbours, `rope_interleave`); they are put in rotate-half
order here, as megatron-core's MLA does, so the weights are HF's and convert by renaming.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer import ModuleSpec, TransformerConfig
from megatron.core.transformer.attention import Attention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import build_module

from mindrl.config import ModelArch
from mindrl.models.attention import SDPAttention
from mindrl.models.rmsnorm import RMSNorm


@dataclass
class MLASubmodules:
    """The module classes of a multi-latent attention layer (megatron-core's names)."""

    linear_q_proj: ModuleSpec | type | None = None
    linear_q_down_proj: ModuleSpec | type | None = None
    linear_q_up_proj: ModuleSpec | type | None = None
    linear_kv_down_proj: ModuleSpec | type | None = None
    linear_kv_up_proj: ModuleSpec | type | None = None
    core_attention: ModuleSpec | type | None = None
    linear_proj: ModuleSpec | type | None = None
    q_layernorm: ModuleSpec | type | None = None
    kv_layernorm: ModuleSpec | type | None = None


@dataclass(frozen=True)
class MLAShape:
    """The widths a multi-latent attention layer is built with (ModelArch's fields of the same names)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int


class MultiLatentAttention(Attention):
    """Self-attention [s, b, h] → [s, b, h] through latent projections; `config.kv_channels` is the query and key
    head width (qk_head_dim + qk_pos_emb_head_dim), the value's is `shape.v_head_dim`."""

    def __init__(self, config: TransformerConfig, submodules: MLASubmodules, layer_number: int, shape: MLAShape,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal, cp_comm_type: str | None = None,
                 pg_collection: ProcessGroupCollection | None = None) -> None:
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, attention_type="self", cp_comm_type=cp_comm_type,
                         pg_collection=pg_collection)
        self.shape = shape
        self.val_hidden_size = shape.v_head_dim
        heads, hidden = config.num_attention_heads, config.hidden_size
        query_width = heads * (shape.qk_head_dim + shape.qk_pos_emb_head_dim)

        def column(module, inputs: int, outputs: int) -> torch.nn.Module:
            return build_module(module, inputs, outputs, config=config, init_method=config.init_method,
                                gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
                                tp_group=self.pg_collection.tp)

        def norm(module, width: int) -> torch.nn.Module:
            # norm_epsilon, as vLLM builds the latents' norms (HF fixes 1e-6, DeepSeek's own value)
            return build_module(module, config=config, hidden_size=width, eps=config.layernorm_epsilon)

        if shape.q_lora_rank is None:
            self.linear_q_proj = column(submodules.linear_q_proj, hidden, query_width)
        else:
            self.linear_q_down_proj = column(submodules.linear_q_down_proj, hidden, shape.q_lora_rank)
            self.linear_q_up_proj = column(submodules.linear_q_up_proj, shape.q_lora_rank, query_width)
            self.q_layernorm = norm(submodules.q_layernorm, shape.q_lora_rank)
        self.linear_kv_down_proj = column(submodules.linear_kv_down_proj, hidden,
                                          shape.kv_lora_rank + shape.qk_pos_emb_head_dim)
        self.linear_kv_up_proj = column(submodules.linear_kv_up_proj, shape.kv_lora_rank,
                                        heads * (shape.qk_head_dim + shape.v_head_dim))
        self.kv_layernorm = norm(submodules.kv_layernorm, shape.kv_lora_rank)
        self.linear_proj = build_module(submodules.linear_proj, heads * shape.v_head_dim, hidden, config=config,
                                        init_method=config.output_layer_init_method, bias=config.add_bias_linear,
                                        input_is_parallel=True, skip_bias_add=True, is_expert=False,
                                        tp_comm_buffer_name="proj", tp_group=self.pg_collection.tp)

    def _latent(self, projection: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        """A down projection's whole output on every TP rank, over the whole sequence: the column-parallel layer
        gathers a sequence-parallel input and hands each rank its slice of the latent."""
        latent, _ = projection(hidden_states)
        return gather_from_tensor_model_parallel_region(latent)

    def _normed(self, norm: torch.nn.Module, latent: torch.Tensor) -> torch.Tensor:
        """The latent RMS-normed on this rank's share of the sequence (the up projection gathers it again)."""
        if self.config.sequence_parallel:
            latent = scatter_to_sequence_parallel_region(latent)
        return norm(latent)

    def get_query_key_value_tensors(self, hidden_states: torch.Tensor, key_value_states: torch.Tensor | None = None,
                                    *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries and keys [s, b, heads / TP, rotated + not rotated] before RoPE, values [s, b, heads / TP, v]."""
        shape, heads = self.shape, self.num_attention_heads_per_partition
        rotated = shape.qk_pos_emb_head_dim
        if shape.q_lora_rank is None:
            query, _ = self.linear_q_proj(hidden_states)
        else:
            latent = self._latent(self.linear_q_down_proj, hidden_states)
            query, _ = self.linear_q_up_proj(self._normed(self.q_layernorm, latent))
        query = query.view(*query.shape[:2], heads, shape.qk_head_dim + rotated)
        query_plain, query_rotated = query.split([shape.qk_head_dim, rotated], dim=-1)
        kv_latent, key_rotated = self._latent(self.linear_kv_down_proj, hidden_states).split(
            [shape.kv_lora_rank, rotated], dim=-1)
        # every TP rank's heads share the rotated key: its gradient is the sum of theirs (megatron-core's local-spec
        # MLA leaves each rank its own heads' share, which the latent's gather then cuts as if whole)
        key_rotated = copy_to_tensor_model_parallel_region(key_rotated)
        kv, _ = self.linear_kv_up_proj(self._normed(self.kv_layernorm, kv_latent))
        kv = kv.view(*kv.shape[:2], heads, shape.qk_head_dim + shape.v_head_dim)
        key_plain, value = kv.split([shape.qk_head_dim, shape.v_head_dim], dim=-1)
        key_rotated = _rotate_half_order(key_rotated).unsqueeze(2).expand(-1, -1, heads, -1)
        query = torch.cat([_rotate_half_order(query_rotated), query_plain], dim=-1)
        key = torch.cat([key_rotated, key_plain], dim=-1)
        return query, key, value.contiguous()

    def forward(self, hidden_states: torch.Tensor, attention_mask: object, key_value_states: object = None,
                inference_context: object = None,
                rotary_pos_emb: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
                rotary_pos_cos: object = None, rotary_pos_sin: object = None, rotary_pos_cos_sin: object = None,
                attention_bias: object = None, packed_seq_params: object = None, sequence_len_offset: object = None,
                *, inference_params: object = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`attention_mask`: what mindrl's attention core takes (mindrl/models/attention.py); the others are
        megatron-core's TransformerLayer's, which this module refuses but for `rotary_pos_emb`."""
        if any(x is not None for x in (key_value_states, inference_context, inference_params, attention_bias,
                                       packed_seq_params, rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin)):
            raise NotImplementedError("mindrl's multi-latent attention is self-attention over the inputs alone (the "
                                      "Megatron rollout engine keeps its own KV cache); no cross-attention, "
                                      "inference context, attention bias, packed_seq_params or fused RoPE.")
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        if rotary_pos_emb is not None:
            query_rope, key_rope = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            query = apply_rotary_pos_emb(query, query_rope, config=self.config)
            key = apply_rotary_pos_emb(key, key_rope, config=self.config)
        context = self.core_attention(query, key, value, attention_mask)
        return self.linear_proj(context)


def _rotate_half_order(x: torch.Tensor) -> torch.Tensor:
    """HF's interleaved rotary pairs (x0, x1), (x2, x3), … as rotate-half's halves (x0, x2, …, x1, x3, …)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def mla_spec(arch: ModelArch) -> ModuleSpec:
    """The self-attention spec of a multi-latent attention layer of `arch`."""
    shape = MLAShape(arch.q_lora_rank, arch.kv_lora_rank, arch.qk_head_dim, arch.qk_pos_emb_head_dim, arch.v_head_dim)
    column = ColumnParallelLinear
    return ModuleSpec(module=MultiLatentAttention, params={"attn_mask_type": AttnMaskType.causal, "shape": shape},
                      submodules=MLASubmodules(linear_q_proj=column, linear_q_down_proj=column,
                                               linear_q_up_proj=column, linear_kv_down_proj=column,
                                               linear_kv_up_proj=column, core_attention=SDPAttention,
                                               linear_proj=RowParallelLinear, q_layernorm=RMSNorm,
                                               kv_layernorm=RMSNorm))
