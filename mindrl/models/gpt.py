"""Build a megatron-core GPTModel (local layer spec) from a ModelArch.

The local spec is used everywhere because it needs neither Transformer Engine nor apex,
so the same modules — and therefore the same parameter names and numerics — exist on
CPU, GPU and NPU. Fused kernels are off for the same reason; the attention core is
torch's scaled_dot_product_attention (mindrl/models/attention.py), which every platform has; SwiGLU
and RMSNorm are plain-torch autograd functions with their gradients written out (mindrl/models/swiglu.py,
mindrl/models/rmsnorm.py).
"""

from __future__ import annotations

import math
import warnings

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import ModuleSpec, TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from mindrl.config import ModelArch, ParallelConfig, validate_parallel
from mindrl.config.parallel import validate_sequence_parallel
from mindrl.config.recompute import Recompute
from mindrl.config.vision import VisionArch
from mindrl.models import arch_fields as af
from mindrl.models import rope
from mindrl.models.attention import SDPAttention
from mindrl.models.mla import mla_spec
from mindrl.models.moe import add_expert_bias, mlp_submodules, moe_config_kwargs, routers_of
from mindrl.models.recompute import RecomputedBlock
from mindrl.models.rmsnorm import RMSNorm
from mindrl.models.swiglu import SwiGLU
from mindrl.models.vision import VisionEncoder
from mindrl.platform import Platform, get_platform


def _stage_layout(arch: ModelArch, par: ParallelConfig) -> list[list[str]] | None:
    """Megatron's explicit per-stage layout, needed only for an uneven num_layer_list."""
    counts = par.layers_per_stage(arch)
    if len(set(counts)) == 1:
        return None
    layout = [["decoder"] * n for n in counts]
    layout[0].insert(0, "embedding")
    layout[-1].append("loss")
    return layout


