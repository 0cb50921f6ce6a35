"""GRPO with LoRA adapters end to end (configs/rlxf/grpo_tiny_lora_cpu.yaml, issue 47): the merged weights the
engines get after every sync (vLLM-CPU at infer TP=2, and the Megatron-native engine, which is the actor's own
model), an adapters-only checkpoint, and a SIGKILL-and-resume equal to an unbroken run; and the one-sentence
refusals of LoRA's settings, before any worker starts."""

import math
from pathlib import Path

import pytest
import torch

from mindrl.checkpoint import megatron as mg
from mindrl.config import ConfigError
from mindrl.trainer.config import load_trainer_config
from mindrl.trainer.dpo_config import load_dpo_config
from tests import jobs

CONFIG = "grpo_tiny_lora_cpu"

#: the unbroken run: 8 prompts (2 steps an epoch), 4 steps, a checkpoint every step, the engine's weights checked
#: after every sync, fp32 (jobs.grpo_overrides), vLLM at TP=2 over the two actor ranks, the training state offloaded
REFERENCE = {"megatron_training.train_iters": 4, "megatron_training.save_interval": 1, "rl_config.test_interval": 0,
             "+generate_config.check_weight_sync": "true", "generate_config.infer_tensor_parallel_size": 2,
             # the training state leaves the ranks while the engines generate: the frozen base copied to the host
             # once, the adapters, their gradients and optimizer state every time, and back in time for the sync
             "+generate_config.offload_train_param": "true", "+generate_config.offload_train_grad": "true",
             "+generate_config.offload_train_optimizer": "true"}
#: what an fp32 engine and actor may differ by, on the probe and on the rollouts' log-probs
FP32 = 1e-4


def _overrides(tiny_math_data, save: Path, **extra: object) -> list[str]:
    tokenizer, root = tiny_math_data
    return jobs.grpo_overrides(tokenizer, root / "eight", save, **{**REFERENCE, **extra})


