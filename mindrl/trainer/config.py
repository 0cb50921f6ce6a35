"""The GRPO trainer's configuration: sections, the Hydra loader, and the checks before Ray starts.

`load_trainer_config("grpo_tiny_cpu", ["rl_config.n_samples_per_prompt=4"])` composes
configs/rlxf/<name>.yaml with Hydra (the `model` group comes from configs/model/ through the
defaults list, exactly as in MindSpeed-RL), refuses unknown keys, and runs every check that
needs no cluster. `check_resources(cfg, cluster)` is the one check that needs to know the
machines; the CLI runs it before any worker starts.

`load_mindspeed_config(path)` reads a MindSpeed-RL trainer file through the same code but
collects every key mindrl does not support instead of stopping at the first: the caller gets
the config *and* the list, one sentence per key, so a user porting a config sees all of it at once.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from mindrl.algorithms.policy_loss import LossConfig
from mindrl.config import ConfigError
from mindrl.config.keys import Keys, normalise
from mindrl.config.paths import CONFIGS_DIR
from mindrl.rollout.config import GenerateConfig
from mindrl.trainer import checks, resources
from mindrl.trainer.megatron import MegatronConfig
from mindrl.trainer.resources import Cluster, RoleResource
from mindrl.trainer.rl import RLConfig

if TYPE_CHECKING:
    from mindrl.workers.megatron_worker import ActorConfig

TRAINER_CONFIGS_DIR = CONFIGS_DIR / "rlxf"
SECTIONS = ("model", "megatron_training", "actor_config", "ref_config", "reward_config", "rl_config",
            "generate_config")


@dataclass(frozen=True)
class TrainerConfig:
    """Role sections are merged over megatron_training and carry their resolved architecture.

    With the integrated worker `ref_config` is the actor's (as in MindSpeed-RL): the reference
    runs inside the actor's processes and must share its layout.
    """

    megatron_training: MegatronConfig
    actor_config: MegatronConfig
    ref_config: MegatronConfig
    reward_config: MegatronConfig | None
    rl_config: RLConfig
    generate_config: GenerateConfig
    loss: LossConfig
    #: the top-level sections the file (after overrides) actually gave
    sections_given: frozenset[str] = field(default_factory=frozenset)

    @property
    def colocate_actor_ref(self) -> bool:
        rl = self.rl_config
        return bool(rl.use_integrated_worker or rl.colocate_actor_ref or rl.colocate_all_models)

    def roles(self) -> list[tuple[str, MegatronConfig, RoleResource]]:
        """(section, settings, devices) of every Megatron worker group that runs."""
        res = self.rl_config.resources
        out = [("actor_config", self.actor_config, res["actor_resource"])]
        if self.rl_config.uses_reference and not self.rl_config.use_integrated_worker:
            out.append(("ref_config", self.ref_config, res["reference_resource"] or res["actor_resource"]))
        if self.reward_config is not None:
            out.append(("reward_config", self.reward_config, res["reward_resource"] or res["actor_resource"]))
        return out

    def device_groups(self) -> list[tuple[str, RoleResource]]:
        """Disjoint sets of devices: colocated roles share one."""
        names = {"actor_config": "actor", "ref_config": "reference", "reward_config": "reward"}
        groups: list[tuple[str, RoleResource]] = []
        for section, _, resource in self.roles():
            shared = (section == "ref_config" and self.colocate_actor_ref) or \
                     (section == "reward_config" and self.rl_config.colocate_all_models)
            if shared:
                groups[0] = (f"{groups[0][0]}+{names[section]}", groups[0][1])
            else:
                groups.append((names[section], resource))
        return groups

    def actor_update_config(self) -> ActorConfig:
        """The actor worker's settings (mini-batch in samples, sampling temperature for log-probs)."""
        rl = self.rl_config
        return self.actor_config.actor_config(rl.mini_batch_size * rl.n_samples_per_prompt, epochs=rl.epochs,
                                              shuffle_mini_batch=rl.shuffle_mini_batch, loss=self.loss,
                                              temperature=self.generate_config.sampling_config.temperature,
                                              prompt_packing=rl.packing_mode)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], notes: list[str] | None = None) -> TrainerConfig:
        """Build and check everything but resources; `notes` collects unsupported keys instead of raising."""
        keys = Keys(notes)
        data = dict(normalise(data))
        for key in list(data):
            if key not in SECTIONS:
                keys.unknown("", key, SECTIONS)
                data.pop(key)
        for key in SECTIONS:
            if not isinstance(data.get(key) or {}, Mapping):
                raise ConfigError(f"{key} must be a mapping of keys, got {data[key]!r}.")
        models = data.get("model") or {}
        base = normalise(data.get("megatron_training") or {})
        rl = RLConfig.from_dict(data.get("rl_config") or {}, keys)
        role = {"megatron_training": MegatronConfig.from_dict("megatron_training", base, models, keys)}
        wanted = ["actor_config", "ref_config"]
        if "reward_config" in data or rl.resources["reward_resource"] is not None:
            wanted.append("reward_config")
        for s in wanted:
            own = normalise(data.get(s) or {})
            # a megatron_training key was reported there already; report only the role's own keys
            role[s] = MegatronConfig.from_dict(s, {**base, **own}, models, Keys(notes, only=set(own)))
        if rl.use_integrated_worker:
            role["ref_config"] = role["actor_config"]  # the reference lives in the actor's processes, in its layout
        reward = role.get("reward_config")
        if reward is not None:
            reward = checks.reward_model_role(reward, role["actor_config"])
        gen = GenerateConfig.from_dict(data.get("generate_config") or {}, keys)
        loss = rl.loss_config(gen.sampling_config.max_tokens)
        cfg = cls(role["megatron_training"], role["actor_config"], role["ref_config"], reward, rl, gen, loss,
                  frozenset(k for k in data if data[k] is not None))
        checks.check_colocation(cfg)
        checks.check_layouts(cfg)
        checks.check_rollout(cfg)
        checks.check_batches(cfg)
        checks.check_lengths(cfg)
        checks.check_rewards(cfg)
        return cfg


