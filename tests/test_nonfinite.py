"""A NaN or inf in an RL step (mindrl/trainer/nonfinite.py): the driver names it, counts the skipped steps and stops
after too many in a row, and a resume counts on. The actor's own skip of a non-finite optimizer step is tested in
test_actor.py, the reward model's running normalisation in test_reward_model.py."""

import json
import math
import re

import pytest
import torch

from mindrl.config.errors import RunError
from mindrl.trainer.nonfinite import SKIPPED_STEPS, NonFinite, SkippedSteps, first_nonfinite, nonfinite
from tests import jobs


def test_a_nonfinite_value_is_described_where_it_is():
    rewards = torch.tensor([1.0, 0.0, math.nan, -math.inf])
    assert str(nonfinite("the rewards", rewards)) == \
        "the rewards (1 NaN and 1 inf in 2 of 4 samples, the first sample 2)"
    log_probs = torch.zeros(3, 5)
    log_probs[1, 4] = math.inf
    assert first_nonfinite({"the rewards": torch.zeros(3), "the old log-probs": log_probs, "the advantages": None}) \
        == NonFinite("the old log-probs", "1 inf in 1 of 3 samples, the first sample 1")
    assert nonfinite("the rewards", torch.zeros(3)) is None and nonfinite("ids", torch.arange(3)) is None


def test_skipped_steps_are_counted_and_more_in_a_row_than_allowed_stop_the_run_in_one_sentence():
    counter = SkippedSteps(limit=1)
    nan_rewards = NonFinite("the rewards", "1 NaN in 1 of 16 samples, the first sample 0")
    assert counter.record(1, None) == {SKIPPED_STEPS: 0.0}
    assert counter.record(2, nan_rewards) == {SKIPPED_STEPS: 1.0}
    counter.stop_if_over("its last checkpoint")  # one in a row is allowed
    assert counter.record(3, None) == {SKIPPED_STEPS: 1.0}  # a finite step ends the run in a row
    counter.record(4, nan_rewards)
    saved = counter.state_dict()
    resumed = SkippedSteps(limit=1)
    resumed.load_state_dict(saved)
    for each in (counter, resumed):  # a resumed run counts and stops as the uninterrupted one does
        assert each.record(5, NonFinite("the actor's gradient norm", "")) == {SKIPPED_STEPS: 3.0}
        with pytest.raises(RunError) as err:
            each.stop_if_over("its last checkpoint (iteration 4 in run)")
        message = str(err.value)
        assert message.startswith("the rewards (1 NaN in 1 of 16 samples, the first sample 0) went non-finite at "
                                  "step 4, and 2 steps in a row have been skipped"), message
        assert "max_nonfinite_steps=1" in message and "resume from its last checkpoint (iteration 4 in run)" in message
        assert "\n" not in message and message.count(". ") == 0 and message.endswith(".")


#: a verifier that scores 0, except 1e39 for the first sample it scores in each step that PLAN lists (the steps'
#: 16 samples are scored one step after another, so its call count tells the step): finite as the Python float
#: it returns (a NaN or inf is the scorer's error, scored as a failure), inf in the driver's float32 rewards
FLAKY = """import fcntl
import json

CALLS, PLAN, SAMPLES = {calls!r}, {plan!r}, 16


def flaky(response: str, label: str) -> float:
    with open(CALLS, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        call = len(f.read())
        f.write(".")
    with open(PLAN) as f:
        inf_steps = json.load(f)
    return 1e39 if call % SAMPLES == 0 and call // SAMPLES + 1 in inf_steps else 0.0


flaky.worst_score = 0.0
"""


@pytest.mark.job
def test_an_inf_reward_skips_and_counts_the_step_and_too_many_in_a_row_stop_the_run_which_resumes_counting_on(
        tiny_math_data, tmp_path):
    """One sample's reward is inf in steps 2, 4 and 5 (its group's advantages would be NaN) with
    max_nonfinite_steps: 1: steps 2 and 4 are skipped and counted, step 5 is the second in a row and stops the run
    (exit status 1) naming step 4's rewards and the checkpoint of step 4. Resumed from it with the verifier mended,
    the count goes on from the checkpoint's 2."""
    tokenizer, root = tiny_math_data
    plan, verifier, save, log = tmp_path / "plan.json", tmp_path / "flaky.py", tmp_path / "run", tmp_path / "log"
    plan.write_text(json.dumps([2, 4, 5]))
    verifier.write_text(FLAKY.format(calls=str(tmp_path / "calls"), plan=str(plan)))
    overrides = jobs.grpo_overrides(tokenizer, root / "math", save, **{
        "megatron_training.train_iters": 6, "megatron_training.save_interval": 2, "rl_config.test_interval": 0,
        "rl_config.use_tensorboard": False, "rl_config.verifier_function": f"[acc,'{verifier}:flaky']",
        "rl_config.verifier_weight": "[1.0,1.0]", "+rl_config.max_nonfinite_steps": 1})
    jobs.run("train_grpo.py", "grpo_tiny_cpu", overrides, log, status=1)
    lines = jobs.metrics(save / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    assert [line[SKIPPED_STEPS] for line in lines] == [0, 1, 1, 2, 3]
    for line in lines:  # a skipped step runs no update: no actor metrics, its inf score logged as null
        assert ("actor/pg_loss" in line) == (line["step"] in (1, 3)), line["step"]
        assert (line["grpo/score/max"] is None) == (line["step"] in (2, 4, 5))
    text = log.read_text()
    inf_reward = r"the rewards \(1 inf in 1 of 16 samples, the first sample \d+\) went non-finite"
    assert re.search(f"warning: step 2: {inf_reward}, so the step is skipped", text)
    assert re.search(f"error: {inf_reward} at step 4, and 2 steps in a row have been skipped", text)
    assert f"resume from its last checkpoint (iteration 4 in {save})" in text

    plan.write_text("[]")
    jobs.run("train_grpo.py", "grpo_tiny_cpu", [*overrides, f"actor_config.load={save}"], log)
    lines = jobs.metrics(save / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert [line[SKIPPED_STEPS] for line in lines] == [0, 1, 1, 2, 2, 2]
    assert all(line["actor/skipped"] == 0 for line in lines[4:])
