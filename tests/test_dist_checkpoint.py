"""torch_dist checkpoints: saved at TP=2×PP=2, resumed at TP=1×PP=2, TP=2×PP=1 and TP=1×PP=1×DP=4 (an MoE model at
EP=2 resumed at EP=1), the optimizer state resharded, not restarted; asynchronous saves hold the state of the moment
they were asked for and resume bit-identically; a checkpoint written by megatron-core's own dist_checkpointing.save
loads as starting weights; damaged or foreign files are named in one sentence.

Launches: 4 ranks save (dense at TP2×PP2, MoE at EP2), 4 ranks run each new layout from the saved state and from the
start, 2 ranks save a bare megatron-core GPTModel and start an actor from it.
"""

import dataclasses
import json
import os
import re
import shutil
import socket
from pathlib import Path

import pytest
import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

from mindrl.checkpoint import dist as dist_ckpt
from mindrl.checkpoint import files, training
from mindrl.checkpoint import megatron as mg
from mindrl.checkpoint.training import initial_moments
from mindrl.config import ConfigError, ParallelConfig, load_model_arch
from mindrl.config.lora import LoraConfig
from mindrl.distributed import release_model_parallel
from mindrl.launch import run_ranks
from mindrl.models import sharding
from mindrl.workers.megatron_worker import ActorWorker
from tests.test_training_checkpoint import CFG, _batch

