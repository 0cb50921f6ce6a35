"""tools/shrink_recipe.py: MindSpeed-RL's recipes at tiny size on two CPU ranks, each keeping its algorithm's keys,
and one recipe per algorithm (GRPO, DAPO with dynamic sampling, PPO, LoRA, a mixture of experts at EP2, multi-turn
tool use) trained for two steps by the command its stage names."""

import sys
from pathlib import Path

import pytest
import yaml

from mindrl.config.keys import DROPPABLE
from mindrl.config.resources import Cluster
from mindrl.trainer.config import check_resources, load_mindspeed_config, trainer_loader
from mindrl.trainer.megatron import STAGES
from tests import jobs

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT.parent / "shared/reference/mindspeed_rl/configs"
sys.path.insert(0, str(ROOT / "tools"))

from shrink_recipe import main as shrink_main  # noqa: E402

#: the recipe that does not load at full size (prompts of 8196 + responses of 2048 > its max_model_len of 10240), so
#: its shrunk copy has nothing to be compared with
NOT_SHRINKABLE = ("grpo_deepseek_r1_671b_A2",)
DPO = "dpo_qwen3_30b_a3b_A3"
#: rl_config keys that size a run, which shrinking may change (and dynamic sampling's rounds, bounded where the
#: recipe allows any number); every other rl_config key is the algorithm's
SIZE_KEYS = {"filter_groups_max_batches", "n_samples_per_prompt", "max_prompt_length", "tensorboard_dir",
             "mini_batch_size", "filter_groups_train_batch_size", "rollout_max_tokens", "overlong_buffer",
             "max_total_response_length", "max_tool_response_length", "max_tool_calls"}


def _recipe(name: str) -> Path:
    path = REFERENCE / f"{name}.yaml"
    if not path.is_file():
        pytest.skip(f"MindSpeed-RL reference configs not found at {REFERENCE}")
    return path


def _shrink(name: str, tokenizer: Path, data: Path, folder: Path, *overrides: str) -> Path:
    out = folder / "config" / f"{name}.yaml"
    assert shrink_main([str(_recipe(name)), "--tokenizer", str(tokenizer), "--data", str(data), "--save",
                        str(folder / "run"), "--out", str(out), *overrides]) == 0
    return out


def _names() -> list[str]:
    return sorted(p.stem for p in REFERENCE.glob("*.yaml") if p.stem not in NOT_SHRINKABLE) or ["grpo_qwen25_7b_A3"]


@pytest.mark.parametrize("name", [name for name in _names() if name != DPO])
def test_a_shrunk_recipe_keeps_its_algorithm_and_fits_two_cpu_ranks(name, tiny_math_data, tmp_path):
    out = _shrink(name, tiny_math_data[0], tiny_math_data[1] / "eight", tmp_path)
    original, shrunk = yaml.safe_load(_recipe(name).read_text()), yaml.safe_load(out.read_text())
    cfg = trainer_loader(jobs.stage_of(name))(name, [], out.parent)  # mindrl's own loader: nothing left to drop
    check_resources(cfg, Cluster({"CPU": 2}))
    assert sum(resource.count for _, resource in cfg.device_groups()) == 2
    if "tool_config_path" in shrunk["rl_config"]:  # found from the recipe's folder (docs/config.md)
        found, given = Path(shrunk["rl_config"].pop("tool_config_path")), original["rl_config"].pop("tool_config_path")
        assert found.is_file() and found.as_posix().endswith(given.removeprefix("./"))
    sized = {key for key in original["rl_config"] if key in SIZE_KEYS or
             key.endswith(("_resource", "max_packing_token_size", "dynamic_max_batch_size"))}
    kept = {key: value for key, value in original["rl_config"].items() if key not in sized}
    dropped = set(kept) - set(shrunk["rl_config"])
    assert dropped <= DROPPABLE  # only the importer's kernel and fixed-behaviour keys
    assert {key: value for key, value in kept.items() if key not in dropped} == {
        key: shrunk["rl_config"][key] for key in kept if key not in dropped}
    tiny = cfg.actor_config.arch
    assert tiny.num_layers == 2 and tiny.padded_vocab_size == 1024
    full, _ = load_mindspeed_config(_recipe(name))
    arch = full.actor_config.arch
    assert (tiny.qk_layernorm, tiny.add_qkv_bias, tiny.untie_embeddings_and_output_weights, tiny.is_moe,
            tiny.multi_latent_attention, tiny.q_lora_rank is None, tiny.moe_router_enable_expert_bias) == (
        arch.qk_layernorm, arch.add_qkv_bias, arch.untie_embeddings_and_output_weights, arch.is_moe,
        arch.multi_latent_attention, arch.q_lora_rank is None, arch.moe_router_enable_expert_bias)
    assert (cfg.loss, cfg.stage, cfg.actor_config.lora) == (full.loss, full.stage, full.actor_config.lora)
    assert cfg.actor_config.parallel.cp == min(full.actor_config.parallel.cp, 2)
    assert cfg.actor_config.swap_optimizer == full.actor_config.swap_optimizer


