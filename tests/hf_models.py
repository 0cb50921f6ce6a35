"""Tiny random HF causal LMs and reward models built locally (no hub), saved as (sharded) safetensors.

Every parameter is drawn at random — norm weights too — so a swapped or mis-cut tensor
cannot hide behind an all-ones initialisation.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

KINDS = {
    # (a) Qwen2: QKV bias, tied embeddings, GQA 4 heads / 2 groups, odd vocab (TP padding)
    "qwen2": (transformers.Qwen2Config, dict(vocab_size=251, tie_word_embeddings=True)),
    # (b) Llama: no biases, untied output layer, no GQA
    "llama3": (transformers.LlamaConfig, dict(vocab_size=256, tie_word_embeddings=False,
                                              num_key_value_heads=4, rope_theta=500000.0)),
    # Qwen3: per-head QK norm, head_dim (32) different from hidden / heads (16)
    "qwen3": (transformers.Qwen3Config, dict(vocab_size=256, tie_word_embeddings=False, head_dim=32)),
    # Qwen3-MoE: 8 experts, top-2, renormalised routing weights, QK norm, every layer sparse
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(vocab_size=256, tie_word_embeddings=False, head_dim=32,
                                                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
    # Qwen2-MoE: QKV bias, a shared expert behind its sigmoid gate, routing weights not renormalised
    "qwen2_moe": (transformers.Qwen2MoeConfig, dict(vocab_size=256, tie_word_embeddings=False, num_experts=8,
                                                    num_experts_per_tok=2, moe_intermediate_size=32,
                                                    shared_expert_intermediate_size=48, norm_topk_prob=False,
                                                    decoder_sparse_step=1, mlp_only_layers=[])),
    # GLM-4.5: 2 dense layers then experts (4 layers), sigmoid routing with the expert bias over 2 groups of 4
    # experts (one chosen), a routing scale, an un-gated shared expert, QKV bias, half the head rotated
    "glm4_moe": (transformers.Glm4MoeConfig, dict(vocab_size=256, tie_word_embeddings=False, head_dim=32,
                                                  n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                  n_shared_experts=1, first_k_dense_replace=2, n_group=2,
                                                  topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                                  attention_bias=True, partial_rotary_factor=0.5,
                                                  num_nextn_predict_layers=0)),
    # DeepSeek-V3: multi-latent attention (query and key-value latents, values narrower than keys, interleaved
    # rotary pairs under YaRN with DeepSeek's mscale) over GLM-4.5's routing, 2 dense layers then experts
    "deepseek_v3": (transformers.DeepseekV3Config, dict(
        vocab_size=256, tie_word_embeddings=False, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0})),
}


def build_hf_model(kind: str, seed: int = 0, reward_model: bool = False, **overrides) -> transformers.PreTrainedModel:
    """A causal LM, or with `reward_model` a *ForSequenceClassification of one output (pad_token_id 0)."""
    config_cls, extra = KINDS[kind]
    settings = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                    rope_theta=10000.0)
    settings.update(extra)
    if reward_model:
        settings.update(num_labels=1, pad_token_id=0)
    settings.update(overrides)
    config = config_cls(**settings)
    torch.manual_seed(seed)
    auto = transformers.AutoModelForSequenceClassification if reward_model else transformers.AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.1)
            if "norm" in name:
                param.add_(1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a weight of the checkpoint, zero at HF's init
                buffer.normal_(0.0, 0.1)
    return model.eval()


#: the tiny vision-language model's image placeholder and the markers around it (the last ids of its vocabulary)
VL_TOKENS = dict(vision_start_token_id=252, vision_end_token_id=253, image_token_id=254, video_token_id=255)


def build_hf_vl_model(seed: int = 0, tie_word_embeddings: bool = False) -> transformers.PreTrainedModel:
    """A tiny Qwen2.5-VL: head_dim 32 with sections [4, 6, 6]; a two-block vision tower, block 0 windowed over
    56 pixels (2 × 2 merged tokens) and block 1 attending to whole images."""
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(hidden_size=128, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                         bos_token_id=None, eos_token_id=None),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=80, num_heads=2, out_hidden_size=128,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        tie_word_embeddings=tie_word_embeddings, **VL_TOKENS)
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.1)
            if "norm" in name or "ln_q" in name:
                param.add_(1.0)
    return model.eval()


def save_hf_model(model: transformers.PreTrainedModel, folder: Path, dtype: torch.dtype = torch.float32,
                  max_shard_size: str = "60KB") -> Path:
    """Save as sharded safetensors (with index) plus a tokenizer file to copy through; an expert bias in fp32
    whatever `dtype`, as the published checkpoints keep it."""
    model.to(dtype)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.data = buffer.data.float()
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128, "tag": str(folder)}))
    model.to(torch.float32)
    return folder


def checkpoint_state(model: transformers.PreTrainedModel, values: dict[str, torch.Tensor] | None = None,
                     ) -> dict[str, torch.Tensor]:
    """The model's tensors as its checkpoint names them (transformers >= 5 fuses MoE experts in memory and
    splits them again on saving), by saving it; `values` (e.g. gradients, by parameter name) replace the
    parameters in what is saved, so they are named by HF's own conversion too."""
    import copy
    import tempfile

    from safetensors.torch import load_file

    if values is not None:
        model = copy.deepcopy(model)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(values[name])
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        state: dict[str, torch.Tensor] = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            state.update(load_file(path))
    return state