TORCH_DIST = {"ckpt_format": "torch_dist", "mini_batch_size": 8}  # one mini-batch, whole on 4 DP ranks
SAVED_AT = ParallelConfig(2, 2)
RESUME_AT = {"tp1pp2": ParallelConfig(1, 2), "tp2pp1": ParallelConfig(2, 1), "dp4": ParallelConfig(1, 1)}
LORA = LoraConfig(("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), r=4, alpha=8.0)
ADAPTERS_ONLY = dataclasses.replace(LORA, ckpt_filter=True)
MOE_SAVED, MOE_RESUMED = ParallelConfig(1, 1, expert_model_parallel_size=2), ParallelConfig(1, 1)


def _actor(arch_name: str, par: ParallelConfig, **cfg) -> ActorWorker:
    release_model_parallel()
    arch = load_model_arch(arch_name)
    return ActorWorker(arch, par, dataclasses.replace(CFG, **TORCH_DIST, **cfg),
                       weights=sharding.random_full_state_dict(arch, seed=4))


def _canonical(actor: ActorWorker) -> list[tuple[str, tuple, torch.Tensor]]:
    """This rank's main replicas of the weights, fp32 master weights and Adam moments, each with its place in the
    whole-model tensor (megatron-core's own description of the layout), for stitching in the test process."""
    with initial_moments(actor.optimizer, keep=False):
        model = actor.model.sharded_state_dict()
        state = {"model": model,
                 "optimizer": actor.optimizer.sharded_state_dict(model, metadata=dist_ckpt.OPTIMIZER_SHARDING)}
        apply_factories(state)
        out = []
        for value in nested_values(state):
            replica = value.replica_id if isinstance(value, ShardedTensor) else None
            if replica is None or any(replica if isinstance(replica, tuple) else (replica,)):
                continue
            out.append((value.key, tuple(value.global_shape), value.global_slice(), value.data.detach().clone()))
    return out


def _stitch(ranks: list[list]) -> dict[str, torch.Tensor]:
    whole: dict[str, torch.Tensor] = {}
    for entries in ranks:
        for key, shape, where, data in entries:
            target = whole.setdefault(key, torch.full(shape, float("nan"), dtype=data.dtype))
            target[where] = data.reshape(target[where].shape)
    return whole


def _save(rank: int, roots: dict[str, str]) -> dict:
    vocab = load_model_arch("tiny_qwen").padded_vocab_size
    actor = _actor("tiny_qwen", SAVED_AT)
    training.save(actor._train_state("save"), roots["base"], 1)  # the initial weights, in the legacy format
    actor.update(_batch(vocab, 0))
    actor.save_checkpoint(roots["dense"], 1, extra={"job": "grpo", "data": {"index": 1}})
    training.save(actor._train_state("save"), roots["legacy"], 1, extra={"job": "grpo"})  # the same state, per rank
    # asynchronous: the state of the moment is written while the next update changes the weights
    asynchronous = _actor("tiny_qwen", SAVED_AT, async_save=True)
    asynchronous.update(_batch(vocab, 0))
    at_save = _canonical(asynchronous)
    asynchronous.save_checkpoint(roots["async"], 1, extra={"job": "grpo"})
    published_early = (Path(roots["async"]) / mg.TRACKER).is_file()
    asynchronous.update(_batch(vocab, 1))
    asynchronous.finish_saves()
    adapted = _actor("tiny_qwen", SAVED_AT, lora=LORA)
    adapted.update(_batch(vocab, 0))
    adapted.save_checkpoint(roots["lora"], 1, extra={"job": "grpo"})
    training.save(adapted._train_state("save"), roots["lora_legacy"], 1, extra={"job": "grpo"})
    adapters_only = _actor("tiny_qwen", SAVED_AT, lora=ADAPTERS_ONLY)
    adapters_only.update(_batch(vocab, 0))
    adapters_only.save_checkpoint(roots["lora_only"], 1, extra={"job": "grpo", "initial_weights": roots["base"]})
    moe_vocab = load_model_arch("tiny_qwen3_moe").padded_vocab_size
    moe = _actor("tiny_qwen3_moe", MOE_SAVED)
    moe.update(_batch(moe_vocab, 0))
    moe.save_checkpoint(roots["moe"], 1, extra={"job": "grpo"})
    return {"async_at_save": at_save, "async_published_early": published_early}


def _resume(rank: int, roots: dict[str, str]) -> dict:
    vocab = load_model_arch("tiny_qwen").padded_vocab_size
    out = {}
    for name, par in RESUME_AT.items():
        unbroken = _actor("tiny_qwen", par)
        unbroken.update(_batch(vocab, 0))
        first = _canonical(unbroken)
        second_metrics = unbroken.update(_batch(vocab, 1))
        resumed = _actor("tiny_qwen", par)
        loaded = resumed.load_checkpoint(roots["dense"])
        at_load = _canonical(resumed)
        metrics = resumed.update(_batch(vocab, 1))
        out[name] = {"unbroken": (first, _canonical(unbroken), second_metrics),
                     "resumed": (at_load, _canonical(resumed), metrics), "iteration": loaded.iteration,
                     "extra": loaded.extra}
    return out


def _lora_resume(rank: int, roots: dict[str, str]) -> dict:
    vocab = load_model_arch("tiny_qwen").padded_vocab_size
    unbroken = _actor("tiny_qwen", RESUME_AT["dp4"], lora=LORA)
    unbroken.update(_batch(vocab, 0))
    resumed = _actor("tiny_qwen", RESUME_AT["dp4"], lora=LORA)
    resumed.load_checkpoint(roots["lora"])
    only = _actor("tiny_qwen", RESUME_AT["dp4"], lora=ADAPTERS_ONLY)
    only.load_checkpoint(roots["lora_only"])
    arch = load_model_arch("tiny_qwen")
    other_base = ActorWorker(arch, RESUME_AT["dp4"], dataclasses.replace(CFG, **TORCH_DIST, lora=ADAPTERS_ONLY),
                             weights=sharding.random_full_state_dict(arch, seed=5))
    try:
        other_base.load_checkpoint(roots["lora_only"])
        refusal = None
    except ConfigError as err:
        refusal = str(err)
    return {"unbroken": _canonical(unbroken), "resumed": _canonical(resumed), "adapters_only": _canonical(only),
            "refusal": refusal}


def _async_resume(rank: int, roots: dict[str, str]) -> list:
    actor = _actor("tiny_qwen", SAVED_AT, async_save=True)
    actor.load_checkpoint(roots["async"])
    return _canonical(actor)


def _moe_resume(rank: int, roots: dict[str, str]) -> dict:
    vocab = load_model_arch("tiny_qwen3_moe").padded_vocab_size
    unbroken = _actor("tiny_qwen3_moe", MOE_RESUMED)
    unbroken.update(_batch(vocab, 0))
    resumed = _actor("tiny_qwen3_moe", MOE_RESUMED)
    resumed.load_checkpoint(roots["moe"])
    return {"unbroken": _canonical(unbroken), "resumed": _canonical(resumed)}


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("dist_ckpt")
    return {name: str(base / name) for name in ("dense", "legacy", "async", "moe", "lora", "lora_legacy", "lora_only",
                                                   "base")}


@pytest.fixture(scope="module")
def saved(roots) -> list[dict]:
    return run_ranks(_save, 4, roots)


@pytest.fixture(scope="module")
def resumed(saved, roots) -> list[dict]:
    return run_ranks(_resume, 4, roots)


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float) -> list[str]:
    """Keys whose largest difference exceeds rtol × the tensor's largest magnitude (or that are missing)."""
    bad = [key for key in want if key not in got]
    for key, value in want.items():
        if key in got:
            assert not torch.isnan(got[key]).any(), f"{key} was not stitched whole"
            scale = value.abs().max().item() or 1.0
            if (got[key].double() - value.double()).abs().max().item() > rtol * scale:
                bad.append(key)
    return bad


def test_the_files_are_megatron_cores_distributed_format(saved, roots):
    root = Path(roots["dense"])
    folder = root / mg.iteration_dir_name(1)
    assert mg.read_tracker(root) == 1
    assert json.loads((folder / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert (folder / ".metadata").is_file() and list(folder.glob("*.distcp"))
    assert files.format_of(root) == "torch_dist" and files.damage(root, 1) is None
    assert files.holds_training_state(root, 1)
    assert not list(root.glob(".tmp-*"))


@pytest.mark.parametrize("layout", list(RESUME_AT))
def test_a_resume_at_another_layout_continues_as_an_unbroken_run_there(resumed, layout):
    """After the load, weights, fp32 master weights and both Adam moments equal those of a run that took the same
    first step at the new layout (their only difference: the first step's sums in another order), and so does
    the next step's outcome. An optimizer that restarted would hold zero moments here."""
    runs = [rank[layout] for rank in resumed]
    assert {run["iteration"] for run in runs} == {1} and runs[0]["extra"]["data"] == {"index": 1}
    for index in (0, 1):
        want = _stitch([run["unbroken"][index] for run in runs])
        got = _stitch([run["resumed"][index] for run in runs])
        assert any(key.startswith("optimizer.state.exp_avg_sq.") for key in want)
        assert set(got) == set(want)
        assert _close(got, want, rtol=1e-5) == [], f"step {index + 1} state differs"
    for key in ("pg_loss", "grad_norm", "lr"):
        assert runs[0]["resumed"][2][key] == pytest.approx(runs[0]["unbroken"][2][key], rel=1e-5), key


def test_a_restarted_optimizer_would_fail_the_comparison(resumed):
    runs = [rank["tp2pp1"] for rank in resumed]
    want = _stitch([run["unbroken"][0] for run in runs])
    restarted = {key: torch.zeros_like(value) if key.startswith("optimizer.state.exp_avg") else value
                 for key, value in _stitch([run["resumed"][0] for run in runs]).items()}
    assert _close(restarted, want, rtol=1e-5)


def test_an_async_save_holds_the_state_it_was_asked_for_and_resumes_bit_identically(saved, roots):
    assert not any(rank["async_published_early"] for rank in saved)  # no tracker before every write was done
    assert mg.read_tracker(roots["async"]) == 1 and files.damage(roots["async"], 1) is None
    loaded = run_ranks(_async_resume, 4, roots)
    want, got = _stitch([rank["async_at_save"] for rank in saved]), _stitch(loaded)
    assert set(got) == set(want)
    assert all(torch.equal(got[key], want[key]) for key in want)


def test_an_moe_checkpoint_saved_at_ep2_resumes_at_ep1_with_its_expert_optimizer_state(saved, roots):
    runs = run_ranks(_moe_resume, 4, roots)
    want, got = _stitch([run["unbroken"] for run in runs]), _stitch([run["resumed"] for run in runs])
    assert any("experts" in key and key.startswith("optimizer.state.exp_avg.") for key in want)
    assert set(got) == set(want)
    assert _close(got, want, rtol=1e-5) == []


def bare_megatron_save(root: str) -> None:
    """A plain megatron-core GPTModel (its own local layer spec) saved by dist_checkpointing.save with its default
    strategy, as Megatron-LM writes a model: run as a process of its own (that writer spawns processes, which a
    rank of run_ranks may not)."""
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mindrl.distributed import init_distributed, init_model_parallel
    from mindrl.models.gpt import transformer_config

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    init_distributed(0, 1, master_port=port)
    arch = load_model_arch("tiny_qwen")
    init_model_parallel(ParallelConfig(1, 1), seed=7, arch=arch)
    config = transformer_config(arch, ParallelConfig(1, 1), torch.float32)
    model = GPTModel(config, get_gpt_layer_local_spec(qk_layernorm=arch.qk_layernorm), arch.padded_vocab_size,
                     arch.max_position_embeddings,
                     share_embeddings_and_output_weights=not arch.untie_embeddings_and_output_weights,
                     position_embedding_type="rope", rotary_base=arch.rotary_base)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.02)
    folder = Path(root) / mg.iteration_dir_name("release")
    folder.mkdir(parents=True)
    mg.write_tracker(root, "release")
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(folder))
    torch.save({name: p for name, p in model.state_dict().items() if "_extra_state" not in name},
               f"{root}.weights.pt")
    torch.distributed.destroy_process_group()


def _start_from(rank: int, root: str) -> dict:
    release_model_parallel()
    actor = ActorWorker(load_model_arch("tiny_qwen"), ParallelConfig(2, 1), CFG, weights=root)
    return {"actor": {n: p.detach().clone() for n, p in actor.model.named_parameters()}, "tp_rank": actor.tp_rank}


def test_a_bare_megatron_core_save_loads_as_starting_weights(tmp_path):
    import subprocess
    import sys

    root = str(tmp_path / "bare")
    subprocess.run([sys.executable, "-c", f"from tests.test_dist_checkpoint import bare_megatron_save; "
                                          f"bare_megatron_save({root!r})"],
                   check=True, cwd=Path(__file__).resolve().parents[1], env={**os.environ, "OMP_NUM_THREADS": "1"})
    ranks = run_ranks(_start_from, 2, root)
    bare = torch.load(f"{root}.weights.pt")
    stages = {(rank["tp_rank"], 0): rank["actor"] for rank in ranks}
    whole = sharding.merge_state_dicts(stages, load_model_arch("tiny_qwen"), ParallelConfig(2, 1))
    assert set(bare) <= set(whole)
    for name, value in bare.items():
        assert torch.equal(whole[name], value), name


def test_damaged_and_foreign_torch_dist_files_are_one_sentence(saved, roots, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(roots["dense"], root)
    folder = root / mg.iteration_dir_name(1)
    shard = sorted(folder.glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    problem = files.damage(root, 1)
    assert problem.startswith(f"{shard} is cut short (") and problem.count(".") <= 3
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    assert "'zarr' distributed format" in files.damage(root, 1)
    with pytest.raises(ConfigError, match=r"is in the torch_dist format but actor_config.ckpt_format is torch; set "
                                          r"ckpt_format: torch_dist .* or auto_detect_ckpt_format: true\.$"):
        files.check_format(roots["dense"], 1, "torch", False, "actor_config.load")
    files.check_format(roots["dense"], 1, "torch", True, "actor_config.load")
    other = load_model_arch("tiny_qwen3_moe")
    with pytest.raises(ConfigError, match=r"holds a different architecture than model tiny_qwen3_moe: "):
        files.check_checkpoint(roots["dense"], 1, other)


def _convert(*flags) -> None:
    from mindrl.ckpt_convert.cli import main

    assert main([*map(str, flags), "--no-progress"]) == 0


def test_torch_dist_converts_to_hf_as_the_legacy_files_of_the_same_state_do_bit_for_bit(saved, roots, tmp_path):
    """The same trained state saved both ways at TP=2×PP=2: megatron-core's reader of the distributed files and
    mindrl's joining of the per-rank ones give the same HF tensors; and legacy → torch_dist → HF loses nothing."""
    from safetensors.torch import load_file

    def hf(load_dir, name):
        _convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", load_dir, "--save-dir",
                 tmp_path / name)
        return load_file(tmp_path / name / "model-00001-of-00001.safetensors")

    from_legacy, from_dist = hf(roots["legacy"], "hf_legacy"), hf(roots["dense"], "hf_dist")
    assert set(from_legacy) == set(from_dist)
    assert all(torch.equal(from_legacy[key], from_dist[key]) for key in from_legacy)
    _convert("--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", roots["legacy"], "--save-dir",
             tmp_path / "resaved", "--ckpt-format", "torch_dist")
    assert files.format_of(tmp_path / "resaved") == "torch_dist"
    again = hf(tmp_path / "resaved", "hf_again")
    assert all(torch.equal(again[key], from_legacy[key]) for key in from_legacy)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch left


def _failed_async_save(rank: int, root: str) -> dict:
    """Iteration 1 saved; iteration 2 written in the background while rank 1's files may not grow past 64 KiB."""
    import resource

    vocab = load_model_arch("tiny_qwen").padded_vocab_size
    actor = _actor("tiny_qwen", ParallelConfig(2, 1), async_save=True)
    actor.update(_batch(vocab, 0))
    actor.save_checkpoint(root, 1)
    actor.update(_batch(vocab, 1))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, limit[1]))
    try:
        actor.save_checkpoint(root, 2)
        actor.finish_saves()
    except RuntimeError as err:
        message = str(err)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    actor.update(_batch(vocab, 2))  # a failed save is not asked again
    actor.save_checkpoint(root, 3)
    actor.finish_saves()
    return {"message": message}