@pytest.fixture(scope="module")
def reference_run(tiny_math_data, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lora_reference")
    jobs.run("train_grpo.py", CONFIG, _overrides(tiny_math_data, folder / "run"), folder / "log")
    return folder / "run"


def _finite_learning_metrics(line: dict) -> None:
    for name in ("grpo/score/mean", "actor/pg_loss", "actor/kl_loss", "grad_norm"):
        assert math.isfinite(line[name]), f"step {line['step']}: {name} = {line[name]}"


@pytest.mark.job
def test_lora_grpo_syncs_merged_weights_into_vllm_at_tp2(reference_run):
    """After every sync the TP=2 vLLM engines score the probe sequence as the actor (adapters on) does, to fp32
    rounding, and the rollouts' log-probs agree with the actor's."""
    lines = jobs.metrics(reference_run / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    for line in lines:
        assert line["sync/probe_max_abs_diff"] <= FP32, line
        assert line["sync/differing_tensors"] == 0
        assert line["rollout_is/abs_log_prob_diff_mean"] < FP32
        _finite_learning_metrics(line)
    # the adapters learn: the policy the engines sample from moves away from the base, which the KL sees
    assert lines[-1]["actor/kl_loss"] > 0


@pytest.mark.job
def test_lora_checkpoints_hold_the_adapters_only_and_the_base_digest(reference_run):
    for folder in sorted((reference_run / mg.iteration_dir_name(4)).glob("mp_rank_*")):
        contents = torch.load(folder / mg.RANK_FILE, map_location="cpu", weights_only=True)
        names = list(contents["model"])
        assert names and all(".adapter." in name for name in names), [n for n in names if ".adapter." not in n]
        # every targeted layer of the 4-layer tiny model: A and B on linear_qkv, linear_proj, linear_fc1, linear_fc2
        assert len(names) == 4 * 4 * 2
        lora = contents["lora"]
        assert (lora["r"], lora["alpha"], lora["adapters_only"]) == (8, 16.0, True)
        assert sorted(lora["target_modules"]) == ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]
        assert isinstance(lora["base_digest"], str) and len(lora["base_digest"]) == 32


@pytest.mark.job
def test_lora_grpo_with_the_megatron_engine(tiny_math_data, tmp_path):
    """The Megatron-native engine is the actor's own model at its TP=2 (adapters on, their side path in plain TP for
    decoding; nothing synced, so no probe runs): its sampling log-probs equal the actor's to fp32 rounding at every
    step."""
    save = tmp_path / "run"
    jobs.run("train_grpo.py", CONFIG, _overrides(tiny_math_data, save, **{
        "megatron_training.train_iters": 2, "megatron_training.save_interval": 0,
        "actor_config.tensor_model_parallel_size": 2, "generate_config.backend": "megatron",
        "generate_config.infer_tensor_parallel_size": 2}), tmp_path / "log")
    lines = jobs.metrics(save / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert "sync/probe_max_abs_diff" not in line
        assert line["rollout_is/abs_log_prob_diff_mean"] < FP32, line
        _finite_learning_metrics(line)


@pytest.mark.job
def test_lora_sigkill_after_checkpoint_2_then_resume_equals_the_unbroken_run(tiny_math_data, reference_run, tmp_path):
    """The whole job killed once checkpoint 2 (adapters only) is complete; resumed, it puts them back on the same
    base and every step's metrics equal the unbroken run's."""
    cut, log = tmp_path / "cut", tmp_path / "log"
    job = jobs.start("train_grpo.py", CONFIG, _overrides(tiny_math_data, cut), log)
    jobs.kill_when(job, lambda: (cut / mg.TRACKER).is_file() and mg.read_tracker(cut) == 2, log)
    assert mg.read_tracker(cut) in (2, 3)
    resumed = mg.read_tracker(cut)
    jobs.run("train_grpo.py", CONFIG, _overrides(tiny_math_data, cut, **{"actor_config.load": cut}), log)
    assert f"at iteration {resumed}" in log.read_text()
    expected, got = jobs.metrics(reference_run / "metrics.jsonl"), jobs.metrics(cut / "metrics.jsonl")
    assert [line["step"] for line in got] == [1, 2, 3, 4]
    assert jobs.run_values(got) == jobs.run_values(expected)


# the refusals: one sentence each, before any worker starts

LORA = "actor_config.lora_target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]"


def _refusal(overrides: list[str], config: str = "grpo_tiny_cpu", load=load_trainer_config) -> str:
    with pytest.raises(ConfigError) as err:
        load(config, overrides)
    return str(err.value)


def test_share_backbone_needs_adapters():
    assert _refusal(["+rl_config.share_backbone=true"]) == (
        "rl_config.share_backbone: true makes the reference the actor with its LoRA adapters off, but actor_config "
        "sets no lora_target_modules; add adapters or turn share_backbone off.")


def test_share_backbone_needs_the_integrated_worker():
    message = _refusal(["rl_config.use_integrated_worker=false", "+rl_config.reference_resource={num_cpus: 2}"],
                       CONFIG)
    assert message == (
        "rl_config.share_backbone: true makes the actor its own reference (no second model), so no reference runs "
        "on devices of its own; set use_integrated_worker: true or turn share_backbone off.")


def test_lora_fusion_is_a_kernel_choice():
    """MindSpeed's fused LoRA kernels compute what the two small matmuls do: a kernel key like use_flash_attn."""
    assert _refusal(["+actor_config.lora_fusion=true"], CONFIG) == (
        "actor_config.lora_fusion picks a fused kernel or memory layout, which megatron-core chooses itself here; "
        "remove it (see docs/config.md).")


def test_an_hf_module_name_is_refused_with_its_megatron_name():
    assert _refusal(["actor_config.lora_target_modules=[q_proj,linear_proj]"], CONFIG) == (
        "actor_config.lora_target_modules names 'q_proj', which mindrl's Megatron model does not have; pick from "
        "linear_qkv, linear_proj, linear_fc1, linear_fc2; HF's q_proj is linear_qkv here.")


def test_dpo_share_backbone_needs_adapters():
    assert _refusal(["+dpo_config.share_backbone=true"], "dpo_facts_cpu", load_dpo_config) == (
        "dpo_config.share_backbone: true makes the reference the actor with its LoRA adapters off, but "
        "megatron_training sets no lora_target_modules; add adapters or turn share_backbone off.")


def test_dpo_share_backbone_with_a_ref_model_is_refused():
    lora = "+megatron_training.lora_target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]"
    assert _refusal(["+dpo_config.share_backbone=true", lora, "+dpo_config.ref_model=ckpt/ref"], "dpo_facts_cpu",
                    load_dpo_config) == (
        "dpo_config.share_backbone: true makes the reference the actor's own base, but ref_model (ckpt/ref) names "
        "another; remove one of them.")


def test_the_lora_configs_load_with_their_adapters():
    tiny = load_trainer_config(CONFIG)
    assert tiny.rl_config.share_backbone and tiny.actor_config.lora.ckpt_filter
    assert (tiny.actor_config.lora.r, tiny.actor_config.lora.scale) == (8, 2.0)
    big = load_trainer_config("grpo_qwen25_32b_lora")
    assert big.rl_config.share_backbone and big.actor_config.lora.ckpt_filter
    assert (big.actor_config.lora.r, big.actor_config.lora.alpha) == (128, 256.0)
    assert sorted(big.actor_config.lora.target_modules) == ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]


@pytest.mark.job
def test_an_adapters_only_run_from_random_weights_ends_without_an_hf_export(reference_run):
    """The end of the run: its adapters-only checkpoint has no base checkpoint to merge into (the base was drawn
    from the seed), so one line says so and the run ends well instead of failing on what it has just written.
    (A run from a base checkpoint exports merged weights and the PEFT folder: tests/test_lora_export.py.)"""
    log = (reference_run.parent / "log").read_text()
    assert (f"final weights not exported to HF: {reference_run} holds LoRA adapters only and the run started from "
            f"random weights, so there is no base checkpoint to merge them into") in log
    assert not (reference_run / "hf").exists()


@pytest.mark.job
def test_a_lora_checkpoint_that_does_not_fit_is_one_sentence_before_ray_starts(tiny_math_data, reference_run):
    """The driver reads the checkpoint's LoRA record: resuming it without its adapters, or starting a new run from
    adapters that lack their base, is refused before any worker is built."""
    from mindrl.trainer.start import JOB_GRPO, start_point

    plain = load_trainer_config("grpo_tiny_cpu", [f"actor_config.load={reference_run}"]).actor_config
    with pytest.raises(ConfigError) as err:
        start_point(plain, JOB_GRPO)
    assert str(err.value) == (
        f"actor_config.load: checkpoint {reference_run} iteration 4 was trained with LoRA r=8 alpha=16 on "
        f"linear_fc1, linear_fc2, linear_proj, linear_qkv but the model has no adapters; set lora_target_modules, "
        f"lora_r and lora_alpha as the checkpoint's (an adapters-only checkpoint resumes with them only).")
    fresh = load_trainer_config(CONFIG, [f"actor_config.load={reference_run}", "+actor_config.finetune=true"])
    with pytest.raises(ConfigError, match="holds LoRA adapters without their base weights, so a run cannot start"):
        start_point(fresh.actor_config, JOB_GRPO)
    assert start_point(load_trainer_config(CONFIG, [f"actor_config.load={reference_run}"]).actor_config,
                       JOB_GRPO).iteration == 4
