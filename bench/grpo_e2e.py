"""Whole GRPO steps of cli/train_grpo.py against the machine's own matmul rate and against TRL (and PPO steps
of cli/train_ppo.py on the same shape).

    python bench/grpo_e2e.py [--steps 3] [--models tiny,small,tiny_moe,tiny_vl] [--dtypes fp32,bf16] [--no-trl]
                             [--prompt-packing auto|false] [--prefix-caching true|false]
                             [--rollout-backend vllm|megatron] [--algorithms grpo,ppo]
                             [--rollout-modes colocated,sync,one_step_off_policy,streaming]

For grpo_tiny_cpu and grpo_small_cpu (and, with `tiny_moe` in --models, grpo_tiny_moe_cpu: 8 experts, top-2, EP=2,
FLOPs counting the active parameters only; with `tiny_vl`, grpo_tiny_vl_cpu from random weights on the shape-image
prompts, 32 new tokens, the vision tower's FLOPs counted) at 16 prompts × 8 samples, 64 (tiny, tiny_moe) / 128
(small) new tokens, lr 1e-5, KL 0.04 against a reference model, two CPU ranks, in fp32 and in bf16 mixed
precision (bf16 weights and engine, fp32 main params and gradients): e2e tokens/s (prompt +
response tokens of every sample over the step's seconds, whole machine), seconds per stage,
and achieved GFLOP/s, for the step and for each stage that computes — the matmul FLOPs of the
rollout, the reference pass, the old-log-prob pass when it runs, and the update's forward and
backward (where the actor packed a prompt's samples behind one copy of it, `actor/prompt_packed`,
that prompt counts once, and so do the whole KV blocks of its prefill where the engine caches
prefixes) — beside a plain matmul's GFLOP/s in the same precision on the same two cores, measured
right before and right after each configuration (the higher of the two counts: the machine's speed
drifts on a shared host). Each configuration runs the real trainer in a fresh process; the first step
(engine warm-up) is left out of the means.
Beside each, Hugging Face TRL's GRPOTrainer on the same shape, prompts, rewards and batch
(bench/trl_grpo.py; TRL is installed into .bench-trl/ on first use, not into the project's
environment), and the ratio of the two e2e rates. Updates run in micro-batches of 16 samples
(the forward passes too). With `ppo` in --algorithms the same configuration also runs as PPO
(adv_estimator gae, a critic in the actor's processes, lr 5e-4) under `<model>_<dtype>_ppo`: its
critic stages (`values`: a forward; `update_critic`: forward and backward, of the trunk and a one-output
head, prompts packed as the critic's update packed them) count in its FLOPs, and `vs_grpo` is its e2e
rate over GRPO's (TRL's side is GRPO's only). With --rollout-modes each model and dtype also runs under
`<model>_<dtype>_<mode>`: `colocated` is the default placement; the others put the vLLM engine on one of the two
cores (rollout_resource) and the actor on the other, in rl_config.rollout_mode `sync`, `one_step_off_policy` or
`streaming` (max_staleness 2, partial_rollout_max_split 4), each reported with its step time, tokens/s and each role's
idle share (docs/async_rollout.md). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from rollout import _matmul, flops_per_request  # noqa: E402  (the sibling benchmark's FLOP model)

from mindrl.config import ModelArch, load_model_arch  # noqa: E402
from mindrl.launch import run_ranks  # noqa: E402
from mindrl.models.flops import forward_flops, vision_flops  # noqa: E402
from mindrl.rollout.config import GenerateConfig  # noqa: E402

NEW_TOKENS = {"tiny": 64, "small": 128, "tiny_moe": 64, "tiny_vl": 32}
#: each --models name's architecture (its config is grpo_<name>_cpu)
ARCHS = {"tiny": "tiny_qwen", "small": "small_qwen", "tiny_moe": "tiny_qwen3_moe", "tiny_vl": "tiny_qwen25_vl"}
MICRO_BATCH = 16
VLLM_CPU_BLOCK = 128  # vLLM-CPU's KV block size: prefix caching shares whole blocks
TRL_DIR = ROOT / ".bench-trl"
TRL_PACKAGES = ("trl==1.16.0", "accelerate==1.15.0", "datasets==5.2.0", "multiprocess==0.70.19", "dill==0.4.1",
                "pandas==3.1.1", "python-dateutil==4.0.0", "tzdata==2026.6", "xxhash==4.1.0")
STAGES = ("rollout", "reference_model", "old_log_p", "rule_reward", "adv", "update", "resharding_to_infer",
          "resharding_to_train", "values", "update_critic")
#: the models bench/trl_grpo.py builds (TRL's side of the tiny MoE and the vision-language model is not run)
TRL_MODELS = ("tiny", "small")
#: what turns a GRPO configuration into PPO with a critic beside the actor
PPO_OVERRIDES = {"megatron_training.stage": "ray_ppo", "rl_config.adv_estimator": "gae", "critic_config.lr": 5e-4,
                 "critic_config.micro_batch_size": MICRO_BATCH}


def _data(folder: Path, vision: bool = False) -> tuple[Path, Path]:
    """The tiny tokenizer and the synthetic-math prompts, or for a vision-language model the shape-image task's."""
    name = "shapes" if vision else "math"
    tokenizer, data = folder / f"{name}_tokenizer", folder / name
    python = sys.executable
    task = ["--task", "shapes", "--vision-tokens"] if vision else []
    subprocess.run([python, str(ROOT / "cli" / "build_tiny_tokenizer.py"), "--out", str(tokenizer), *task],
                   check=True, capture_output=True)
    subprocess.run([python, str(ROOT / "cli" / "preprocess_data.py"), "--config-name",
                    "shapes" if vision else "synthetic_math", f"output_dir={data}",
                    f"tokenizer_name_or_path={tokenizer}"], check=True, capture_output=True)
    return tokenizer, data


