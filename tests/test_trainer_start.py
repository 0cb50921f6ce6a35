"""The trainer's prompt order and start point: what a resume depends on, checked without Ray."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from mindrl.checkpoint import megatron as mg
from mindrl.config import ConfigError, ParallelConfig, load_model_arch
from mindrl.rollout.config import sampling_for_step
from mindrl.trainer.config import load_trainer_config
from mindrl.trainer.grpo import check_runnable
from mindrl.trainer.prompts import Prompt, PromptLoader, check_prompt_lengths, read_prompts
from mindrl.trainer.start import start_point


def _prompts(count: int) -> list[Prompt]:
    return [Prompt([i, i + 1], str(i), "s") for i in range(count)]


def test_epochs_are_seeded_permutations_without_a_short_last_batch():
    loader = PromptLoader(_prompts(10), batch_size=4, seed=3)
    epoch0 = [p.label for _ in range(2) for p in loader.next_batch()]
    assert loader.state_dict() == {"epoch": 0, "position": 8}
    epoch1 = [p.label for _ in range(2) for p in loader.next_batch()]
    assert loader.state_dict() == {"epoch": 1, "position": 8}
    assert len(set(epoch0)) == len(set(epoch1)) == 8 and epoch0 != epoch1  # two prompts left out per epoch
    fixed = PromptLoader(_prompts(10), batch_size=4, seed=3, shuffle=False)
    assert [p.label for p in fixed.next_batch()] == ["0", "1", "2", "3"]


def test_a_loader_restored_at_the_end_of_an_epoch_continues_into_the_next():
    whole = PromptLoader(_prompts(8), batch_size=4, seed=1)
    batches = [[p.label for p in whole.next_batch()] for _ in range(5)]
    resumed = PromptLoader(_prompts(8), batch_size=4, seed=1)
    resumed.load_state_dict({"epoch": 0, "position": 8})
    assert [[p.label for p in resumed.next_batch()] for _ in range(3)] == batches[2:]


@pytest.mark.parametrize("taken, back", [(7, 2), (5, 3), (3, 3), (6, 6)])
def test_a_loader_steps_back_over_the_rows_it_gave_across_epochs(taken, back):
    """A scheduled run's buffered prompts handed back: the loader gives them again, in order, then goes on."""
    whole = PromptLoader(_prompts(10), batch_size=3, seed=2)  # 3 batches an epoch, one prompt left out
    batches = [whole.next_rows() for _ in range(taken + 2)]

    def after_taking() -> PromptLoader:
        loader = PromptLoader(_prompts(10), batch_size=3, seed=2)
        for _ in range(taken):
            loader.next_rows()
        return loader

    handed = [row for batch in batches[taken - back:taken] for row in batch]
    loader = after_taking()
    loader.rewind(handed, 3)
    assert [loader.next_rows() for _ in range(back + 2)] == batches[taken - back:taken + 2]
    with pytest.raises(ConfigError, match="the checkpoint's buffered prompts are not the rows this data and seed"):
        after_taking().rewind(list(reversed(handed)), 3)
    with pytest.raises(ConfigError, match=f"the checkpoint's {3 * taken + 3} buffered prompts are no whole batches"):
        after_taking().rewind(list(range(3 * taken + 3)), 3)


def test_a_rewind_under_another_batch_size_gives_the_rows_again_or_says_which_size_does():
    taken = PromptLoader(_prompts(10), batch_size=3, seed=2)
    batches, states = [], []
    for _ in range(4):  # epoch 0's three batches, then epoch 1's first
        batches.append(taken.next_rows())
        states.append(taken.state_dict())
    bigger = PromptLoader(_prompts(10), batch_size=6, seed=2)
    bigger.load_state_dict(states[2])
    bigger.rewind(batches[1] + batches[2], 3)  # back at epoch 0's position 3: a batch of 6 fits before its end
    assert bigger.next_rows() == batches[1] + batches[2]
    stranded = PromptLoader(_prompts(10), batch_size=6, seed=2)
    stranded.load_state_dict(states[3])
    with pytest.raises(ConfigError, match="global_batch_size=6 would pass over some of the checkpoint's buffered "
                                          "prompts at the end of the epoch; resume at global_batch_size=3"):
        stranded.rewind(batches[2] + batches[3], 3)  # back at epoch 0's position 6 a batch of 6 runs past its end


def test_too_few_prompts_and_a_missing_file_are_one_sentence(tmp_path):
    with pytest.raises(ConfigError, match="has 3 prompts, fewer than one batch of global_batch_size=4"):
        PromptLoader(_prompts(3), batch_size=4, seed=0)
    with pytest.raises(ConfigError, match=r"no prompt file at .*run cli/preprocess_data\.py"):
        read_prompts(tmp_path / "train.parquet")
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(ConfigError, match=r"lacks the columns \['prompt_ids', 'answer', 'data_source'\]"):
        read_prompts(tmp_path / "bad.parquet")


def _save_rank(root, iteration, extra=None, model="tiny_qwen", tp=1, **state):
    """A checkpoint's args and trainer state as the driver reads them (one rank file of one weight)."""
    args = mg.checkpoint_args(load_model_arch(model), ParallelConfig(tp, 1), torch.float32)
    mg.save_rank(root, iteration, 0, 0, {"w": torch.zeros(1)}, args, extra=extra or {}, **state)
    mg.write_tracker(root, iteration)