def test_a_failed_async_save_is_one_sentence_on_every_rank_and_loses_nothing_earlier(tmp_path):
    root = tmp_path / "failing"
    ranks = run_ranks(_failed_async_save, 2, str(root), timeout_s=300)
    for rank in ranks:
        assert re.fullmatch(
            rf"saving checkpoint iteration 2 to {re.escape(str(root))} failed on rank 0 \(RuntimeError: the writes "
            rf"of rank 1 failed \(.*File too large.*\)\); the checkpoints before it are untouched and the tracker "
            rf"still names iteration 1 — free space or fix the folder, then resume with load={re.escape(str(root))}"
            rf"\.", rank["message"], flags=re.S), rank["message"]
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000001", "iter_0000003", mg.TRACKER]
    assert mg.read_tracker(root) == 3 and files.damage(root, 1) is None and files.damage(root, 3) is None


def test_a_lora_run_resumes_at_another_layout_with_its_adapters_cut_as_the_layout_cuts_them(saved, roots):
    """Saved at TP=2×PP=2, resumed at DP=4: each adapter factor (a column-parallel layer's B, a row-parallel one's
    A, and the gated fc1's B in its gate and up halves) and its Adam moments equal an unbroken run's there."""
    runs = run_ranks(_lora_resume, 4, roots)
    want, got = _stitch([run["unbroken"] for run in runs]), _stitch([run["resumed"] for run in runs])
    adapters = [key for key in want if ".adapter.lora_" in key]
    assert any(key.startswith("optimizer.state.exp_avg.") and key.endswith("linear_fc1.adapter.lora_B")
               for key in adapters)
    assert any(want[key].abs().max() > 0 for key in adapters if key.endswith("lora_B"))  # B has left zero
    assert set(got) == set(want)
    assert _close(got, want, rtol=1e-5) == []
    only = _stitch([run["adapters_only"] for run in runs])  # adapters-only: the base rebuilt, the adapters loaded
    assert set(only) == set(want) and _close(only, want, rtol=1e-5) == []
    assert all(re.fullmatch(rf"checkpoint {re.escape(roots['lora_only'])} holds LoRA adapters only, trained on other "
                            rf"base weights than the model's \(\S+ differs\); start the run from the base checkpoint "
                            rf"they were trained on \(its `initial_weights`\), unchanged\.", run["refusal"])
               for run in runs), runs[0]["refusal"]