def _image_flops(model: str, data: Path) -> float:
    """One prompt's images through the vision tower (every shape-task prompt holds one image of the same grid)."""
    arch = load_model_arch(ARCHS[model])
    if arch.vision is None:
        return 0.0
    grids = pq.read_table(data / "train.parquet", columns=["image_grid_thw"]).column(0)[0].as_py()
    return sum(vision_flops(arch, tuple(grid)) for grid in grids)


#: what each --rollout-modes name sets beyond the shipped configuration (colocated: nothing)
MODE_OVERRIDES = {
    "colocated": {},
    **{mode: {"rl_config.actor_resource.num_cpus": 1, "rl_config.rollout_resource.num_cpus": 1,
              "rl_config.rollout_mode": mode, "rl_config.max_staleness": 2,
              "rl_config.partial_rollout_max_split": 4 if mode == "streaming" else 1}
       for mode in ("sync", "one_step_off_policy", "streaming")}}


def _train(model: str, dtype: str, steps: int, tokenizer: Path, data: Path, out: Path,
           packing: str, prefix_caching: str | None, backend: str | None, algorithm: str = "grpo",
           extra: dict | None = None) -> list[dict]:
    bf16 = dtype == "bf16"
    overrides = {"rl_config.prompt_packing": packing,
        "megatron_training.tokenizer_name_or_path": tokenizer, "megatron_training.data_path": data,
        "megatron_training.global_batch_size": 16, "megatron_training.train_iters": steps,
        "megatron_training.save": out, "megatron_training.save_interval": 0, "megatron_training.bf16": bf16,
        "actor_config.lr": 1e-5, "rl_config.n_samples_per_prompt": 8, "rl_config.mini_batch_size": 16,
        "rl_config.init_kl_coef": 0.04, "rl_config.test_interval": 0, "rl_config.use_tensorboard": False,
        "rl_config.overlong_buffer_enable": False, "rl_config.rollout_max_tokens": NEW_TOKENS[model],
        "generate_config.dtype": "bfloat16" if bf16 else "float32", "generate_config.max_num_seqs": 128,
        "actor_config.micro_batch_size": MICRO_BATCH, "rl_config.ref_forward_micro_batch_size": MICRO_BATCH,
        "generate_config.sampling_config.max_tokens": NEW_TOKENS[model]}
    if prefix_caching is not None:
        overrides["generate_config.enable_prefix_caching"] = prefix_caching
    if backend is not None:
        overrides["generate_config.backend"] = backend
    if algorithm == "ppo":
        overrides.update(PPO_OVERRIDES)
    overrides.update(extra or {})
    if load_model_arch(ARCHS[model]).vision is not None:
        overrides["actor_config.load"] = "null"  # random weights, like the text models: no SFT stage first
    args = [f"{'' if key in _FILE_KEYS[model] else '+'}{key}={value}" for key, value in overrides.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    run = subprocess.run([sys.executable, str(ROOT / "cli" / f"train_{algorithm}.py"), "--config-name",
                          f"grpo_{model}_cpu", *args], env=env, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"grpo_{model}_cpu {dtype} ({algorithm}) failed:\n{run.stdout[-3000:]}\n"
                           f"{run.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _file_keys(shipped: dict) -> set[str]:
    """Dotted keys the config file has (the rest need Hydra's leading +)."""
    def walk(prefix: str, node: object) -> set[str]:
        if not isinstance(node, dict):
            return {prefix}
        return {k for key, value in node.items() for k in walk(f"{prefix}.{key}" if prefix else key, value)}

    return walk("", shipped)


_SHIPPED = {model: yaml.safe_load((ROOT / "configs" / "rlxf" / f"grpo_{model}_cpu.yaml").read_text())
            for model in NEW_TOKENS}
_FILE_KEYS = {model: _file_keys(shipped) for model, shipped in _SHIPPED.items()}


def run_trl(script: str, args: list[str], what: str) -> dict:
    """The JSON line that bench/<script> prints, run with TRL (installed into .bench-trl/ on first use) on two
    threads; `what` names the run in the error if it fails."""
    if not (TRL_DIR / "trl").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(TRL_DIR),
                        *TRL_PACKAGES], check=True)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(TRL_DIR)}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], env=env, capture_output=True,
                         text=True)
    if run.returncode:
        raise RuntimeError(f"TRL {what} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _trl(model: str, dtype: str, steps: int, tokenizer: Path, data: Path) -> dict:
    """TRL's e2e tokens/s on the same work, from its second step."""
    out = run_trl("trl_grpo.py", ["--model", model, "--dtype", dtype, "--data", str(data), "--tokenizer",
                                  str(tokenizer), "--steps", str(steps)], f"{model} {dtype}")
    seconds = sum(out["step_s"][1:]) / (len(out["step_s"]) - 1)
    response = sum(out["completion_len"][1:]) / (len(out["completion_len"]) - 1)
    return {"e2e_tokens_per_s": round(16 * 8 * (out["prompt_len"] + response) / seconds, 1),
            "step_s": round(seconds, 2), "response_len": round(response, 1)}


def _pass_flops(arch: ModelArch, prompts: int, n: int, prompt: int, response: int, packed: float) -> float:
    """One forward over the batch: each sample's whole sequence, or where packed, each prompt once and
    each response attending to it (the work a variable-length kernel would do)."""
    plain = prompts * n * flops_per_request(arch, prompt + response, 0)
    shared = prompts * (forward_flops(arch, prompt, prompt * (prompt + 1) / 2)
                        + n * forward_flops(arch, response, response * prompt + response * (response + 1) / 2))
    return packed * shared + (1 - packed) * plain


def _shared_prefill(model: str, args: argparse.Namespace) -> Callable[[int], int]:
    """How many of a prompt's tokens the runs' engine prefills once for all its samples: the Megatron engine
    the whole prompt; vLLM, with prefix caching (as asked, or as the config ships), its whole KV blocks."""
    shipped = _SHIPPED[model]["generate_config"]
    if (args.rollout_backend or shipped.get("backend", GenerateConfig.backend)) == "megatron":
        return lambda prompt: prompt
    caching = args.prefix_caching == "true" if args.prefix_caching is not None else bool(
        shipped.get("enable_prefix_caching", GenerateConfig.enable_prefix_caching))
    return lambda prompt: (prompt - 1) // VLLM_CPU_BLOCK * VLLM_CPU_BLOCK if caching else 0


def _summary(model: str, lines: list[dict], shared_prefill: Callable[[int], int], image_flops: float = 0.0) -> dict:
    """Means over the timed steps, and the FLOPs of each stage; a prompt's images (`image_flops` through the tower)
    count once per prompt in the rollout (the least an engine can do) and once per sample in every other pass."""
    arch = load_model_arch(ARCHS[model])
    timed = lines[1:] or lines
    mean = {key: sum(line.get(key) or 0.0 for line in timed) / len(timed) for key in timed[0]}
    prompts, n = 16, 8
    samples = prompts * n
    prompt, response = mean["prompt_length/mean"], mean["response_length/mean"]
    packed = mean.get("actor/prompt_packed", 0.0)
    rollout = samples * flops_per_request(arch, round(prompt), round(response))
    shared = shared_prefill(round(prompt))  # prefilled once per prompt, the rest of the prompt per sample
    rollout -= (samples - prompts) * forward_flops(arch, shared, shared * (shared + 1) / 2)
    # one forward over a whole sequence costs what the engine's prefill of it does
    forward = _pass_flops(arch, prompts, n, round(prompt), round(response), packed)
    forward += samples * image_flops
    stage_flops = {"rollout": rollout + prompts * image_flops, "reference_model": forward,
                   "old_log_p": (1 - mean["old_log_p/from_update"]) * forward, "update": 3 * forward}
    if "timing/values" in mean:  # PPO's critic: the trunk and a one-output head, packed where its update packed
        critic = _pass_flops(dataclasses.replace(arch, num_labels=1), prompts, n, round(prompt), round(response),
                             mean.get("critic/prompt_packed", 0.0))
        stage_flops.update(values=critic, update_critic=3 * critic)
    flops = sum(stage_flops.values())
    seconds = mean["timing/all"]
    return {"e2e_tokens_per_s": round(samples * (prompt + response) / seconds, 1),
            "e2e_tps_per_rank": round(mean["e2e_tps"], 1), "step_s": round(seconds, 2),
            "stage_s": {stage: round(mean.get(f"timing/{stage}", 0.0), 3) for stage in STAGES},
            "gflops": round(flops / seconds / 1e9, 1),
            "stage_gflops": {stage: round(f / mean[f"timing/{stage}"] / 1e9, 1)
                             for stage, f in stage_flops.items() if f and mean.get(f"timing/{stage}")},
            "prompt_len": round(prompt, 1),
            "response_len": round(response, 1), "old_log_p_skipped": bool(mean["old_log_p/from_update"]),
            "prompt_packed": packed}


def _mode_summary(model: str, lines: list[dict], shared_prefill: Callable[[int], int]) -> dict:
    """A rollout mode's step time, tokens/s, phase times and each role's idle share (colocated: the engines are idle
    while the actor trains and the actor while they generate, so each idles for the other's share of the step)."""
    summary = _summary(model, lines, shared_prefill)
    timed = lines[1:] or lines
    mean = {key: sum(line.get(key) or 0.0 for line in timed) / len(timed) for key in timed[0]}
    step = mean["timing/all"]
    generate = mean.get("rollout/generate_seconds", 0.0)
    keep = ("e2e_tokens_per_s", "step_s", "stage_s", "response_len")
    trainer_idle = mean.get("async/trainer_idle_share", mean.get("timing/rollout", 0.0) / step)
    return {**{key: summary[key] for key in keep}, "generate_s": round(generate, 2),
            "trainer_idle_share": round(trainer_idle, 3),
            "rollout_idle_share": round(mean.get("async/rollout_idle_share", 1 - generate / step), 3),
            "staleness_mean": round(mean.get("async/staleness_mean", 0.0), 3),
            "dropped_groups": mean.get("async/dropped_groups_total", 0.0)}


def _against(measured: dict, matmul: float) -> dict:
    """The summary with the step's and each stage's share of the plain matmul rate."""
    measured["matmul_gflops"] = round(matmul, 1)
    measured["share_of_matmul"] = round(measured["gflops"] / matmul, 2)
    measured["stage_share"] = {stage: round(g / matmul, 2) for stage, g in measured["stage_gflops"].items()}
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--no-trl", action="store_true", help="leave out TRL's side")
    parser.add_argument("--prompt-packing", default="auto", choices=["auto", "false"],
                        help="rl_config.prompt_packing of the runs (default auto, as the configs ship)")
    parser.add_argument("--prefix-caching", choices=["true", "false"],
                        help="generate_config.enable_prefix_caching of the runs (default: as the configs ship)")
    parser.add_argument("--rollout-backend", choices=["vllm", "megatron"],
                        help="generate_config.backend of the runs (default: as the configs ship)")
    parser.add_argument("--algorithms", default="grpo", help="grpo, and ppo for the same runs with a critic (GAE)")
    parser.add_argument("--rollout-modes", default="",
                        help="also run each of colocated, sync, one_step_off_policy, streaming (docs/async_rollout.md)")
    args = parser.parse_args()
    result: dict = {"bench": "grpo_e2e", "prompts": 16, "samples": 8, "threads": 2,
                    "prompt_packing": args.prompt_packing, "prefix_caching": args.prefix_caching or "as shipped",
                    "rollout_backend": args.rollout_backend or "as shipped"}
    with tempfile.TemporaryDirectory(prefix="mindrl-bench-") as tmp:
        for model in args.models.split(","):
            tokenizer, data = _data(Path(tmp), vision=load_model_arch(ARCHS[model]).vision is not None)
            image_flops = _image_flops(model, data)
            for dtype in args.dtypes.split(","):
                before = run_ranks(_matmul, 1, dtype, 2)[0]
                lines = _train(model, dtype, args.steps, tokenizer, data, Path(tmp) / f"{model}_{dtype}",
                               args.prompt_packing, args.prefix_caching, args.rollout_backend)
                matmul = max(before, run_ranks(_matmul, 1, dtype, 2)[0])
                measured = _against(_summary(model, lines, _shared_prefill(model, args), image_flops), matmul)
                if not args.no_trl and model in TRL_MODELS:
                    trl = _trl(model, dtype, 2, tokenizer, data)  # no warm-up to leave out: 2 steps
                    measured["trl"] = trl
                    measured["vs_trl"] = round(measured["e2e_tokens_per_s"] / trl["e2e_tokens_per_s"], 2)
                result[f"{model}_{dtype}"] = measured
                if "ppo" in args.algorithms.split(","):
                    lines = _train(model, dtype, args.steps, tokenizer, data, Path(tmp) / f"{model}_{dtype}_ppo",
                                   args.prompt_packing, args.prefix_caching, args.rollout_backend, "ppo")
                    matmul = max(matmul, run_ranks(_matmul, 1, dtype, 2)[0])
                    ppo = _against(_summary(model, lines, _shared_prefill(model, args), image_flops), matmul)
                    ppo["vs_grpo"] = round(ppo["e2e_tokens_per_s"] / measured["e2e_tokens_per_s"], 2)
                    result[f"{model}_{dtype}_ppo"] = ppo
                for mode in filter(None, args.rollout_modes.split(",")):
                    lines = _train(model, dtype, args.steps, tokenizer, data, Path(tmp) / f"{model}_{dtype}_{mode}",
                                   args.prompt_packing, args.prefix_caching, args.rollout_backend,
                                   extra=MODE_OVERRIDES[mode])
                    result[f"{model}_{dtype}_{mode}"] = _mode_summary(model, lines, _shared_prefill(model, args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