def test_start_point_tells_converted_weights_from_a_run_to_resume(tmp_path):
    cfg = load_trainer_config("grpo_tiny_cpu").actor_config
    assert start_point(cfg).initial_weights is None and start_point(cfg).iteration == 0
    release, run = tmp_path / "release", tmp_path / "run"
    _save_rank(release, "release")
    _save_rank(run, 6, {"data": {"epoch": 1, "position": 4}, "initial_weights": str(release)}, optimizer={})
    from_release = start_point(load_trainer_config("grpo_tiny_cpu", [f"actor_config.load={release}"]).actor_config)
    assert (from_release.iteration, from_release.initial_weights, from_release.resume) == (0, str(release), None)
    resume = start_point(load_trainer_config("grpo_tiny_cpu", [f"actor_config.load={run}"]).actor_config)
    # the reference is rebuilt from the run's first weights, not from the checkpoint being resumed
    assert (resume.iteration, resume.initial_weights, resume.resume) == (6, str(release), str(run))
    finetune = start_point(load_trainer_config("grpo_tiny_cpu", [f"actor_config.load={run}",
                                                                 "+actor_config.finetune=true"]).actor_config)
    assert (finetune.iteration, finetune.initial_weights) == (0, str(run))


def test_start_point_mistakes(tmp_path):
    with pytest.raises(ConfigError, match=r"holds no latest_checkpointed_iteration\.txt; point it at a checkpoint"):
        start_point(load_trainer_config("grpo_tiny_cpu", [f"actor_config.load={tmp_path}"]).actor_config)
    _save_rank(tmp_path / "foreign", 10, optimizer={})  # another trainer's: optimizer state, no data position
    with pytest.raises(ConfigError, match="records no data position\\); set finetune: true"):
        start_point(load_trainer_config("grpo_tiny_cpu", [f"actor_config.load={tmp_path / 'foreign'}"]).actor_config)
    # another model or layout is refused here, before Ray, not by the workers once they start
    _save_rank(tmp_path / "small", "release", model="small_qwen")
    with pytest.raises(ConfigError, match="holds a different architecture than model tiny_qwen: num_layers"):
        start_point(load_trainer_config("grpo_tiny_cpu", [f"actor_config.load={tmp_path / 'small'}"]).actor_config)
    _save_rank(tmp_path / "tp2", "release", tp=2)
    with pytest.raises(ConfigError, match=r"is sharded TP=2 PP=1 but the model is TP=1 PP=1; re-shard it"):
        start_point(load_trainer_config("grpo_tiny_cpu", [f"actor_config.load={tmp_path / 'tp2'}"]).actor_config)


@pytest.mark.parametrize("overrides, message", [
    (["+actor_config.use_distributed_optimizer=false"],
     "actor_config.use_distributed_optimizer: false is not supported by the trainer"),
    (["rl_config.use_integrated_worker=false", "+rl_config.colocate_actor_ref=true"],
     "a reference sharing the actor's devices runs inside the actor's processes"),
])
def test_what_the_driver_cannot_run_is_refused_before_ray(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_runnable(load_trainer_config("grpo_tiny_cpu", overrides))


def test_checkpoints_hold_the_optimizer_and_rng_whatever_no_save_says():
    """MindSpeed-RL's recipes set no_save_optim / no_save_rng: saving them anyway keeps a resume exact and loses
    nothing, so the keys are a notice, not a refusal."""
    cfg = load_trainer_config("grpo_tiny_cpu", ["+actor_config.no_save_optim=true", "+actor_config.no_save_rng=true"])
    check_runnable(cfg)
    assert [notice.split(":")[0] for notice in cfg.notices if "no_save" in notice] == ["no_save_optim", "no_save_rng"]


def test_a_prompt_longer_than_max_prompt_length_is_refused_in_one_sentence(tmp_path):
    """Its response would have no room in the engine: found now, not once the workers generate it."""
    prompts = [Prompt([1] * n, "5", "math") for n in (10, 12, 30, 25)]
    check_prompt_lengths(prompts, 30, tmp_path / "train.parquet")
    with pytest.raises(ConfigError, match=r"^2 of the 4 prompts in .*train\.parquet are longer than "
                                          r"rl_config\.max_prompt_length=20 tokens \(the longest has 30\); "
                                          r"preprocess them .* at most 20, .*\.$"):
        check_prompt_lengths(prompts, 20, tmp_path / "train.parquet")


def test_each_step_and_round_samples_with_its_own_seed():
    sampling = load_trainer_config("grpo_tiny_cpu").generate_config.sampling_config
    seeds = {sampling_for_step(sampling, step, attempt).seed for step in range(1, 50) for attempt in range(4)}
    assert len(seeds) == 49 * 4 and sampling_for_step(sampling, 3, 1).seed == sampling_for_step(sampling, 3, 1).seed


def test_a_reference_on_its_own_devices_needs_checkpointed_initial_weights():
    from mindrl.trainer.grpo import GRPOTrainer

    cfg = load_trainer_config("grpo_tiny_cpu", ["rl_config.use_integrated_worker=false",
                                                "rl_config.actor_resource={num_cpus: 1}",
                                                "+rl_config.reference_resource={num_cpus: 1}"])
    with pytest.raises(ConfigError, match="a reference on its own devices needs the run's initial weights"):
        GRPOTrainer(cfg)
