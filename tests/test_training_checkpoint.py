"""Training checkpoints: a resumed actor continues bit-identically (weights, Adam state, metrics, RNG)
at TP=2, PP=2 and DP=2; saves are atomic under an exception or a killed rank; the files convert to HF.

Launches: 4 ranks train and save at TP=2×DP=2 and PP=2×DP=2, and go on for two updates; 4 fresh
ranks load and do the same two updates. 2 ranks crash saves; 2 more resume at another DP size
and recover from the crash.
"""

import dataclasses
import os
import random
import re
import resource
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core import tensor_parallel
from safetensors.torch import load_file

from mindrl.algorithms.policy_loss import LossConfig
from mindrl.checkpoint import megatron as mg
from mindrl.checkpoint import training
from mindrl.ckpt_convert import mcore_to_hf, mcore_to_mcore
from mindrl.config import ConfigError, ParallelConfig, load_model_arch
from mindrl.distributed import release_model_parallel
from mindrl.launch import run_ranks
from mindrl.models import sharding
from mindrl.workers.megatron_worker import ActorConfig, ActorWorker
from tests.hf_models import mcore_to_hf_state

ROWS, SEQ, BEFORE, AFTER = 8, 16, 2, 2
# A warm-up over all 8 optimizer steps, weight decay, clipping and a shuffle seeded by the update count:
# a resume that lost the scheduler, the counter or Adam's moments would not continue identically.
CFG = ActorConfig(lr=1e-3, lr_warmup_fraction=0.5, lr_decay_iters=16,
                  weight_decay=0.01, clip_grad=1.0, mini_batch_size=4, micro_batch_size=2, shuffle_mini_batch=True,
                  loss=LossConfig(clip_ratio=0.2, use_kl_loss=True, kl_coef=0.1))
#: CFG's schedule changed for a resume: lr 3e-3 (1e-3 saved) over 24 iterations, 12 of warm-up (16, 8 saved)
CHANGED = dataclasses.replace(CFG, lr=3e-3, lr_decay_iters=24, weight_decay=0.05)
LAYOUTS = {"tp2": ParallelConfig(2, 1), "pp2": ParallelConfig(1, 2)}  # on 4 ranks: DP=2 each
EXTRA = {"consumed_train_samples": 16, "trainer_step": BEFORE, "rollout_seed": 7, "data": {"epoch": 0, "index": 2}}


