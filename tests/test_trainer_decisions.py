"""The trainer's decided behaviours: keys that do nothing are warned about, a foreign config's unsupported keys are
named all at once, a custom verifier's signature is checked at load, and the CLI says these before anything runs."""

import os
import subprocess
import sys

import pytest

from mindrl.config import ConfigError
from mindrl.trainer.config import load_trainer_config
from tests import jobs

os.environ.setdefault("OMP_NUM_THREADS", "1")

# (overrides, the key each warning must name, what it must say would enable it)
INERT = {
    "save_interval without save": (["megatron_training.save=null"], ["save_interval=10"], "without save"),
    "filter groups without dynamic sampling": (
        ["+rl_config.filter_groups_metric=format", "+rl_config.filter_groups_max_batches=3"],
        ["rl_config.filter_groups_metric='format'", "rl_config.filter_groups_max_batches=3"],
        "filter_groups_enable: true"),
    "IS threshold without IS": (["+rl_config.rollout_is_threshold=5.0"], ["rl_config.rollout_is_threshold=5.0"],
                                "rollout_is: none"),
    "reward model keys without one": (["+rl_config.reward_model_normalize=group", "+rl_config.reward_model_weight=0.5"],
                                      ["rl_config.reward_model_normalize='group'", "rl_config.reward_model_weight=0.5"],
                                      "without a reward model"),
    "ref_config beside the integrated worker": (["+ref_config.micro_batch_size=4"], ["ref_config.micro_batch_size=4"],
                                                "use_integrated_worker: false"),
}


@pytest.mark.parametrize("case", sorted(INERT))
def test_a_key_its_enabling_key_leaves_inert_is_warned_about_not_refused(case):
    overrides, keys, enable = INERT[case]
    notices = load_trainer_config("grpo_tiny_cpu", overrides).notices
    assert len(notices) == len(keys), notices
    for key, notice in zip(keys, notices, strict=True):
        assert notice.startswith(key) and enable in notice and notice.count(". ") == 0, notice


def test_inert_keys_at_their_defaults_or_with_their_enabling_key_say_nothing():
    assert load_trainer_config("grpo_tiny_cpu").notices == ()
    quiet = ["+rl_config.filter_groups_metric=acc", "+rl_config.rollout_is_threshold=2.0",
             "+rl_config.reward_model_normalize=none", "+ref_config.micro_batch_size=2"]  # the defaults / the actor's
    assert load_trainer_config("grpo_tiny_cpu", quiet).notices == ()
    enabled = ["+rl_config.filter_groups_enable=true", "+rl_config.filter_groups_metric=format",
               "+rl_config.rollout_is=token", "+rl_config.rollout_is_threshold=5.0"]
    assert load_trainer_config("grpo_tiny_cpu", enabled).notices == ()


