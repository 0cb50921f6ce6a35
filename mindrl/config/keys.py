"""Key checks shared by every config section: unknown keys, MindSpeed-RL keys mindrl refuses.

A key that would be silently ignored is the worst kind of config bug (the run "works" and
trains something else), so each one gets a sentence. `Keys` either raises on the first
problem (mindrl's own configs) or collects every problem (importing a MindSpeed-RL file,
where a user wants the whole list at once).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mindrl.config.errors import ConfigError

_KERNEL = "picks a fused kernel or memory layout, which megatron-core chooses itself here"
_NOT_BUILT = "asks for {}, which mindrl does not build"
_FIXED = "is fixed in mindrl ({})"
_ELSEWHERE = "is a key of {}, not of this section"

# MindSpeed-RL keys that mindrl refuses, with why; any other unknown key is treated as a typo.
MINDSPEED_REASONS: dict[str, str] = {
    **dict.fromkeys((
        "use_fused_rmsnorm", "use_flash_attn", "no_masked_softmax_fusion", "use_fused_swiglu",
        "use_fused_rotary_pos_emb", "no_bias_dropout_fusion", "gemm_gradient_accumulation_fusion",
        "use_ascend_coc", "coc_mode", "coc_parallel_num", "coc_fused_kernel", "shape_order", "reuse_fp32_param",
        "swap_attention", "overlap_grad_reduce", "overlap_param_gather", "ddp_bucket_size",
        "moe_alltoall_overlap_comm", "transformer_impl", "lora_fusion"), _KERNEL),
    "num_layers_per_virtual_pipeline_stage": _NOT_BUILT.format("virtual pipeline stages"),
    **dict.fromkeys(("lora_target_modules", "lora_r", "lora_alpha", "lora_ckpt_filter"),
                    _ELSEWHERE.format("the Megatron sections (megatron_training or a role's, docs/lora.md)")),
    "share_backbone": _ELSEWHERE.format("rl_config or dpo_config (docs/lora.md)"),
    "use_remove_padding": _ELSEWHERE.format("rl_config (docs/long_responses.md)"),
    "use_dynamic_bsz": _ELSEWHERE.format("rl_config (docs/long_responses.md)"),
    "attention_dropout": _FIXED.format("no dropout in RL training"),
    "hidden_dropout": _FIXED.format("no dropout in RL training"),
    "init_method_std": _FIXED.format("weights always come from a checkpoint or a seeded init"),
    "distributed_backend": _FIXED.format("the platform picks nccl, hccl or gloo"),
    "tokenizer_type": _FIXED.format("the tokenizer is always a Hugging Face one"),
    "split": _FIXED.format("cli/preprocess_data.py writes separate train and test files"),
    "full_shuffle_instruction_dataset": _FIXED.format("prompts are shuffled per epoch unless no_shuffle"),
    "no_shared_storage": _FIXED.format("checkpoints go to a shared `save` directory"),
    "guarantee_order": _FIXED.format("experience is always consumed in order"),
    "blocking": _FIXED.format("every stage waits for the previous one"),
    "log_max_throughput": _FIXED.format("throughput is logged from mean lengths"),
    "beta": "is never read by MindSpeed-RL's GRPO loss; set init_kl_coef instead",
    "advantage_whiten": "is never read by MindSpeed-RL; pick the behaviour with adv_estimator",
    "num_samples_per_step": "is never read by MindSpeed-RL",
    "tp_split_expert": "is never read by MindSpeed-RL",
    "hccl_buffersize": _FIXED.format("the platform sets communication buffers"),
    "runtime_env_path": _FIXED.format("workers inherit the driver's environment"),
    "num_cpus_for_placement_group": _FIXED.format("each rank gets one CPU"),
    "async_engine": "asks for vLLM's asynchronous engine, which mindrl does not use: multi-turn rollouts batch "
                    "each turn across the samples without it (docs/multi_turn.md)",
    "is_multimodal": _FIXED.format("a model is multimodal when its model yaml has a vision tower, docs/vision.md"),
    "msprobe_config": _NOT_BUILT.format("the Ascend msprobe tool"),
    "zmq_communication": _FIXED.format("a role's ranks get their batches through Ray's object store"),
    "is_pairwise_dataset": _FIXED.format("DPO's data is always chosen/rejected pairs, as cli/preprocess_data.py writes "
                                         "them"),
    "tokenizer_not_use_fast": _FIXED.format("the tokenizer is its directory's own, the fast one where it has one"),
    "log_interval": _FIXED.format("every step is logged"),
    "initial_loss_scale": _FIXED.format("training is bf16 or fp32, which scale no loss"),
    "refer_model_iter": _FIXED.format("the reference is ref_model's latest checkpoint, or the starting weights"),
    **dict.fromkeys(("eval_interval", "eval_iters"),
                    _FIXED.format("the held-out split is scored every test_interval steps of rl_config, sft_config or "
                                  "dpo_config")),
    "profiler_config": "traces the RL trainers' phases (docs/profiling.md), not SFT's or DPO's",
    **dict.fromkeys((
        "actor_rollout_dispatch_size", "actor_logprob_dispatch_size", "ref_dispatch_size", "reward_dispatch_size",
        "adv_dispatch_size", "actor_update_dispatch_size", "dynamic_sampling_dispatch_size"),
        _FIXED.format("every stage takes the whole batch, split over its data-parallel ranks")),
}


#: the MindSpeed-RL keys an importer may leave out: kernel choices, behaviour mindrl fixes, keys MindSpeed-RL never
#: reads. Leaving out any other (a feature mindrl does not build, a key in the wrong section, a typo) would train
#: something else than the recipe says.
DROPPABLE = frozenset(key for key, reason in MINDSPEED_REASONS.items()
                      if reason == _KERNEL or reason.startswith(("is fixed in mindrl", "is never read"))
                      or key == "async_engine")


def normalise(values: Mapping[str, Any]) -> dict[str, Any]:
    """MindSpeed-RL accepts `min-lr` for `min_lr`; so does mindrl."""
    return {str(key).replace("-", "_"): value for key, value in values.items()}


@dataclass(frozen=True)
class KeyNote:
    """A key mindrl does not take: the section it was written in, the sentence saying why, the key itself (empty
    where the sentence is about a value rather than one key), and whether an importer may leave it out (DROPPABLE)."""

    section: str
    sentence: str
    key: str = ""
    droppable: bool = False


class Keys:
    """Where key problems go: raised at once (`notes is None`) or appended to `notes`.

    `only` limits unknown-key reports to those keys (the rest were reported by another section).
    """

    def __init__(self, notes: list[KeyNote] | None = None, only: set[str] | None = None) -> None:
        self.notes, self.only = notes, only

    def problem(self, section: str, message: str, key: str = "", droppable: bool = False) -> None:
        if self.notes is None:
            raise ConfigError(message)
        self.notes.append(KeyNote(section, message, key, droppable))

    def unknown(self, section: str, key: str, known: Iterable[str], value: Any = True) -> None:
        """`value` turned off (false, null) leaves out nothing even where the key is a feature mindrl lacks."""
        if self.only is not None and key not in self.only:
            return
        droppable = key in DROPPABLE or (key in MINDSPEED_REASONS and value in (False, None))
        self.problem(section, unknown_key_message(section, key, known), key, droppable)

    def split(self, section: str, values: Mapping[str, Any], known: Iterable[str]) -> dict[str, Any]:
        """The known keys of `values`; every other key is a problem."""
        known = set(known)
        kept = {}
        for key, value in normalise(values).items():
            if key in known:
                kept[key] = value
            else:
                self.unknown(section, key, known, value)
        return kept


def unknown_key_message(section: str, key: str, known: Iterable[str]) -> str:
    """One sentence: the reason for a refused MindSpeed-RL key, else the closest valid name."""
    where = f"{section}.{key}" if section else key
    if key in MINDSPEED_REASONS:
        return f"{where} {MINDSPEED_REASONS[key]}; remove it (see docs/config.md)."
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = (f"did you mean {close[0]!r}?" if close
            else f"docs/config.md lists the keys of {section or 'a trainer config'}.")
    return f"{section or 'the trainer config'} has unknown key {key!r}; {hint}"


def unsupported_keys_message(notes: Sequence[KeyNote], also: str | None = None) -> str:
    """Every key problem of a config in one message, grouped by section in the order they were met (one
    problem alone is its own sentence); `also` is the error that stopped the loading after them."""
    sentences = list(dict.fromkeys(notes))
    if len(sentences) == 1 and also is None:
        return sentences[0].sentence
    lines = [f"{len(sentences)} keys of this config are not supported; nothing was started:"]
    for section in dict.fromkeys(note.section for note in sentences):
        lines.append(f"{section or 'top level'}:")
        lines.extend(f"  {note.sentence}" for note in sentences if note.section == section)
    if also is not None:
        lines.append(f"and then: {also}")
    return "\n".join(lines)