def check_resources(cfg: TrainerConfig, cluster: Cluster | None = None) -> None:
    """Raise ConfigError if `cluster` (default: this machine) cannot give the roles' devices."""
    resources.check_resources(cfg.device_groups(), cluster, cfg.actor_config.global_batch_size,
                              cfg.rl_config.rule_reward)


def compose(config_name: str, overrides: Sequence[str] = (), config_dir: str | Path | None = None) -> dict:
    """Hydra's composition of `config_name` (+ overrides) as a plain dict; Hydra errors become one sentence."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    directory = Path(config_dir or TRAINER_CONFIGS_DIR).resolve()
    if not (directory / f"{config_name}.yaml").is_file():
        known = ", ".join(sorted(p.stem for p in directory.glob("*.yaml"))) or "none"
        raise ConfigError(f"no trainer config named {config_name!r} in {directory}; known: {known}.")
    # The `model` group is searched beside the config first, then in mindrl's own configs/.
    search = [f"hydra.searchpath=[file://{CONFIGS_DIR.resolve()}]"]
    try:
        with initialize_config_dir(config_dir=str(directory), version_base=None):
            composed = hydra_compose(config_name, overrides=[*overrides, *search])
    except (HydraException, OmegaConfBaseException, ValueError) as err:  # ValueError: a group given a non-name
        first = str(err).strip().splitlines()[0].rstrip(".").replace(". ", "; ")
        raise ConfigError(f"Hydra cannot compose {config_name} with overrides {list(overrides)} ({first}); check the "
                          f"key names (a key the file lacks needs a leading +) and the values' syntax.") from None
    return OmegaConf.to_container(composed, resolve=True)


def load_trainer_config(config_name: str, overrides: Sequence[str] = (),
                        config_dir: str | Path | None = None) -> TrainerConfig:
    """configs/rlxf/<config_name>.yaml (or `config_dir`) with Hydra overrides, checked; raises ConfigError."""
    return TrainerConfig.from_dict(compose(config_name, overrides, config_dir))


def load_mindspeed_config(path: str | Path, overrides: Sequence[str] = ()) -> tuple[TrainerConfig, list[str]]:
    """A MindSpeed-RL trainer yaml (its model/ folder beside it): the config and one sentence per dropped key.

    Keys mindrl does not support are removed and reported rather than raised, so the whole list
    comes at once; anything else wrong (a value, a layout, a length) still raises ConfigError.
    """
    path = Path(path)
    notes: list[str] = []
    with warnings.catch_warnings():
        # MindSpeed-RL files omit `_self_`; Hydra then applies the file after its defaults, which is what they mean.
        warnings.filterwarnings("ignore", message=".*Defaults list is missing `_self_`", category=UserWarning)
        composed = compose(path.stem, overrides, path.parent)
    cfg = TrainerConfig.from_dict(composed, notes)
    return cfg, list(dict.fromkeys(notes))