def test_a_lora_torch_dist_checkpoint_exports_merged_as_its_legacy_files_do(saved, roots, tmp_path):
    from safetensors.torch import load_file

    exported = {}
    for name in ("lora", "lora_legacy"):
        _convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", roots[name], "--save-dir",
                 tmp_path / name)
        exported[name] = load_file(tmp_path / name / "model-00001-of-00001.safetensors")
    assert set(exported["lora"]) == set(exported["lora_legacy"])
    for key, value in exported["lora_legacy"].items():  # W + (alpha / r)·B·A, merged per TP shard or whole
        torch.testing.assert_close(exported["lora"][key], value, rtol=0, atol=1e-6)
    # adapters-only: merged into the recorded initial weights (a legacy checkpoint at TP=2×PP=2), checked first
    _convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", roots["lora_only"], "--save-dir",
             tmp_path / "only")
    only = load_file(tmp_path / "only" / "model-00001-of-00001.safetensors")
    assert set(only) == set(exported["lora"]) and all(torch.equal(only[k], v) for k, v in exported["lora"].items())
    with pytest.raises(ConfigError, match=r"is a LoRA run's torch_dist checkpoint, which mindrl resumes but does "
                                          r"not start from; export it with cli/convert_ckpt.py"):
        files.check_start(roots["lora"], 1)


