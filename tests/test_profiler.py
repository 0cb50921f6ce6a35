"""profiler_config: MindSpeed-RL's keys checked before Ray starts, and torch.profiler traces written by the ranks of a
real GRPO job, one per step, phase and rank."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from mindrl.config import ConfigError
from mindrl.config.keys import KeyNote, Keys
from mindrl.config.profiler import ProfilerConfig
from mindrl.platform.tracing import TraceOptions, trace
from mindrl.trainer.config import build_trainer_config, compose, load_trainer_config
from mindrl.workers.profiling import PhaseTracing
from tests import jobs

#: MindSpeed-RL's PPO test config's section (tests/st/configs/test_ppo_trainer_qwen25_7b_integrated.yaml)
MINDSPEED_PPO = """
profiler_config:
  integrated:
    profile: true
    mstx: false
    stage: actor_update
    profile_save_path: ./profiler_data
    profile_export_type: db
    profile_step_start: 1
    profile_step_end: 2
    profile_level: level1
    profile_with_memory: false
    profile_record_shapes: false
    profile_with_cpu: true
    profile_with_npu: true
    profile_with_module: false
    profile_analysis: true
    profile_ranks: [0]
"""


def _section(**values) -> list[str]:
    return [f"+profiler_config.integrated.{key}={value}" for key, value in values.items()]


def _one_sentence(message: str) -> None:
    assert "\n" not in message and message.endswith((".", "?")), message
    assert message.count(". ") == 0, message


def test_every_key_is_parsed():
    given = {"role": "integrated", "profile": True, "mstx": True, "stage": ["actor_update", "critic_update"],
             "profile_save_path": "/p", "profile_export_type": "db", "profile_level": "level2",
             "profile_with_memory": True, "profile_record_shapes": True, "profile_with_cpu": False,
             "profile_with_npu": False, "profile_with_module": True, "profile_step_start": 3, "profile_step_end": 5,
             "profile_analysis": True, "profile_ranks": [2, 0]}
    cfg = ProfilerConfig.from_section({"integrated": given}, Keys())
    assert cfg.stage == ("actor_update", "critic_update") and cfg.profile_ranks == (0, 2)
    for key, value in given.items():
        if key not in ("stage", "profile_ranks"):
            assert getattr(cfg, key) == value, key
    assert cfg.trace_options == TraceOptions(host=False, device=False, record_shapes=True, memory=True, stack=True,
                                             level="level2", export_type="db", mstx=True, analyse=True)
    assert [cfg.profiles(step) for step in (2, 3, 4, 5)] == [False, True, True, False]  # [start, end)
    assert cfg.traces_rank(2) and not cfg.traces_rank(1)
    assert cfg.phases(critic=False, reference=False) == ("actor_update", "critic_update")
    everything = ProfilerConfig.from_section({"integrated": {"stage": "all"}}, Keys())
    assert everything.phases(critic=False, reference=True) == (
        "actor_generate", "actor_compute_log_prob", "reference_compute_log_prob", "actor_update")
    assert everything.phases(critic=True, reference=False) == (
        "actor_generate", "actor_compute_log_prob", "actor_update", "critic_compute_values", "critic_update")


@pytest.mark.parametrize("values, words", [
    ({"stage": "actor_updat"}, ["stage names 'actor_updat'", "actor_update"]),
    ({"stage": "[]"}, ["stage must be all, a phase name or a list"]),
    ({"profile_step_start": 3, "profile_step_end": 3}, ["profile_step_end=3 must be above profile_step_start=3"]),
    ({"profile_step_start": 0}, ["counts steps from 1"]),
    ({"profil_level": "level1"}, ["unknown key 'profil_level'", "'profile_level'"]),
    ({"profile_level": "level3"}, ["level_none, level0, level1, level2"]),
    ({"profile_export_type": "csv"}, ["text or db"]),
    ({"profile_ranks": "[-1]"}, ["profile_ranks must be all or a list of ranks"]),
    ({"profile_ranks": "[2]"}, ["names rank 2", "has 2 (ranks 0 to 1)"]),
    ({"profile": "yes"}, ["profile must be true or false"]),
    ({"role": "actor"}, ["filled from the section's name"]),
    ({"stage": "critic_update"}, ["PPO's critic", "group_norm"]),
    ({"profile_with_cpu": "false"}, ["records neither host nor device activity"]),
    ({"profile_step_start": 21, "profile_step_end": 22}, ["past train_iters=20"]),
])
def test_each_mistake_is_one_sentence(values, words):
    with pytest.raises(ConfigError) as err:
        load_trainer_config("grpo_tiny_cpu", _section(**{"profile": "true", **values}))
    _one_sentence(str(err.value))
    assert all(word in str(err.value) for word in words), err.value


def test_another_role_is_refused_and_a_mindspeed_file_gets_every_problem_at_once():
    with pytest.raises(ConfigError) as err:
        load_trainer_config("grpo_tiny_cpu", ["+profiler_config.actor.profile=true"])
    _one_sentence(str(err.value))
    assert "profiler_config.actor is not read" in str(err.value) and "profiler_config.integrated" in str(err.value)
    data = compose("grpo_tiny_cpu")
    data["profiler_config"] = {"actor": {"profile": True}, "integrated": {"profile": True, "with_stack": True}}
    notes: list[KeyNote] = []
    cfg = build_trainer_config(data, notes)
    assert [(note.section, note.key) for note in notes] == [("profiler_config", "actor"),
                                                            ("profiler_config.integrated", "with_stack")]
    assert cfg.profiler.profile


def test_importing_a_recipe_refuses_a_role_or_key_the_section_does_not_have(tmp_path):
    """An importer may leave out only kernel and fixed-behaviour keys: another profiler role or a misspelt key would
    profile something else than the recipe says, so the import names them and writes nothing."""
    from mindrl.trainer.config import TRAINER_CONFIGS_DIR
    from mindrl.trainer.mindspeed_import import import_recipe

    recipe = yaml.safe_load((TRAINER_CONFIGS_DIR / "grpo_tiny_cpu.yaml").read_text())
    recipe["profiler_config"] = {"critic": {"profile": True}, "integrated": {"profile": True, "with_stack": True}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    with pytest.raises(ConfigError) as err:
        import_recipe(tmp_path / "recipe.yaml")
    assert "profiler_config.critic" in str(err.value) and "with_stack" in str(err.value)


def test_mindspeed_rls_ppo_section_loads_naming_its_ascend_only_keys():
    data = compose("ppo_tiny_cpu")
    data.update(yaml.safe_load(MINDSPEED_PPO))
    notes: list[KeyNote] = []
    cfg = build_trainer_config(data, notes)
    assert not notes
    profiler = cfg.profiler
    assert (profiler.role, profiler.stage, profiler.profile_ranks) == ("integrated", ("actor_update",), (0,))
    assert profiler.profile_save_path == "./profiler_data" and profiler.profiles(1) and not profiler.profiles(2)
    ascend = [notice for notice in cfg.notices if notice.startswith("profiler_config.integrated.")]
    assert [notice.split("=")[0] for notice in ascend] == [
        "profiler_config.integrated.profile_level", "profiler_config.integrated.profile_export_type",
        "profiler_config.integrated.profile_analysis"]
    for notice in ascend:
        _one_sentence(notice)
        assert "on CPU torch.profiler" in notice


def test_run_level_checks_defaults_and_notices():
    cfg = load_trainer_config("grpo_tiny_cpu", _section(profile="true"))
    assert cfg.profiler.profile_save_path == str(Path("runs/grpo_tiny_cpu/ckpt/profile"))
    assert not [n for n in cfg.notices if "profiler" in n]
    with pytest.raises(ConfigError, match="no save folder"):
        load_trainer_config("grpo_tiny_cpu", ["megatron_training.save=null", *_section(profile="true")])
    with pytest.raises(ConfigError, match="no reference runs here"):
        load_trainer_config("grpo_tiny_cpu", ["rl_config.init_kl_coef=0", *_section(profile="true",
                                                                                    stage="reference_compute_log_prob")])
    off = load_trainer_config("grpo_tiny_cpu", _section(profile="false", profile_level="level1"))
    assert not off.profiler.profile and (
        "profiler_config.integrated sets profile_level but profile is false, so nothing is traced; set profile: "
        "true to trace.") in off.notices
    assert not load_trainer_config("grpo_tiny_cpu").profiler.profile


class _Rank(PhaseTracing):
    def __init__(self, rank: int) -> None:
        self.rank, self.device = rank, "cpu"


def test_a_rank_traces_only_the_phases_ranks_and_calls_of_a_traced_step(tmp_path):
    cfg = ProfilerConfig.from_section({"integrated": {"profile": True, "stage": "actor_update",
                                                      "profile_save_path": str(tmp_path), "profile_ranks": [1]}},
                                      Keys())
    chosen, other = _Rank(1), _Rank(0)
    assert chosen.traced("actor_update").__class__.__name__ == "nullcontext"  # no step told: nothing traced
    for rank in (chosen, other):
        assert rank.profile_step(cfg, 4, cfg.phases(critic=False, reference=True)) == []
        for phase in ("actor_update", "actor_update", "actor_generate"):
            with rank.traced(phase):
                torch.randn(16, 16) @ torch.randn(16, 16)
    written = chosen.profile_step(cfg, None, ())
    assert written == [str(tmp_path / "step4/actor_update" / name) for name in ("rank1.json", "rank1-2.json")]
    assert other.profile_step(cfg, None, ()) == []
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json")) == [
        "step4/actor_update/rank1-2.json", "step4/actor_update/rank1.json"]
    names = {event.get("name") for event in json.loads(Path(written[0]).read_text())["traceEvents"]}
    assert "aten::mm" in names
    assert chosen.traced("actor_update").__class__.__name__ == "nullcontext"  # the step is over


@pytest.mark.gpu
def test_a_cuda_trace_holds_the_devices_kernels(tmp_path):
    a = torch.randn(256, 256, device="cuda")
    with trace("cuda", TraceOptions(), tmp_path / "rank0") as path:
        (a @ a).sum().item()
    events = json.loads(path.read_text())["traceEvents"]
    assert any(event.get("cat") == "kernel" for event in events)


@pytest.mark.npu
def test_an_npu_trace_is_torch_npus_folder(tmp_path):
    a = torch.randn(256, 256).to("npu")
    with trace("npu", TraceOptions(analyse=True), tmp_path / "rank0") as path:
        (a @ a).sum().item()
    assert path == tmp_path / "rank0" and any(path.iterdir())


@pytest.mark.job
def test_a_grpo_job_traces_the_selected_phases_of_the_selected_step(tiny_math_data, tmp_path):
    """Two steps of grpo_tiny_cpu (two ranks, a separate old log-prob pass) with step 1's update and old log-prob
    pass traced: a Chrome trace per rank of each, holding the model's matmuls, and nothing else."""
    tokenizer, root = tiny_math_data
    save = tmp_path / "run"
    extra = {"megatron_training.train_iters": 2, "megatron_training.save_interval": 0,
             "+profiler_config.integrated.profile": "true",
             "+profiler_config.integrated.stage": "[actor_update,actor_compute_log_prob]",
             "+profiler_config.integrated.profile_step_start": 1, "+profiler_config.integrated.profile_step_end": 2}
    log = tmp_path / "log"
    jobs.run("train_grpo.py", "grpo_tiny_cpu", jobs.grpo_overrides(tokenizer, root / "eight", save, **extra), log)
    profile = save / "profile"
    assert sorted(p.relative_to(profile).as_posix() for p in profile.rglob("*") if p.is_file()) == [
        "step1/actor_compute_log_prob/rank0.json", "step1/actor_compute_log_prob/rank1.json",
        "step1/actor_update/rank0.json", "step1/actor_update/rank1.json"]
    for path in profile.rglob("*.json"):
        names = {event.get("name") for event in json.loads(path.read_text())["traceEvents"]}
        assert names & {"aten::mm", "aten::addmm"}, path
    text = log.read_text()
    for phase in ("actor_update", "actor_compute_log_prob"):
        assert f"profile: step 1 {phase}: 2 traces in {profile / 'step1' / phase}" in text
    assert "profile: step 2" not in text
