"""Multi-turn GRPO end to end (issue 45): a short SFT on tool-using trajectories, then GRPO with the agent loop
and the sandboxed python tool (configs/rlxf/grpo_tools_cpu.yaml) — calls made and run, the engine's log-probs of
the model's tokens equal to the actor's across the tool turns, validation multi-turn too, a SIGKILL-and-resume
equal to the unbroken run, the Megatron engine — and the one-sentence refusals before anything starts."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from mindrl.checkpoint import megatron as mg
from mindrl.config import ConfigError
from mindrl.trainer.config import load_trainer_config
from tests import jobs

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "grpo_tools_cpu"
#: the unbroken run: 8 prompts (2 steps an epoch) × 4 samples, 4 steps, a checkpoint every step, validation at
#: step 2 (multi-turn too), fp32, the engine's weights checked after every sync
REFERENCE = {"megatron_training.train_iters": 4, "megatron_training.save_interval": 1,
             "megatron_training.global_batch_size": 4, "rl_config.mini_batch_size": 4,
             "actor_config.micro_batch_size": 4,
             "rl_config.n_samples_per_prompt": 4, "rl_config.test_interval": 2, "megatron_training.bf16": "false",
             # the warm start guesses more often than it calls (sft_tools_cpu): sampling at 1.0 makes calls common
             "generate_config.sampling_config.temperature": 1.0,
             "+generate_config.check_weight_sync": "true"}
FP32 = 1e-4


@pytest.fixture(scope="module")
def tools_sft(tmp_path_factory) -> tuple[Path, Path, Path]:
    """The tools tokenizer, 400 product prompts (20 held out) and a 40-step SFT on their answers (it learns the
    call's layout, not yet to copy the result)."""
    from mindrl.data.preprocess import PreprocessConfig, preprocess

    root = tmp_path_factory.mktemp("tools")
    tokenizer = root / "tokenizer"
    subprocess.run([sys.executable, str(ROOT / "cli" / "build_tiny_tokenizer.py"), "--out", str(tokenizer),
                    "--task", "tools", "--vocab-size", "512", "--split-digits"], check=True, capture_output=True)
    preprocess(PreprocessConfig(output_dir=str(root / "data"), tokenizer_name_or_path=str(tokenizer),
                                generator={"kind": "tools", "num_samples": 400, "seed": 0}, prompt_type="chatml",
                                map_keys={"prompt": "question", "answer": "answer"}, data_source="tools",
                                test_fraction=0.05))
    sft = root / "sft"
    jobs.run("train_sft.py", "sft_tools_cpu", [f"megatron_training.tokenizer_name_or_path={tokenizer}",
                                               f"megatron_training.data_path={root / 'data'}",
                                               "megatron_training.train_iters=40", "megatron_training.bf16=false",
                                               f"megatron_training.save={sft}"], root / "sft.log")
    return tokenizer, root / "data", sft


def _overrides(tools_sft, save: Path, **extra: object) -> list[str]:
    tokenizer, data, sft = tools_sft
    values = {"megatron_training.tokenizer_name_or_path": tokenizer, "megatron_training.data_path": data,
              "megatron_training.save": save, "actor_config.load": sft, **REFERENCE, **extra}
    return [f"{key}={value}" for key, value in values.items()]


@pytest.fixture(scope="module")
def reference_run(tools_sft, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tools_reference")
    jobs.run("train_grpo.py", CONFIG, _overrides(tools_sft, folder / "run"), folder / "log")
    return folder / "run"


@pytest.mark.job
def test_multi_turn_grpo_calls_the_tool_and_trains_on_the_models_tokens_only(reference_run):
    lines = jobs.metrics(reference_run / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    synced = [line for line in lines if "sync/probe_max_abs_diff" in line]  # after a validation it synced there
    assert len(synced) >= 2
    assert all(line["sync/probe_max_abs_diff"] <= FP32 and line["sync/differing_tensors"] == 0 for line in synced)
    for line in lines:
        # the engine's log-probs of the model's tokens against the actor's, tool turns between them
        assert line["rollout_is/abs_log_prob_diff_mean"] < FP32, line
        for name in ("grpo/score/mean", "actor/pg_loss", "grad_norm"):
            assert math.isfinite(line[name]), (line["step"], name)
        # a 40-step warm start still writes calls the tool refuses (errors the model reads back); none is stopped
        assert 0.0 <= line["multi_turn/call_error_share"] <= 1.0 and line["multi_turn/call_stopped_share"] == 0.0
        assert line["response_length/model_tokens_mean"] < line["response_length/mean"]  # tool tokens off the mask
    # the SFT taught the call: trajectories run the python tool and read its answer in a second turn
    assert all(line["multi_turn/tool_call_share"] > 0 for line in lines)
    assert all(line["multi_turn/turns_mean"] == 1 + line["multi_turn/tool_calls_mean"] for line in lines)
    assert all(line["rollout/tool_seconds"] > 0 for line in lines)
    validated = [line for line in lines if "validation/accuracy" in line]
    assert [line["step"] for line in validated] == [2, 4]
    assert all("validation/multi_turn/tool_call_share" in line for line in validated)


@pytest.mark.job
def test_multi_turn_sigkill_after_checkpoint_2_then_resume_equals_the_unbroken_run(tools_sft, reference_run,
                                                                                    tmp_path):
    cut, log = tmp_path / "cut", tmp_path / "log"
    job = jobs.start("train_grpo.py", CONFIG, _overrides(tools_sft, cut), log)
    jobs.kill_when(job, lambda: (cut / mg.TRACKER).is_file() and mg.read_tracker(cut) == 2, log)
    resumed = mg.read_tracker(cut)
    assert resumed in (2, 3)
    jobs.run("train_grpo.py", CONFIG, _overrides(tools_sft, cut, **{"actor_config.load": cut}), log)
    assert f"at iteration {resumed}" in log.read_text()
    expected, got = jobs.metrics(reference_run / "metrics.jsonl"), jobs.metrics(cut / "metrics.jsonl")
    assert [line["step"] for line in got] == [1, 2, 3, 4]
    # the unbroken run's engine got step 3's weights in step 2's validation, the resumed one's in step 3: the sync's
    # own figures move to another step, every other metric is equal
    unsynced = [[{k: v for k, v in line.items() if not k.startswith("sync/")} for line in run]
                for run in (jobs.run_values(got), jobs.run_values(expected))]
    assert unsynced[0] == unsynced[1]


@pytest.mark.job
def test_multi_turn_grpo_with_the_megatron_engine(tools_sft, tmp_path):
    """The Megatron-native engine, one per data-parallel replica of the actor (test_agent_loop.py drives one over
    TP=2 × PP=2 ranks, the first running the tools for the group)."""
    save = tmp_path / "run"
    jobs.run("train_grpo.py", CONFIG, _overrides(tools_sft, save, **{
        "megatron_training.train_iters": 2, "megatron_training.save_interval": 0, "rl_config.test_interval": 0,
        "generate_config.backend": "megatron"}), tmp_path / "log")
    lines = jobs.metrics(save / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert line["rollout_is/abs_log_prob_diff_mean"] < FP32, line
    assert max(line["multi_turn/tool_call_share"] for line in lines) > 0


@pytest.mark.job
def test_multi_turn_one_step_off_policy_runs_the_tools_on_the_engines_own_core(tools_sft, tmp_path):
    """Trajectories generated whole on a rollout role while the actor trains (docs/async_rollout.md): the agent loop
    and its sandbox run on the rollout rank, each trajectory's tokens one version old after the first batch."""
    save = tmp_path / "run"
    jobs.run("train_grpo.py", CONFIG, _overrides(tools_sft, save, **{
        "megatron_training.train_iters": 3, "megatron_training.save_interval": 0, "rl_config.test_interval": 0,
        "rl_config.actor_resource.num_cpus": 1, "+rl_config.rollout_resource.num_cpus": 1,
        "+rl_config.rollout_mode": "one_step_off_policy"}), tmp_path / "log")
    lines = jobs.metrics(save / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert max(line["multi_turn/tool_call_share"] for line in lines) > 0
    assert [line["async/staleness_max"] for line in lines] == [0, 1, 1]
    for line in lines:
        assert line["sync/probe_max_abs_diff"] <= FP32, line


# the refusals: one sentence each, before any worker starts

def _refusal(overrides: list[str], config: str = "grpo_tiny_tools_cpu") -> str:
    with pytest.raises(ConfigError) as err:
        load_trainer_config(config, overrides)
    return str(err.value)


def test_the_multi_turn_configs_load():
    for name in ("grpo_tiny_tools_cpu", "grpo_tools_cpu", "retool_qwen25_7b"):
        cfg = load_trainer_config(name, [])
        multi_turn = cfg.rl_config.multi_turn(cfg.generate_config.max_model_len)
        assert multi_turn is not None
        assert multi_turn.max_total_response_length >= cfg.generate_config.sampling_config.max_tokens
    assert load_trainer_config("retool_qwen25_7b", []).rl_config.multi_turn(4096).max_tool_calls == 1


def test_a_total_below_one_turn_is_refused():
    assert _refusal(["rl_config.max_total_response_length=40"]) == (
        "rl_config.max_total_response_length=40 is below sampling_config.max_tokens=48, the budget of one turn; "
        "raise it to at least 48.")


def test_a_total_past_the_engines_room_is_refused():
    assert _refusal(["rl_config.max_total_response_length=180"]).startswith(
        "max_prompt_length + max_total_response_length = 32 + 180 exceeds generate_config.max_model_len=192")


def test_routing_replay_and_the_overlong_penalty_are_refused_with_multi_turn():
    assert "does not replay yet" in _refusal(["+generate_config.rollout_routing_replay=true",
                                              "generate_config.backend=megatron"])
    assert "turn the overlong penalty off" in _refusal(["+rl_config.overlong_buffer_enable=true",
                                                        "+rl_config.rollout_max_tokens=48",
                                                        "+rl_config.overlong_buffer=16"])


def test_the_megatron_engine_with_expert_parallel_replicas_is_refused():
    """Its replicas agree on every forward within one generate call; a multi-turn loop would let one replica call
    generate again while another has finished: a hang."""
    message = _refusal(["generate_config.backend=megatron", "+rl_config.multi_turn_enable=true"], "grpo_tiny_moe_cpu")
    assert message.startswith("the Megatron-native engine keeps expert-parallel replicas in step"), message


def test_a_bad_limit_is_one_sentence():
    assert _refusal(["rl_config.max_tool_calls=0"]) == (
        "rl_config.max_tool_calls must be a positive integer with multi_turn_enable, got 0.")
    assert _refusal(["rl_config.tool_response_truncate_side=top"]) == (
        "rl_config.tool_response_truncate_side must be one of left, right, middle, got 'top'.")
    assert _refusal(["rl_config.tool_parser_format=json"]).startswith("unknown tool_parser_format 'json'")


def test_async_engine_is_refused_with_why_and_tool_keys_without_multi_turn_warn():
    message = _refusal(["+rl_config.async_engine=true"])
    assert "multi-turn rollouts batch each turn across the samples without it" in message
    cfg = load_trainer_config("grpo_tiny_cpu", ["+rl_config.max_tool_calls=3"])
    assert any("rl_config.max_tool_calls=3 has no effect without multi_turn_enable" in n for n in cfg.notices)


def test_prompts_announcing_other_tools_are_refused_before_ray_starts(tmp_path):
    """Data preprocessed with ReTool's tool config announces `code_interpreter`; a run of the built-in tools would
    answer every call "unknown tool", so it is one sentence before any worker starts. With that config it builds."""
    from mindrl.data.preprocess import PreprocessConfig, preprocess
    from mindrl.data.readers import read_columns
    from mindrl.data.templates import announced_tools
    from mindrl.trainer.grpo import GRPOTrainer

    tokenizer = tmp_path / "tokenizer"
    subprocess.run([sys.executable, str(ROOT / "cli" / "build_tiny_tokenizer.py"), "--out", str(tokenizer),
                    "--task", "tools", "--vocab-size", "512", "--split-digits"], check=True, capture_output=True)
    retool = str(ROOT / "configs" / "tools" / "retool_python.yaml")
    preprocess(PreprocessConfig(output_dir=str(tmp_path / "data"), tokenizer_name_or_path=str(tokenizer),
                                generator={"kind": "tools", "num_samples": 40, "seed": 0}, prompt_type="chatml",
                                map_keys={"prompt": "question", "answer": "answer"}, max_prompt_length=4096,
                                tool_config_path=retool))
    prompts = read_columns(tmp_path / "data" / "train.parquet", ("prompt",))["prompt"]
    assert {announced_tools(p)[0]["function"]["name"] for p in prompts} == {"code_interpreter"}
    data = [f"megatron_training.data_path={tmp_path / 'data'}", f"megatron_training.tokenizer_name_or_path={tokenizer}"]
    with pytest.raises(ConfigError) as err:
        GRPOTrainer(load_trainer_config("grpo_tiny_tools_cpu", data))
    assert str(err.value).startswith("prompt 0 of ") and "announces the tools ['code_interpreter'] but the rollout " \
                                                         "runs ['calculator', 'python']; preprocess" in str(err.value)
    # its schema makes each prompt 364 tokens: room for them (a longer prompt is refused before start)
    room = ["rl_config.max_prompt_length=384", "megatron_training.seq_length=384", "generate_config.max_model_len=512"]
    GRPOTrainer(load_trainer_config("grpo_tiny_tools_cpu", [*data, *room, f"rl_config.tool_config_path={retool}"]))


def test_calls_that_could_hold_more_memory_than_the_machine_warn(tmp_path):
    tools = tmp_path / "big.yaml"
    tools.write_text("tools:\n  - name: python\n    config: {memory_mb: 10000000}\n")
    cfg = load_trainer_config("grpo_tiny_tools_cpu", [f"rl_config.tool_config_path={tools}"])
    assert any(notice.startswith(f"max_parallel_calls={cfg.rl_config.max_parallel_calls} sandboxed calls may hold ")
               and "more than this machine's" in notice for notice in cfg.notices), cfg.notices
    assert not any("sandboxed calls" in notice for notice in load_trainer_config("grpo_tiny_tools_cpu").notices)