def hf_to_mcore_state(state: dict[str, torch.Tensor], arch) -> dict[str, torch.Tensor]:
    """An HF state dict under the full Megatron names, by the converter's mapping."""
    from mindrl.models import hf_mapping as hfm
    from mindrl.models import sharding

    full = {hfm.EMBEDDING[1]: state[hfm.EMBEDDING[0]], hfm.FINAL_NORM[1]: state[hfm.FINAL_NORM[0]]}
    if arch.has_output_layer:
        full[hfm.OUTPUT[1]] = state[hfm.OUTPUT[0]]
    full.update({mg: state[hf] for hf, mg in hfm.vision_names(arch)})
    for i in range(arch.num_layers):
        layer = {n: state[hfm.hf_layer_prefix(i) + n] for n in hfm.hf_layer_names(arch.layer_arch(i))}
        full.update({hfm.mcore_layer_prefix(i) + n: t
                     for n, t in hfm.hf_to_mcore_layer(layer, arch.layer_arch(i)).items()})
    return {name: full[name] for name in sharding.full_param_shapes(arch)}


def mcore_to_hf_state(full: dict[str, torch.Tensor], arch) -> dict[str, torch.Tensor]:
    """A full (merged) Megatron state dict — weights or gradients — under HF's names, by the converter's mapping."""
    from mindrl.models import hf_mapping as hfm
    from mindrl.models import sharding

    state = {hfm.EMBEDDING[0]: full[hfm.EMBEDDING[1]], hfm.FINAL_NORM[0]: full[hfm.FINAL_NORM[1]]}
    if arch.has_score_head:
        state[hfm.SCORE[0]] = full[hfm.SCORE[1]]
    elif not arch.tied_embeddings:
        state[hfm.OUTPUT[0]] = full[hfm.OUTPUT[1]]
    state.update({hf: full[mg] for hf, mg in hfm.vision_names(arch)})
    for i in range(arch.num_layers):
        layer = {s: full[hfm.mcore_layer_prefix(i) + s] for s in sharding.layer_param_shapes(arch.layer_arch(i))}
        state.update({hfm.hf_layer_prefix(i) + n: t
                      for n, t in hfm.mcore_to_hf_layer(layer, arch.layer_arch(i)).items()})
    return state


def load_converted(root: str):
    """This rank's stage of the model a converted Megatron checkpoint describes, with its weights: (model, arch)."""
    from megatron.core import parallel_state

    from mindrl.checkpoint import megatron as mg
    from mindrl.distributed import init_model_parallel
    from mindrl.models.gpt import build_gpt_model, load_stage_weights

    args = mg.load_args(root)
    arch, par = mg.arch_of(args), mg.parallel_of(args)
    init_model_parallel(par, arch=arch)
    model = build_gpt_model(arch, par)
    ranks = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank())
    load_stage_weights(model, mg.load_rank(root, *ranks, arch, par)["model"])
    return model, arch


def megatron_logits(rank: int, checkpoints: list[str], tokens: torch.Tensor) -> list:
    """The full-vocabulary logits of `tokens` under each converted checkpoint, on the ranks of its last pipeline
    stage (None on the others); every rank of the launch runs this."""
    from mindrl.models.forward import gather_logits, run_microbatches

    results = []
    for root in checkpoints:
        model, arch = load_converted(root)
        captured = []

        def keep(logits, batch, captured=captured):
            captured.append(gather_logits(logits).detach().clone())
            return logits.sum() * 0, {}

        run_microbatches(model, [{"tokens": tokens}], keep, forward_only=True)
        results.append(captured[0][..., :arch.padded_vocab_size] if captured else None)
    return results
