"""Reward models: HF *ForSequenceClassification ⇄ Megatron (rm_head) exactly, and the Megatron reward
worker's scores at TP=2×PP=2 against HF transformers' own."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from mindrl.checkpoint import megatron as mg
from mindrl.ckpt_convert import hf_to_mcore, mcore_to_hf
from mindrl.config import ConfigError
from mindrl.config.batching import Batching
from mindrl.launch import run_ranks
from tests.hf_models import build_hf_model, save_hf_model

# qwen2: tie_word_embeddings true; llama3 and qwen3: false (a reward model has no LM head either way)
KINDS = ("qwen2", "llama3", "qwen3")


def _hf_state(folder) -> dict[str, torch.Tensor]:
    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(path))
    return state


@pytest.mark.parametrize("kind", KINDS)
def test_reward_model_hf_to_megatron_to_hf_is_bit_exact(kind, tmp_path):
    model = build_hf_model(kind, seed=3, reward_model=True)
    hf_dir = save_hf_model(model, tmp_path / "hf")
    mg_dir = hf_to_mcore(hf_dir, tmp_path / "mg", kind, 2, 2, params_dtype=torch.float32, progress=False,
                         orm=True)
    arch = mg.arch_of(mg.load_args(mg_dir))
    assert arch.num_labels == 1 and not arch.tied_embeddings
    for tp_rank in range(2):
        last = mg.load_rank(mg_dir, tp_rank, 1)["model"]
        assert torch.equal(last["rm_head.weight"], model.score.weight)  # replicated on both TP ranks
        assert "output_layer.weight" not in last
    back = mcore_to_hf(mg_dir, tmp_path / "back", progress=False)
    original, returned = _hf_state(hf_dir), _hf_state(back)
    assert sorted(returned) == sorted(original) and "score.weight" in returned and "lm_head.weight" not in returned
    for name, tensor in original.items():
        assert torch.equal(returned[name], tensor), name
    config = json.loads((back / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__] and len(config["id2label"]) == 1


def test_a_reward_model_without_orm_and_a_causal_lm_with_it_are_refused(tmp_path):
    reward = save_hf_model(build_hf_model("qwen2", reward_model=True), tmp_path / "rm")
    causal = save_hf_model(build_hf_model("qwen2"), tmp_path / "lm")
    with pytest.raises(ConfigError, match="pass --orm"):
        hf_to_mcore(reward, tmp_path / "out1", "qwen2", progress=False)
    with pytest.raises(ConfigError, match="drop --orm"):
        hf_to_mcore(causal, tmp_path / "out2", "qwen2", progress=False, orm=True)
    assert not (tmp_path / "out1").exists() and not (tmp_path / "out2").exists()


#: padding-free micro-batches of at most 30 tokens
PACKED = Batching(remove_padding=True, max_tokens=30)


def _megatron_scores(rank: int, roots: list[str], tokens: torch.Tensor, positions: torch.Tensor) -> list:
    from mindrl.workers.reward_worker import RewardModelWorker

    out = []
    for root in roots:
        args = mg.load_args(root)
        # its score head sees every TP rank's shard of the sequence; packed, every row's scored token in one
        for sequence_parallel, batching in ((False, None), (True, None), (True, PACKED)):
            par = dataclasses.replace(mg.parallel_of(args), sequence_parallel=sequence_parallel)
            worker = RewardModelWorker(mg.arch_of(args), par, root, torch.float32, micro_batch_size=2,
                                       batching=batching)
            out.append(worker.score({"tokens": tokens, "score_positions": positions}))
    return out


def test_reward_worker_tp2_pp2_scores_equal_hf_sequence_classification(tmp_path):
    """Five right-padded rows of mixed lengths (micro-batches of 2, so the last is padded too), for a
    Qwen2 (QKV biases, GQA) and a Llama reward model, in plain and sequence-parallel TP, and packed without
    padding under a token budget of 30 (so 24 tokens go alone)."""
    lengths = torch.tensor([24, 9, 17, 3, 20])
    gen = torch.Generator().manual_seed(1)
    tokens = torch.zeros(5, 24, dtype=torch.long)  # pad_token_id 0, never a real token below
    for row, length in enumerate(lengths):
        tokens[row, :length] = torch.randint(1, 250, (int(length),), generator=gen)
    expected, roots = [], []
    for kind in ("qwen2", "llama3"):
        model = build_hf_model(kind, seed=7, reward_model=True)
        with torch.no_grad():
            expected.append(model(input_ids=tokens).logits[:, 0])
        roots.append(str(hf_to_mcore(save_hf_model(model, tmp_path / f"hf_{kind}"), tmp_path / f"mg_{kind}", kind,
                                     2, 2, params_dtype=torch.float32, progress=False, orm=True)))
    per_rank = run_ranks(_megatron_scores, 4, roots, tokens, lengths - 1)
    held = [scores for scores in per_rank if scores[0] is not None]
    assert len(held) == 2  # the two TP ranks of the last stage
    for i, hf in enumerate(expected):
        assert hf.abs().max() > 0.1 and hf.std() > 0.01  # real scores that differ by row
        for scores in held[0][3 * i:3 * i + 3]:
            assert (scores - hf).abs().max().item() < 1e-4
        assert all(torch.equal(held[0][j], held[1][j]) for j in range(3 * i, 3 * i + 3))


@pytest.fixture(scope="module")
def reward_checkpoints(tmp_path_factory):
    """Megatron checkpoints of a tiny reward model (the tiny tokenizer's 1024 ids), of a two-output
    classifier and of a causal LM."""
    root = tmp_path_factory.mktemp("reward_models")
    shape = dict(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    out = {}
    for name, kwargs in (("reward", dict(reward_model=True)), ("two", dict(reward_model=True, num_labels=2)),
                         ("causal", {})):
        model = build_hf_model("qwen2", seed=9, **kwargs, **shape)
        hf_dir = save_hf_model(model, root / f"hf_{name}")
        out[name] = hf_to_mcore(hf_dir, root / f"mg_{name}", "qwen2", params_dtype=torch.float32, progress=False,
                                orm=bool(kwargs))
        out[f"{name}_model"] = model
    out["reward_tp2"] = hf_to_mcore(root / "hf_reward", root / "mg_reward_tp2", "qwen2", 2, params_dtype=torch.float32,
                                    progress=False, orm=True)
    return out


_OWN = "+rl_config.reward_resource={num_cpus: 1}"
_COLOCATED = "+rl_config.colocate_all_models=true"


def _config(*overrides: str):
    from mindrl.trainer.config import load_trainer_config

    actor = [] if any(o.startswith("rl_config.actor_resource") for o in overrides) else \
        ["rl_config.actor_resource={num_cpus: 1}"]
    return load_trainer_config("grpo_tiny_cpu", [*actor, *overrides])


def test_the_reward_role_takes_its_checkpoints_architecture(reward_checkpoints):
    own = _config(_OWN, f"+reward_config.load={reward_checkpoints['reward']}")
    arch = own.reward_config.arch
    assert (arch.num_labels, arch.hidden_size, arch.num_layers) == (1, 64, 2)
    assert [group for group, _ in own.device_groups()] == ["actor", "reward"] and own.devices_held() == 2
    colocated = _config(_COLOCATED, f"+reward_config.load={reward_checkpoints['reward']}")
    assert [group for group, _ in colocated.device_groups()] == ["actor+reward"] and colocated.devices_held() == 1
    # it scores plain rows, so prompt packing, refused for a sequence-parallel actor, leaves it be
    sequence_parallel = _config("+rl_config.reward_resource={num_cpus: 2}", "+rl_config.prompt_packing=true",
                                f"+reward_config.load={reward_checkpoints['reward_tp2']}",
                                "+reward_config.tensor_model_parallel_size=2", "+reward_config.sequence_parallel=true")
    reward = sequence_parallel.reward_config
    assert reward.parallel.sequence_parallel_for(reward.arch)


@pytest.mark.parametrize("overrides, message", [
    ((_OWN,), "needs reward_config.load"),
    ((_OWN, "+reward_config.load=@causal"), "is a causal LM"),
    ((_OWN, "+reward_config.load=@two"), "score head of 2 outputs"),
    ((_OWN, "+reward_config.load=@reward", "+reward_config.tensor_model_parallel_size=2"), "is sharded TP=1 PP=1"),
    ((_COLOCATED, "+reward_config.load=@reward_tp2", "+reward_config.tensor_model_parallel_size=2",
      "rl_config.actor_resource={num_cpus: 2}"), "actor's processes and layout"),
    ((_COLOCATED, "+reward_config.load=@reward", "rl_config.use_integrated_worker=false"),
     "runs inside the actor's processes; set use_integrated_worker: true"),
])
def test_reward_model_misconfigurations_fail_before_ray_in_one_sentence(reward_checkpoints, overrides, message):
    overrides = [o.split("@")[0] + str(reward_checkpoints[o.split("@")[1]]) if "@" in o else o for o in overrides]
    with pytest.raises(ConfigError, match=message) as err:
        cfg = _config(*overrides)
        from mindrl.trainer.grpo import check_runnable

        check_runnable(cfg)
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")


def test_running_normalisation_uses_the_statistics_of_every_score_so_far():
    from mindrl.trainer.reward_model import RunningStats, normalise

    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, generator=gen) * 3 + 5, torch.randn(16, generator=gen) - 2, torch.randn(4, generator=gen)]
    stats, seen = RunningStats(), []
    for batch in batches:
        seen.append(batch.double())
        everything = torch.cat(seen)
        out = normalise(batch, "running", 4, stats)
        expected = (batch.double() - everything.mean()) / (everything.std(unbiased=False) + 1e-6)
        assert torch.allclose(out, expected, atol=1e-9)
    restored = RunningStats()
    restored.load_state_dict(stats.state_dict())
    assert (restored.count, restored.mean, restored.std) == (28, stats.mean, stats.std)
    grouped = normalise(torch.tensor([1.0, 3.0, 10.0, 10.0]), "group", 2, RunningStats())
    assert torch.allclose(grouped, torch.tensor([-1.0, 1.0, 0.0, 0.0], dtype=torch.float64), atol=1e-5)


def test_a_nan_reward_model_score_leaves_the_running_normalisation_as_it_was():
    from mindrl.trainer.reward_model import RunningStats, normalise

    stats = RunningStats()
    normalise(torch.tensor([1.0, 2.0, 3.0, 4.0]), "running", 4, stats)
    saved = stats.state_dict()
    scores = normalise(torch.tensor([1.0, float("nan"), 3.0, 4.0]), "running", 4, stats)
    assert stats.state_dict() == saved and scores.isnan().tolist() == [False, True, False, False]


@pytest.mark.job
@pytest.mark.parametrize("placement", [_OWN, _COLOCATED])
def test_grpo_with_a_reward_model(tiny_math_data, reward_checkpoints, tmp_path, placement):
    """The driver's own path, in this process: the reward model — on a CPU of its own, or hosted by the
    actor's rank (colocate_all_models) — scores each rollout beside the verifiers; a response's reward is
    Σ verifier_weight·verifier + 0.5 · its group-normalised score; the worker's scores equal HF
    transformers' for the same rows, and are the same after two GRPO steps (its weights never change)."""
    import ray

    from mindrl.trainer.config import load_trainer_config
    from mindrl.trainer.grpo import GRPOTrainer
    from mindrl.trainer.metrics import StepTimer
    from mindrl.trainer.start import saved_extra

    tokenizer, root = tiny_math_data
    cfg = load_trainer_config("grpo_tiny_cpu", [
        f"megatron_training.tokenizer_name_or_path={tokenizer}", f"megatron_training.data_path={root / 'math'}",
        f"megatron_training.save={tmp_path / 'run'}", "megatron_training.train_iters=2",
        "megatron_training.bf16=false",  # the scores are compared with HF transformers' in fp32
        "rl_config.test_interval=0", "rl_config.use_tensorboard=false", "rl_config.overlong_buffer_enable=false",
        "generate_config.sampling_config.max_tokens=24", "generate_config.max_num_seqs=32",
        "rl_config.actor_resource={num_cpus: 1}", placement, f"+reward_config.load={reward_checkpoints['reward']}",
        "+rl_config.reward_model_weight=0.5", "+rl_config.reward_model_normalize=group"])
    lengths = torch.tensor([30, 12, 21, 7])
    tokens = torch.zeros(4, 30, dtype=torch.long)
    for row, length in enumerate(lengths):
        tokens[row, :length] = torch.randint(1, 1024, (int(length),), generator=torch.Generator().manual_seed(row))
    with torch.no_grad():
        expected = reward_checkpoints["reward_model"](input_ids=tokens).logits[:, 0]
    trainer = GRPOTrainer(cfg)
    try:
        trainer.setup()
        model = trainer.rewards.model
        before, _ = model.collect(model.submit(tokens, lengths - 5, torch.full((4,), 5)))
        exp = trainer.experience(1, StepTimer())
        steps = [trainer.train_step(step) for step in (1, 2)]
        after, _ = model.collect(model.submit(tokens, lengths - 5, torch.full((4,), 5)))
        trainer.save(2)
    finally:
        trainer.close()
        ray.shutdown()
    assert (before - expected).abs().max().item() < 1e-4 and torch.equal(before, after)
    assert saved_extra(tmp_path / "run", 2)["reward_model_stats"] == {"count": 0, "mean": 0.0, "m2": 0.0}
    rm = exp.verifier_scores["reward_model"].double()
    assert rm.view(-1, 4).mean(dim=1).abs().max() < 1e-6 and rm.abs().max() > 0.1
    rule = sum(w * exp.verifier_scores[name].double() for name, w in (("acc", 1.0), ("format", 0.1)))
    assert torch.allclose(exp.scores.double(), rule + 0.5 * rm, atol=1e-6)
    for metrics in steps:
        assert metrics["timing/reward_model"] > 0 and metrics["reward_model/std"] > 0
        assert abs(metrics["reward_model_rewards/mean"]) < 1e-6 and "acc_rewards/mean" in metrics