def _batch(vocab: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(ROWS, SEQ)
    for r in range(ROWS):
        mask[r, 5:SEQ - 1 - r % 4] = 1
    return {"tokens": torch.randint(0, vocab, (ROWS, SEQ), generator=gen), "loss_mask": mask,
            "old_log_probs": -6.9 + 0.3 * torch.randn(ROWS, SEQ, generator=gen),
            "ref_log_probs": -6.95 + 0.1 * torch.randn(ROWS, SEQ, generator=gen),
            "advantages": torch.randn(ROWS, 1, generator=gen).expand(ROWS, SEQ) * mask}


def _draws() -> dict:
    """One value from every generator a checkpoint restores."""
    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracked = torch.rand(2)
    return {"python": random.random(), "numpy": float(np.random.rand()), "torch": torch.rand(2), "tracker": tracked}


def _optimizer_state(actor: ActorWorker) -> dict[tuple[str, int, int], dict[str, torch.Tensor]]:
    """This rank's shard of the fp32 master weights, Adam moments and step, by parameter and element range."""
    names = {p: n for n, p in actor.model.named_parameters()}
    out = {}
    for opt in actor.optimizer.chained_optimizers:
        for by_dtype in opt.gbuf_ranges:
            for buckets in by_dtype.values():
                for bucket in buckets:
                    for param, ranges in bucket["param_map"].items():
                        state = opt._get_main_param_and_optimizer_states(param)
                        out[(names[param], ranges["param"].start, ranges["param"].end)] = {
                            k: v.detach().clone() for k, v in state.items()}
    return out


def _snapshot(actor: ActorWorker) -> dict:
    return {"params": {n: p.detach().clone() for n, p in actor.model.named_parameters()},
            "optim": _optimizer_state(actor), "stage": (actor.tp_rank, actor.pp_rank), "dp": actor.dp_rank}


def _go_on(actor: ActorWorker, vocab: int) -> dict:
    draws = _draws()
    metrics = [actor.update(_batch(vocab, BEFORE + i)) for i in range(AFTER)]
    return {"draws": draws, "metrics": metrics, **_snapshot(actor)}


def _train_and_save(rank: int, roots: dict[str, str]) -> dict:
    arch = load_model_arch("tiny_qwen")
    full = sharding.random_full_state_dict(arch, seed=4)
    out = {}
    for name, par in LAYOUTS.items():
        release_model_parallel()
        actor = ActorWorker(arch, par, CFG, weights=full)
        for step in range(BEFORE):
            actor.update(_batch(arch.padded_vocab_size, step))
        _draws()  # move every generator off its seeded state before saving it
        actor.save_checkpoint(roots[name], BEFORE, extra=EXTRA)
        out[name] = {"at_save": _snapshot(actor), "after": _go_on(actor, arch.padded_vocab_size)}
    return out


def _load_and_go_on(rank: int, roots: dict[str, str]) -> dict:
    arch = load_model_arch("tiny_qwen")
    full = sharding.random_full_state_dict(arch, seed=4)
    vocab = arch.padded_vocab_size
    out = {}
    for name, par in LAYOUTS.items():
        release_model_parallel()
        actor = ActorWorker(arch, par, CFG, weights=full)
        resumed = actor.load_checkpoint(roots[name])
        out[name] = {"resumed": resumed, "at_load": _snapshot(actor), "after": _go_on(actor, vocab),
                     "kept_schedule": actor.kept_schedule()}
    try:
        actor.load_checkpoint(roots["tp2"])
    except ConfigError as err:
        out["wrong_layout"] = str(err)
    longer = ActorWorker(arch, LAYOUTS["pp2"], dataclasses.replace(CFG, steps_per_iteration=2), weights=full)
    longer.load_checkpoint(roots["pp2"], load_rng=False)  # the generators stay as the next check needs them
    out["longer_schedule"] = (longer.kept_schedule(), longer.scheduler.lr_decay_steps)
    # no_load_optim: the same as an actor built on the checkpoint's weights, as the reference loads them.
    on_weights = ActorWorker(arch, LAYOUTS["pp2"], CFG, weights=roots["pp2"])
    on_weights.updates = BEFORE  # what a resume restores: the update count seeds the mini-batch shuffle
    reset = ActorWorker(arch, LAYOUTS["pp2"], CFG, weights=full)
    reset.update(_batch(vocab, 99))  # Adam state and scheduler steps that the load must drop
    reset.load_checkpoint(roots["pp2"], load_optim=False, load_rng=False)
    out["no_load_optim"] = {
        "state_sizes": [len(opt.optimizer.state) for opt in reset.optimizer.chained_optimizers],
        "draws": _draws(), "metrics": reset.update(_batch(vocab, BEFORE)),
        "params": {n: p.detach().clone() for n, p in reset.model.named_parameters()},
        "on_weights_metrics": on_weights.update(_batch(vocab, BEFORE)),
        "on_weights_params": {n: p.detach().clone() for n, p in on_weights.model.named_parameters()}}
    # A config with another schedule than the checkpoint's: three times the lr over 24 iterations (12 of warm-up),
    # five times the weight decay
    out["changed_schedule"] = {}
    for switch in ("none", "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"):
        changed = dataclasses.replace(CHANGED, **({} if switch == "none" else {switch: True}))
        other = ActorWorker(arch, LAYOUTS["pp2"], changed, weights=full)
        other.load_checkpoint(roots["pp2"], load_rng=False)
        s = other.scheduler
        out["changed_schedule"][switch] = {
            "note": other.kept_schedule(), "num_steps": s.num_steps,
            "shape": (s.max_lr, s.lr_warmup_steps, s.lr_decay_steps), "lr": other.optimizer.param_groups[0]["lr"],
            "weight_decay": max(group["weight_decay"] for group in other.optimizer.param_groups),
            "update_lr": other.update(_batch(vocab, BEFORE))["lr"]}
    return out


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("training_ckpt")
    return {name: str(base / name) for name in (*LAYOUTS, "crash", "side", "resharded")}


@pytest.fixture(scope="module")
def saved(roots) -> list[dict]:
    return run_ranks(_train_and_save, 4, roots)


@pytest.fixture(scope="module")
def resumed(saved, roots) -> list[dict]:
    return run_ranks(_load_and_go_on, 4, roots)


def _equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_continues_bit_identically(saved, resumed, layout):
    for before, after in zip(saved, resumed, strict=True):
        first, second = before[layout], after[layout]
        assert second["resumed"] == training.Resumed(BEFORE, EXTRA, updates=BEFORE)
        assert second["at_load"]["stage"] == first["at_save"]["stage"]
        assert _equal_states(second["at_load"]["params"], first["at_save"]["params"])
        assert first["at_save"]["optim"].keys() == second["at_load"]["optim"].keys()
        for key, tensors in first["at_save"]["optim"].items():
            assert _equal_states(second["at_load"]["optim"][key], tensors), key
        assert second["after"]["draws"]["python"] == first["after"]["draws"]["python"]
        assert second["after"]["draws"]["numpy"] == first["after"]["draws"]["numpy"]
        assert torch.equal(second["after"]["draws"]["torch"], first["after"]["draws"]["torch"])
        assert torch.equal(second["after"]["draws"]["tracker"], first["after"]["draws"]["tracker"])
        assert second["after"]["metrics"] == first["after"]["metrics"]
        assert _equal_states(second["after"]["params"], first["after"]["params"])
        for key, tensors in first["after"]["optim"].items():
            assert _equal_states(second["after"]["optim"][key], tensors), key
        # The continuation really trained: weights moved, at learning rates the restored schedule set.
        assert not _equal_states(first["after"]["params"], first["at_save"]["params"])
        lrs = [m["lr"] for m in first["after"]["metrics"]]
        assert 0 < lrs[0] < lrs[1] < CFG.lr
    dps = {r[layout]["at_save"]["dp"] for r in saved}
    assert dps == {0, 1}  # the optimizer state was sharded over two data-parallel ranks


def test_no_load_optim_gives_a_fresh_optimizer_and_no_load_rng_keeps_the_generators(saved, resumed):
    for before, after in zip(saved, resumed, strict=True):
        fresh = after["no_load_optim"]
        assert fresh["state_sizes"] == [0]
        assert fresh["metrics"]["lr"] == pytest.approx(CFG.lr / 16)  # a fresh schedule: warm-up steps 0 and 1
        assert fresh["metrics"] == fresh["on_weights_metrics"]
        assert _equal_states(fresh["params"], fresh["on_weights_params"])
        assert fresh["draws"]["python"] != before["pp2"]["after"]["draws"]["python"]
        assert not torch.equal(fresh["draws"]["torch"], before["pp2"]["after"]["draws"]["torch"])


def test_a_resume_keeps_the_checkpoints_lr_schedule_and_says_so_where_the_config_differs(resumed):
    """Megatron keeps a loaded schedule; one that spans other steps than the config's (here twice the optimizer
    steps per iteration, as a checkpoint from before the schedule counted iterations would) is announced."""
    for result in resumed:
        assert all(result[name]["kept_schedule"] is None for name in LAYOUTS)
        note, decay_steps = result["longer_schedule"]
        assert decay_steps == CFG.lr_decay_iters
        assert note.startswith("the checkpoint's LR schedule (16 optimizer steps, 8 of warm-up, lr 0.001 constant, "
                               "weight decay 0.01) goes on") and \
            "config's is 32 optimizer steps, 16 of warm-up" in note and "no_load_optim: true" in note
        _one_sentence(note)


def _one_sentence(message: str) -> None:
    assert "\n" not in message and message.endswith(".") and ". " not in message, message


def test_override_opt_param_scheduler_takes_the_configs_schedule_at_the_checkpoints_step(resumed):
    """The checkpoint saved 4 optimizer steps of a warm-up to lr 1e-3 over 8; the config warms up to 3e-3 over 12.
    The step count is the checkpoint's either way: its schedule gives 1e-3 × 4/8, the config's 3e-3 × 4/12, and the
    next update (optimizer steps 4 and 5) logs the mean of steps 4 and 5. The config's lr reaches the rates too,
    not only the scheduler (megatron-core alone keeps the checkpoint's in the param groups: 1e-3 × 4/12); the
    weight decay is the chosen schedule's from the first resumed update on."""
    for result in resumed:
        runs = result["changed_schedule"]
        for run in runs.values():
            assert run["num_steps"] == 2 * BEFORE  # two mini-batches per update
        override = runs["override_opt_param_scheduler"]
        assert override["shape"] == (3e-3, 12, 24) and override["lr"] == pytest.approx(3e-3 * 4 / 12)
        assert override["weight_decay"] == pytest.approx(0.05)
        assert override["update_lr"] == pytest.approx(3e-3 * (4 + 5) / 2 / 12)
        assert override["note"] is None
        for switch in ("none", "use_checkpoint_opt_param_scheduler"):
            assert runs[switch]["shape"] == (1e-3, 8, 16) and runs[switch]["lr"] == pytest.approx(1e-3 * 4 / 8)
            assert runs[switch]["update_lr"] == pytest.approx(1e-3 * (4 + 5) / 2 / 8)
            # the first resumed update too (megatron-core's load sets the rates before the checkpoint's decay)
            assert runs[switch]["weight_decay"] == pytest.approx(0.01)
        assert runs["use_checkpoint_opt_param_scheduler"]["note"] is None
        note = runs["none"]["note"]
        assert note.startswith("the checkpoint's LR schedule (16 optimizer steps, 8 of warm-up, lr 0.001 constant, "
                               "weight decay 0.01) goes on") and \
            "config's is 24 optimizer steps, 12 of warm-up, lr 0.003 constant" in note and \
            "override_opt_param_scheduler: true takes this config's from the checkpoint's step on" in note
        _one_sentence(note)


def test_both_scheduler_switches_are_one_sentence_of_error():
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(CFG, override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True)
    assert "override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are both true" in str(err.value)
    _one_sentence(str(err.value))


def test_loading_into_another_tp_pp_is_one_sentence(resumed, roots):
    assert resumed[0]["wrong_layout"] == (
        f"checkpoint {roots['tp2']} iteration {BEFORE} was saved at TP=2 PP=1 but the actor runs TP=1 PP=2; "
        "re-shard it with cli/convert_ckpt.py --load-model-type mg --save-model-type mg "
        "--target-tensor-parallel-size 1 --target-pipeline-parallel-size 2 and resume from that with "
        "no_load_optim and no_load_rng, or run the actor at TP=2 PP=1.")


def test_a_training_checkpoint_converts_to_the_actors_hf_weights(saved, roots, tmp_path):
    arch, par = load_model_arch("tiny_qwen"), LAYOUTS["pp2"]
    snapshots = [r["pp2"]["at_save"] for r in saved]
    stages = {s["stage"]: s["params"] for s in snapshots if s["dp"] == 0}
    expected = mcore_to_hf_state(sharding.merge_state_dicts(stages, arch, par), arch)
    out = mcore_to_hf(roots["pp2"], tmp_path / "hf", progress=False)
    got = {}
    for shard in sorted(Path(out).glob("*.safetensors")):
        got.update(load_file(shard))
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def _crash(rank: int, roots: dict[str, str]) -> None:
    """Save iteration 1; fail saving 2 on rank 1 (its files may not grow past 64 KiB); then kill rank 1 mid-write
    of 3."""
    arch = load_model_arch("tiny_qwen")
    actor = ActorWorker(arch, ParallelConfig(2, 1), CFG, weights=sharding.random_full_state_dict(arch, seed=4))
    side, root = Path(roots["side"]), Path(roots["crash"])
    actor.update(_batch(arch.padded_vocab_size, 0))
    actor.save_checkpoint(root, 1, extra={"trainer_step": 1})
    torch.save({n: p.detach().clone() for n, p in actor.model.named_parameters()}, side / f"params{rank}.pt")
    actor.update(_batch(arch.padded_vocab_size, 1))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:  # a real write failure: the OS refuses rank 1's files past 64 KiB (its rank file is larger)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, limit[1]))
    try:
        actor.save_checkpoint(root, 2)
    except RuntimeError as err:
        torch.save({"message": str(err), "listing": sorted(os.listdir(root))}, side / f"failed{rank}.pt")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    write = training._write

    def killed_midway(obj, path):
        if rank == 1:
            write(obj, path)
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        write(obj, path)

    training._write = killed_midway
    actor.save_checkpoint(root, 3)


@pytest.fixture(scope="module")
def crashed(roots) -> dict:
    Path(roots["side"]).mkdir()
    with pytest.raises(RuntimeError):
        run_ranks(_crash, 2, roots, timeout_s=120)
    side = Path(roots["side"])
    return {"failed": [torch.load(side / f"failed{r}.pt") for r in range(2)],
            "listing": sorted(os.listdir(roots["crash"])), "tracker": mg.read_tracker(roots["crash"])}


def _other_dp_and_recover(rank: int, roots: dict[str, str]) -> dict:
    arch = load_model_arch("tiny_qwen")
    full = sharding.random_full_state_dict(arch, seed=4)
    actor = ActorWorker(arch, LAYOUTS["pp2"], CFG, weights=full)  # 2 ranks: DP=1, saved at DP=2
    out = {}
    try:
        actor.load_checkpoint(roots["pp2"])
    except ConfigError as err:
        out["dp_message"] = str(err)
    out["resumed"] = actor.load_checkpoint(roots["pp2"], load_rng=False)
    out["dp1"] = _snapshot(actor)
    release_model_parallel()
    actor = ActorWorker(arch, ParallelConfig(2, 1), CFG, weights=full)
    try:  # the PP=2 checkpoint re-sharded to TP=2 by mg -> mg: weights only
        actor.load_checkpoint(roots["resharded"])
    except ConfigError as err:
        out["weights_only_message"] = str(err)
    out["resharded"] = actor.load_checkpoint(roots["resharded"], load_optim=False, load_rng=False)
    out["resharded_params"] = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    out["recovered"] = actor.load_checkpoint(roots["crash"])
    out["recovered_params"] = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    actor.update(_batch(arch.padded_vocab_size, 1))
    actor.save_checkpoint(roots["crash"], 3)
    return out


@pytest.fixture(scope="module")
def other_dp(saved, crashed, roots) -> list[dict]:
    mcore_to_mcore(roots["pp2"], roots["resharded"], tp=2, pp=1, progress=False)
    return run_ranks(_other_dp_and_recover, 2, roots)


def test_a_failed_save_leaves_the_previous_checkpoint_and_says_why_in_one_sentence(crashed, roots):
    root = roots["crash"]
    for failed in crashed["failed"]:  # every rank raises the same sentence, with rank 1's OS error
        assert re.fullmatch(
            rf"saving checkpoint iteration 2 to {re.escape(root)} failed on rank 1 \(OSError: \[Errno 27\] File too "
            rf"large: {re.escape(root)}/\.tmp-iter_0000002/mp_rank_01/\S+\.pt\); the checkpoints before it are "
            rf"untouched and the tracker still names iteration 1 — free space or fix the folder, then resume with "
            rf"load={re.escape(root)}\.", failed["message"]), failed["message"]
    assert crashed["failed"][0]["listing"] == ["iter_0000001", mg.TRACKER]  # the temporary is gone
    # A killed rank leaves its temporary directory behind, but not a tracker that names it.
    assert crashed["listing"] == [".tmp-iter_0000003", "iter_0000001", mg.TRACKER]
    assert crashed["tracker"] == 1


def test_after_a_crash_the_previous_checkpoint_loads_and_the_next_save_cleans_up(crashed, other_dp, roots):
    side = Path(roots["side"])
    for rank, result in enumerate(other_dp):
        assert result["recovered"] == training.Resumed(1, {"trainer_step": 1}, updates=1)
        assert _equal_states(result["recovered_params"], torch.load(side / f"params{rank}.pt"))
    assert sorted(os.listdir(roots["crash"])) == ["iter_0000001", "iter_0000003", mg.TRACKER]
    assert mg.read_tracker(roots["crash"]) == 3


def _stitched(snapshots: list[dict]) -> dict[tuple, dict[str, torch.Tensor]]:
    """Whole flattened master weights and Adam moments per (stage, parameter), from every DP rank's shard."""
    pieces: dict[tuple, list] = {}
    for snap in snapshots:
        for (name, start, _), tensors in snap["optim"].items():
            pieces.setdefault((snap["stage"], name), []).append((start, tensors))
    return {key: {k: torch.cat([t[k].flatten() for _, t in sorted(parts, key=lambda p: p[0])])
                  for k in ("param", "exp_avg", "exp_avg_sq")} for key, parts in pieces.items()}


def test_the_optimizer_resumes_at_another_data_parallel_size(saved, other_dp, roots):
    assert other_dp[0]["dp_message"] == (
        f"checkpoint {roots['pp2']} iteration {BEFORE} was saved with 2 data-parallel ranks but the actor has 1; "
        "RNG states are kept per data-parallel rank, so resume with no_load_rng (the optimizer state re-shards) "
        "or with 2 data-parallel ranks.")
    before = _stitched([r["pp2"]["at_save"] for r in saved])
    after = _stitched([r["dp1"] for r in other_dp])
    assert before.keys() == after.keys()
    for key, tensors in before.items():
        assert _equal_states(after[key], tensors), key
    for result in other_dp:
        stage = result["dp1"]["stage"]
        params = next(r["pp2"]["at_save"]["params"] for r in saved if r["pp2"]["at_save"]["stage"] == stage)
        assert _equal_states(result["dp1"]["params"], params)
        assert result["resumed"].extra == EXTRA


def test_a_resharded_checkpoint_resumes_with_no_load_optim_and_no_load_rng(saved, other_dp, roots):
    arch = load_model_arch("tiny_qwen")
    snapshots = [r["pp2"]["at_save"] for r in saved]
    full = sharding.merge_state_dicts({s["stage"]: s["params"] for s in snapshots if s["dp"] == 0}, arch,
                                      LAYOUTS["pp2"])
    assert other_dp[0]["weights_only_message"] == (
        f"checkpoint {roots['resharded']} iteration {BEFORE} holds no optimizer state (converted or re-sharded "
        "weights); resume from it with no_load_optim and no_load_rng.")
    for rank, result in enumerate(other_dp):
        assert result["resharded"].iteration == BEFORE
        expected = sharding.shard_state_dict(full, arch, ParallelConfig(2, 1), rank, 0)
        assert _equal_states(result["resharded_params"], expected)


def _save_unstepped_then_resume(rank: int, root: str) -> dict:
    """PPO's critic warm-up checkpoints an actor whose optimizer has never stepped: it saves, and the resumed
    actor's first update is the unbroken one's, bit for bit."""
    arch = load_model_arch("tiny_qwen")
    full = sharding.random_full_state_dict(arch, seed=4)
    unbroken = ActorWorker(arch, ParallelConfig(1, 1), CFG, weights=full)
    unbroken.save_checkpoint(root, 1, extra=EXTRA)
    unbroken.update(_batch(arch.padded_vocab_size, 0))
    release_model_parallel()
    resumed = ActorWorker(arch, ParallelConfig(1, 1), CFG, weights=full)
    resumed.load_checkpoint(root, load_rng=False)
    states = [len(opt.optimizer.state) for opt in resumed.optimizer.chained_optimizers]
    resumed.update(_batch(arch.padded_vocab_size, 0))
    return {"states": states, "equal": all(torch.equal(p, q) for p, q in zip(unbroken.model.parameters(),
                                                                            resumed.model.parameters(), strict=True))}


def test_an_actor_saved_before_its_first_step_resumes_to_the_same_first_step(tmp_path):
    for rank in run_ranks(_save_unstepped_then_resume, 2, str(tmp_path / "ckpt")):
        assert rank["states"] == [0] * len(rank["states"]) and rank["equal"]