def _vision_language(rank: int, root: str) -> dict:
    """tiny_qwen25_vl saved at TP=2 with its vision tower moved off its initial weights, loaded at DP=2."""
    saver = _actor("tiny_qwen25_vl", ParallelConfig(2, 1))
    with torch.no_grad():
        for param in saver.model.vision_model.parameters():
            param.add_(0.01)
    saver.save_checkpoint(root, 1)
    saved = _canonical(saver)
    loader = _actor("tiny_qwen25_vl", ParallelConfig(1, 1))
    loader.load_checkpoint(root)
    return {"saved": saved, "loaded": _canonical(loader)}


def test_a_vision_language_model_resumes_at_another_layout_with_its_vision_tower(tmp_path):
    runs = run_ranks(_vision_language, 2, str(tmp_path / "vl"))
    want, got = _stitch([run["saved"] for run in runs]), _stitch([run["loaded"] for run in runs])
    assert any(key.startswith("vision_model.") for key in want) and set(got) == set(want)
    assert all(torch.equal(got[key], want[key]) for key in want)


def _odd_vocabulary(rank: int, root: str) -> dict:
    """A vocabulary of 1023 rows, padded to 1024 at TP=2 and not at TP=1: saved at TP=2 after a step, loaded at
    DP=2 (megatron-core reads the rows both have)."""
    arch = dataclasses.replace(load_model_arch("tiny_qwen"), padded_vocab_size=1023, make_vocab_size_divisible_by=1)
    full = sharding.random_full_state_dict(arch, seed=4)
    out = {}
    for name, par in (("saved", ParallelConfig(2, 1)), ("loaded", ParallelConfig(1, 1))):
        release_model_parallel()
        actor = ActorWorker(arch, par, dataclasses.replace(CFG, **TORCH_DIST), weights=full)
        if name == "saved":
            actor.update(_batch(1023, 0))
            actor.save_checkpoint(root, 1)
        else:
            actor.load_checkpoint(root)
        out[name] = _canonical(actor)
    return out


def test_a_resume_at_a_tp_that_pads_the_vocabulary_otherwise_reads_the_rows_both_have(tmp_path):
    runs = run_ranks(_odd_vocabulary, 2, str(tmp_path / "odd"))
    saved, loaded = _stitch([run["saved"] for run in runs]), _stitch([run["loaded"] for run in runs])
    assert set(saved) == set(loaded)
    padded = [key for key in saved if saved[key].shape != loaded[key].shape]
    assert "embedding.word_embeddings.weight" in padded
    assert any(key.startswith("optimizer.state.exp_avg.embedding") for key in padded)
    for key, value in saved.items():
        rows = min(value.shape[0], loaded[key].shape[0]) if key in padded else value.shape[0]
        assert torch.equal(loaded[key][:rows], value[:rows]), key