def transformer_config(arch: ModelArch, par: ParallelConfig, params_dtype: torch.dtype = torch.float32,
                       platform: Platform | None = None, **overrides) -> TransformerConfig:
    """The TransformerConfig for `arch` under `par`; `overrides` win over everything."""
    validate_parallel(arch, par)
    validate_sequence_parallel(arch, par)
    platform = platform or get_platform()
    kwargs = dict(
        **af.transformer_config_kwargs(arch),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=par.tp,
        sequence_parallel=par.sequence_parallel_for(arch),
        pipeline_model_parallel_size=par.pp,
        pipeline_model_parallel_layout=_stage_layout(arch, par),
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    if arch.is_moe:
        kwargs.update(moe_config_kwargs(arch, par))
    factor = rope.softmax_factor(arch)
    if factor != 1.0:
        kwargs["softmax_scale"] = factor / math.sqrt(arch.head_dim)
    kwargs.update(platform.transformer_config_overrides())
    kwargs.update(overrides)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*cuda_graph_scope.*|.*full scope is deprecated.*")
        return TransformerConfig(**kwargs)


class PositionedGPTModel(GPTModel):
    """megatron-core's GPTModel, rotating queries and keys by the `position_ids` it is given.

    Megatron's RoPE rotates by sequence index whatever the position ids say; a row that packs several
    responses behind one shared prompt (mindrl/models/prompt_packing.py) needs each response's positions
    to restart after the prompt. With position ids 0…s−1 the result is the plain model's, bit for bit."""

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None, padding_mask=None,
                    **kwargs):
        out = list(super()._preprocess(input_ids, position_ids, decoder_input=decoder_input,
                                       inference_context=inference_context, **kwargs))
        out[5] = self._sequence_shard(padding_mask)
        rotary = out[1]
        if rotary is None or position_ids is None or inference_context is not None or position_ids.ndim == 3:
            return tuple(out)  # multimodal RoPE rotates each row by its own [3, b, s] positions already
        cp = parallel_state.get_context_parallel_world_size()
        if cp > 1:  # a share's positions run past its length, though never past the CP shares' tokens
            rotary = self.rotary_pos_emb(rotary.shape[0] * cp)
        # [s, 1, 1, dim] for the positions 0…s−1 → [s, b, 1, dim] for each row's own positions
        out[1] = rotary[:, 0][position_ids.t()]
        return tuple(out)

    def _sequence_shard(self, padding_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The [b, s] padding mask (True: padding) of the tokens this rank's MoE routers see. megatron-core cuts
        it for sequence parallelism only on a first stage that embeds the tokens itself, so a later pipeline
        stage or a vision-language model (embeddings given) would hand its routers the whole sequence's."""
        if padding_mask is None or not self.config.sequence_parallel:
            return padding_mask
        return tensor_parallel.scatter_to_sequence_parallel_region(padding_mask.t().contiguous()).t().contiguous()


#: the vision tower's initial weights are drawn from this seed on every rank (models trained from scratch only)
_VISION_INIT_SEED = 20250826


class VisionLanguageModel(PositionedGPTModel):
    """Qwen2.5-VL: the first stage also holds the vision tower, whose features replace the embeddings of the
    image placeholder tokens (in row-major order over the batch, as HF's masked_scatter fills them). Every
    stage takes [3, b, s] multimodal positions (mindrl.models.vision.mrope_positions)."""

    def __init__(self, config: TransformerConfig, spec, vision: VisionArch, **kwargs) -> None:
        super().__init__(config, spec, position_embedding_type="mrope", **kwargs)
        self.image_token_id = vision.image_token_id
        if self.pre_process:
            self.vision_model = VisionEncoder(vision, config.hidden_size)
            self.vision_model.initialize(seed=_VISION_INIT_SEED)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask, decoder_input=None,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                image_mask: torch.Tensor | None = None, **kwargs):
        if self.pre_process and pixel_values is not None:
            decoder_input = self.embed_with_images(input_ids, pixel_values, image_grid_thw, image_mask)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, **kwargs)

    def embed_with_images(self, input_ids: torch.Tensor, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                          image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The embeddings [s, b, h] of `input_ids` [b, s] with the image features in the placeholders' places: the
        one way both the training forward and the Megatron rollout engine see images. `image_mask` [b, s] marks the
        placeholders (default: every image-pad token); an image-pad token a policy sampled is text, as the engines
        embed it."""
        mask = input_ids == self.image_token_id if image_mask is None else image_mask
        rows, cols = mask.nonzero(as_tuple=True)
        features = self.vision_model(pixel_values, image_grid_thw)
        if features.shape[0] != rows.numel():
            raise ValueError(f"the batch has {rows.numel()} image placeholder tokens but its images make "
                             f"{features.shape[0]} features; expand each image's placeholder to its grid.")
        embedded = self.embedding(input_ids=input_ids, position_ids=None)
        return embedded.index_put((cols, rows), features.to(embedded.dtype))


class RewardGPTModel(PositionedGPTModel):
    """A GPTModel whose last stage ends in `rm_head` (hidden → num_labels scores per position) instead
    of the LM head: HF's *ForSequenceClassification `score` layer, replicated on every TP rank (a head of
    one output cannot be cut). The forward returns [b, s, num_labels] scores; picking the scored position
    is the caller's (the reward worker's) business."""

    def __init__(self, config: TransformerConfig, spec, num_labels: int, **kwargs) -> None:
        super().__init__(config, spec, share_embeddings_and_output_weights=False, **kwargs)
        if self.post_process:
            del self.output_layer
            self.rm_head = torch.nn.Linear(config.hidden_size, num_labels, bias=False, dtype=config.params_dtype)
            config.init_method(self.rm_head.weight)

    def _postprocess(self, hidden_states: torch.Tensor, **_) -> torch.Tensor:
        if not self.post_process:
            return hidden_states
        if self.config.sequence_parallel:
            # each TP rank holds its shard of the sequence; the head, replicated, scores all of it (the backward
            # hands each rank its shard of the gradient, as the LM head's gather does)
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(hidden_states,
                                                                                 tensor_parallel_output_grad=False)
        return self.rm_head(hidden_states).transpose(0, 1).contiguous()


def build_gpt_model(arch: ModelArch, par: ParallelConfig, params_dtype: torch.dtype = torch.float32,
                    platform: Platform | None = None, recompute: Recompute | None = None,
                    **config_overrides) -> GPTModel:
    """This rank's pipeline stage and tensor slice of `arch` (a RewardGPTModel if it has a score
    head), on this platform's device, recomputing activations in its backward as `recompute` says.

    Megatron's parallel state must already be initialised with `par` (see
    mindrl.distributed.init_model_parallel); the stage is taken from it.
    """
    platform = platform or get_platform()
    # megatron-core builds the MLP's activation from the spec only under this flag (named for TE's modules)
    config = transformer_config(arch, par, params_dtype, platform,
                                **{"use_te_activation_func": arch.swiglu,
                                   **(recompute or Recompute()).transformer_config_kwargs(), **config_overrides})
    specs = {kind: _layer_spec(kind, config) for kind in {arch.layer_arch(0), arch}}
    block: ModuleSpec | TransformerBlockSubmodules = specs[arch]
    if arch.normalization == "RMSNorm" or len(specs) > 1:
        # the final norm comes from the block's submodules, which the layer spec alone leaves at torch's; an MoE
        # model's dense layers come first (the stage's layers from its first one)
        first = par.first_layer_of_stages(arch)[parallel_state.get_pipeline_model_parallel_rank()]
        norm = RMSNorm if arch.normalization == "RMSNorm" else specs[arch].submodules.input_layernorm
        block = TransformerBlockSubmodules(layer_norm=norm, layer_specs=[
            specs[arch.layer_arch(first + i)] for i in range(get_num_layers_to_build(config))])
    kwargs = dict(vocab_size=arch.vocab_size_for(par.tp), max_sequence_length=arch.max_position_embeddings,
                  pre_process=parallel_state.is_pipeline_first_stage(),
                  post_process=parallel_state.is_pipeline_last_stage(), rotary_base=arch.rotary_base,
                  rotary_percent=arch.rotary_dim / arch.head_dim)
    if arch.vision is not None:
        model = VisionLanguageModel(config, block, arch.vision,
                                    share_embeddings_and_output_weights=arch.tied_embeddings, **kwargs)
    elif arch.has_score_head:
        model = RewardGPTModel(config, block, arch.num_labels, position_embedding_type="rope", **kwargs)
    else:
        model = PositionedGPTModel(config, block, share_embeddings_and_output_weights=arch.tied_embeddings,
                                   position_embedding_type="rope", **kwargs)
    if getattr(model, "rotary_pos_emb", None) is not None:
        # megatron-core would cut the rotary table for its own context-parallel split; mindrl's shares carry each
        # token's position and are rotated by it
        model.rotary_pos_emb.cp_group = None
        if arch.rope_scaling_type is not None or arch.multi_latent_attention:
            # megatron-core's own scaling is llama3's with fixed bounds only; its table for a rotated share of a head
            # rounds the share's width from a fraction
            model.rotary_pos_emb.inv_freq = rope.inv_freq(arch).to(model.rotary_pos_emb.inv_freq.device)
    if config.recompute_granularity == "full":
        # GPTModel builds megatron-core's block itself; mindrl's differs only in how it recomputes
        model.decoder.__class__ = RecomputedBlock
    add_expert_bias(model, arch)
    # The local spec builds its norms in fp32 whatever params_dtype says; cast them too, as
    # Megatron's Float16Module does, so a bf16 model is bf16 throughout like the HF one (but for the expert bias).
    model = model.to(device=platform.device(), dtype=params_dtype)
    for router in routers_of(model):
        if router.expert_bias is not None:
            router.expert_bias.data = router.expert_bias.data.float()
    return model


def _layer_spec(arch: ModelArch, config: TransformerConfig) -> ModuleSpec:
    """megatron-core's local layer spec for `arch`'s layers (a dense one for a dense layer of an MoE model), with
    mindrl's attention core, SwiGLU and RMSNorm."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Apex is not installed.*")
        spec = get_gpt_layer_local_spec(num_experts=arch.num_experts, moe_grouped_gemm=False,
                                        qk_layernorm=arch.qk_layernorm, normalization=arch.normalization)
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    if arch.multi_latent_attention:
        spec.submodules.self_attention = mla_spec(arch)
    if config.use_te_activation_func:
        for mlp in mlp_submodules(spec):
            mlp.activation_func = SwiGLU
    if arch.normalization == "RMSNorm":
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = RMSNorm
        if config.sequence_parallel and arch.qk_layernorm:
            # torch's norm refuses sequence parallelism (the QK norms see whole sequences either way)
            attention = spec.submodules.self_attention.submodules
            attention.q_layernorm = attention.k_layernorm = RMSNorm
    return spec


def load_stage_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], only: set[str] | None = None) -> None:
    """Copy a stage state dict into `model`; every parameter must be given (of `only`, where named: an
    adapters-only checkpoint's), nothing extra.

    Megatron's `_extra_state` entries (kernel metadata, no weights) are not expected.
    """
    params = {name: p for name, p in model.named_parameters() if only is None or name in only}
    missing = sorted(set(params) - set(weights))
    unexpected = sorted(set(weights) - set(params))
    if missing or unexpected:
        raise KeyError(f"stage weights do not fit the model: missing {missing[:5]}, "
                       f"unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, param in params.items():
            source = weights[name]
            if tuple(source.shape) != tuple(param.shape):
                raise ValueError(f"{name}: weight of shape {tuple(source.shape)} does not fit the "
                                 f"parameter of shape {tuple(param.shape)}.")
            param.copy_(source)