def test_the_shrunk_dpo_recipe_keeps_its_loss_on_two_cpu_ranks(facts_pairs, tmp_path):
    from mindrl.trainer.dpo_config import load_dpo_config
    from mindrl.trainer.stage import check_resources as check_stage_resources

    out = _shrink(DPO, *facts_pairs, tmp_path)
    cfg, (full, _) = load_dpo_config(DPO, [], out.parent), load_mindspeed_config(_recipe(DPO))
    check_stage_resources(cfg, Cluster({"CPU": 2}))
    assert (cfg.section.resource.kind, cfg.section.resource.count, cfg.section.ref_model) == ("CPU", 2, None)
    assert cfg.section.loss == full.section.loss and cfg.training.arch.is_moe and cfg.training.arch.qk_layernorm
    assert cfg.notices == full.notices[1:]  # its devices are given now; its no_save keys are still said


# algorithm → (MindSpeed-RL's recipe; mindrl's own of the same algorithm, trained where MindSpeed-RL's configs are
# absent; the tool's overrides; metrics each step must have). A random tiny model never writes DAPO's "Answer:" line,
# so dynamic sampling filters on the total score, which the overlong penalty spreads (the tool bounds unlimited rounds)
SCORE = "++rl_config.filter_groups_metric=score"
TRAINED = {
    "grpo": ("grpo_qwen25_7b_A3", "rlxf/grpo_qwen25_7b", (), ("actor/kl_loss", "actor/pg_loss")),
    "dapo": ("dapo_qwen3_32b_A3", "rlxf/dapo_long_tiny_cpu", ("++rl_config.filter_groups_enable=true", SCORE),
             ("filter_groups/kept_groups", "actor/pg_clipfrac")),
    "ppo": ("ppo_qwen25_32b_A3", "rlxf/ppo_qwen25_32b", (), ("critic/vf_loss",)),
    "lora": ("grpo_lora_qwen25_32b_A2", "rlxf/grpo_qwen25_32b_lora", (), ("actor/pg_loss",)),
    "moe": ("grpo_qwen3_235b_a22b_A2", "rlxf/grpo_qwen3_30b_a3b", (), ("actor/pg_loss",)),  # swap_optimizer too
    "mla": ("grpo_deepseek_r1_671b_A3", "rlxf/grpo_deepseek_v3", (), ("actor/pg_loss",)),
    "multi_turn": ("dapo_qwen25_7b_A2_multi_turn", "rlxf/retool_qwen25_7b", (), ("actor/pg_loss",)),
    "dpo": (DPO, "dpo/dpo_facts_cpu", (), ("dpo/loss", "rewards/accuracies")),
}


@pytest.mark.job
@pytest.mark.parametrize("algorithm", sorted(TRAINED))
def test_a_shrunk_recipe_trains_two_steps(algorithm, tiny_math_data, facts_pairs, tmp_path):
    """MindSpeed-RL's recipe of each algorithm where its configs are here, else mindrl's own cluster recipe."""
    from mindrl.config.paths import CONFIGS_DIR

    reference, own, overrides, names = TRAINED[algorithm]
    recipe = REFERENCE / f"{reference}.yaml" if REFERENCE.is_dir() else CONFIGS_DIR / f"{own}.yaml"
    tokenizer, data = facts_pairs if algorithm == "dpo" else (tiny_math_data[0], tiny_math_data[1] / "eight")
    if algorithm == "multi_turn":  # prompts announcing the recipe's tools, as its rollout checks they do
        data = tmp_path / "tool_prompts"
    out = tmp_path / "config" / f"{recipe.stem}.yaml"
    assert shrink_main([str(recipe), "--tokenizer", str(tokenizer), "--data", str(data), "--save",
                        str(tmp_path / "run"), "--out", str(out), *overrides]) == 0
    shrunk = yaml.safe_load(out.read_text())
    if algorithm == "multi_turn":
        _tool_prompts(tokenizer, data, shrunk["rl_config"]["tool_config_path"])
    script = Path(STAGES[shrunk["megatron_training"]["stage"]]).name  # the command the stage names
    jobs.run(script, recipe.stem, ["--config-dir", str(out.parent)], tmp_path / "log")
    lines = jobs.metrics(tmp_path / "run" / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert all(key in line for key in names), sorted(line)
        assert all(value == value for value in line.values())  # no NaN


def _tool_prompts(tokenizer: Path, out: Path, tool_config_path: str) -> None:
    from mindrl.data.preprocess import PreprocessConfig, preprocess

    preprocess(PreprocessConfig(output_dir=str(out), tokenizer_name_or_path=str(tokenizer),
                                generator={"kind": "mixed", "num_samples": 40, "seed": 0}, prompt_type="chatml",
                                map_keys={"prompt": "question", "answer": "answer"}, data_source="synthetic_math",
                                test_fraction=0.1, tool_config_path=tool_config_path))