def test_the_cli_prints_each_warning_once_before_it_starts(tmp_path):
    """The warning reaches the console (it is mindrl's own line) before Ray starts: a config that then fails its
    resource check still shows it."""
    done = subprocess.run([sys.executable, str(jobs.ROOT / "cli" / "train_grpo.py"), "--config-name", "grpo_tiny_cpu",
                           f"megatron_training.data_path={tmp_path / 'none'}", f"megatron_training.save={tmp_path}",
                           "+rl_config.rollout_is_threshold=5.0"],
                          cwd=jobs.ROOT, capture_output=True, text=True, timeout=jobs.COMMAND_LIMIT_S,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.stdout.count("[mindrl] warning: rl_config.rollout_is_threshold=5.0 has no effect") == 1, done.stdout
    assert done.returncode == 2 and done.stderr.startswith("error:"), done.stderr


def test_every_unsupported_key_is_named_in_one_message_grouped_by_section():
    overrides = ["+megatron_training.use_flash_attn=true", "+rl_config.guarantee_order=true",
                 "+actor_config.lr_decay_stile=x", "+megatron_training.swap_attention=true",
                 "+generate_config.enable_chunked_prefill=true"]
    with pytest.raises(ConfigError) as err:
        load_trainer_config("grpo_tiny_cpu", overrides)
    lines = str(err.value).splitlines()
    assert lines[0].startswith("5 keys of this config are not supported")
    sections = [line.rstrip(":") for line in lines[1:] if not line.startswith(" ")]
    assert sections == ["rl_config", "megatron_training", "actor_config", "generate_config"]
    megatron = lines[lines.index("megatron_training:") + 1:lines.index("actor_config:")]
    assert [line.split()[0] for line in megatron] == ["megatron_training.use_flash_attn",
                                                      "megatron_training.swap_attention"]
    assert "did you mean 'lr_decay_style'?" in str(err.value)


def test_a_value_mistake_after_unsupported_keys_is_named_with_them():
    with pytest.raises(ConfigError) as err:
        load_trainer_config("grpo_tiny_cpu", ["+rl_config.guarantee_order=true", "+rl_config.blocking=true",
                                              "rl_config.n_samples_per_prompt=0"])
    text = str(err.value)
    assert text.startswith("2 keys of this config are not supported")
    assert "rl_config.guarantee_order" in text and "rl_config.blocking" in text
    assert text.splitlines()[-1].startswith("and then: rl_config.n_samples_per_prompt must be")


def test_one_unsupported_key_stays_one_sentence():
    with pytest.raises(ConfigError, match=r"^rl_config.beta is never read by MindSpeed-RL's GRPO loss; set "
                                          r"init_kl_coef instead"):
        load_trainer_config("grpo_tiny_cpu", ["+rl_config.beta=0.1"])


@pytest.mark.parametrize("definition, accepted", [
    ("def verify(response, label):\n    return 1.0", True),
    ("def verify(response, label, weight=1.0):\n    return weight", True),
    ("def verify(*args):\n    return 1.0", True),
    ("def verify(response):\n    return 1.0", False),
    ("def verify(response, label, extra):\n    return 1.0", False),
    ("def verify(*, response, label):\n    return 1.0", False),
])
def test_a_custom_verifiers_signature_is_checked_when_the_config_loads(tmp_path, definition, accepted):
    (tmp_path / "mine.py").write_text(definition + "\n")
    overrides = [f"rl_config.verifier_function=[acc,{tmp_path / 'mine.py'}:verify]", "rl_config.verifier_weight=[1,1]",
                 "+rl_config.verifier_fail_score=[null,0.0]"]
    if accepted:
        load_trainer_config("grpo_tiny_cpu", overrides)
        return
    with pytest.raises(ConfigError) as err:
        load_trainer_config("grpo_tiny_cpu", overrides)
    message = str(err.value)
    assert "verify(" in message and "cannot be called as verify(response, label)" in message, message
    assert message.count(". ") == 0 and "\n" not in message


_DASHBOARD = """
import json, sys
import ray
from mindrl.config import ConfigError
from mindrl.trainer.cluster import connect
try:
    connect(dashboard=sys.argv[1] == "true")
except ConfigError as err:
    print(json.dumps({"error": str(err)}))
else:
    print(json.dumps({"url": ray._private.worker._global_node.webui_url}))
    ray.shutdown()
"""


@pytest.mark.job
@pytest.mark.parametrize("asked", [False, True])
def test_a_local_cluster_serves_a_dashboard_only_when_the_config_asks(asked):
    import json

    from ray._private.utils import get_dashboard_dependency_error

    key = "+rl_config.include_dashboard=true" if asked else "rl_config.test_interval=5"
    assert load_trainer_config("grpo_tiny_cpu", [key]).rl_config.include_dashboard is asked
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-c", _DASHBOARD, str(asked).lower()], cwd=jobs.ROOT, env=env,
                          capture_output=True, text=True, timeout=jobs.COMMAND_LIMIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not asked:
        assert result == {"url": ""}
    elif get_dashboard_dependency_error() is None:
        assert result["url"]
    else:  # this environment has Ray without its dashboard packages: one sentence before Ray starts
        assert result["error"].startswith("include_dashboard: true needs Ray's dashboard packages")


def test_resharding_a_training_checkpoint_says_it_keeps_weights_only_and_the_copy_starts_a_run(tmp_path, capsys):
    import torch

    from mindrl.checkpoint import megatron as mg
    from mindrl.ckpt_convert.cli import main as convert
    from mindrl.config import ParallelConfig, load_model_arch
    from mindrl.models import sharding
    from mindrl.trainer.start import start_point

    arch, par = load_model_arch("tiny_qwen"), ParallelConfig(1, 1)
    model = sharding.shard_state_dict(sharding.random_full_state_dict(arch, seed=0), arch, par, 0, 0)
    run, copy = tmp_path / "run", tmp_path / "tp2"
    path = mg.save_rank(run, 5, 0, 0, model, mg.checkpoint_args(arch, par, torch.float32), optimizer={},
                        extra={"job": "grpo", "data": {"epoch": 0, "position": 20}})
    torch.save({}, path.with_name(mg.OPTIM_FILE))
    mg.write_tracker(run, 5)
    assert convert(["--load-model-type", "mg", "--save-model-type", "mg", "--target-tensor-parallel-size", "2",
                    "--load-dir", str(run), "--save-dir", str(copy), "--no-progress"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "training checkpoint" in line]
    assert len(notes) == 1 and "weights only" in notes[0] and "optimizer" in notes[0], notes
    assert not mg.holds_training_state(copy, 5)
    start = start_point(load_trainer_config("grpo_tiny_cpu", [f"actor_config.load={copy}",
                                                              "actor_config.tensor_model_parallel_size=2"]).actor_config)
    assert (start.iteration, start.initial_weights, start.resume) == (0, str(copy), None)
    resume = start_point(load_trainer_config("grpo_tiny_cpu", [f"actor_config.load={run}"]).actor_config)
    assert (resume.iteration, resume.resume) == (5, str(run))
