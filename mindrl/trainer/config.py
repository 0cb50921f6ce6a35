"""Loading the GRPO trainer's configuration: the Hydra loader, and the checks before Ray starts.

`load_trainer_config("grpo_tiny_cpu", ["rl_config.n_samples_per_prompt=4"])` composes
configs/rlxf/<name>.yaml with Hydra (the `model` group comes from configs/model/ through the
defaults list, exactly as in MindSpeed-RL), refuses unknown keys — every one of them in one message,
so a MindSpeed-RL file given by --config-dir shows its whole list at once — and runs every check that
needs no cluster. `check_resources(cfg, cluster)` is the one check that needs to know the
machines; the CLI runs it before any worker starts.

`load_mindspeed_config(path)` reads a MindSpeed-RL trainer file through the same code but
collects every key mindrl does not support instead of stopping at the first: the caller gets
the config *and* the list, one sentence per key, so a user porting a config sees all of it at once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mindrl.config import ConfigError, resources
from mindrl.config.keys import KeyNote, unsupported_keys_message
from mindrl.config.paths import CONFIGS_DIR
from mindrl.config.resources import Cluster
from mindrl.trainer import checks
from mindrl.trainer.grpo_config import TrainerConfig
from mindrl.trainer.megatron import STAGES

TRAINER_CONFIGS_DIR = CONFIGS_DIR / "rlxf"
#: the stages trained without Ray's RL driver: their config class (imported when a recipe names it)
STAGE_CONFIGS = {"dpo": ("mindrl.trainer.dpo_config", "DPOConfig"), "sft": ("mindrl.trainer.sft_config", "SFTConfig")}


def build_trainer_config(data: Mapping[str, Any], notes: list[KeyNote] | None = None,
                         command: str | None = None) -> TrainerConfig:
    """Every section built and checked, then the rules across sections; all but the resources. `command`: the
    stage of the command loading it, for a file that names none."""
    cfg = TrainerConfig.from_dict(data, notes, command)
    checks.check_colocation(cfg)
    tool_warnings = checks.check_multi_turn(cfg)
    checks.check_async(cfg)
    checks.check_layouts(cfg)
    checks.check_rollout(cfg)
    checks.check_batches(cfg)
    checks.check_lengths(cfg)
    checks.check_rewards(cfg)
    budgets = checks.check_packing(cfg)
    return replace(cfg, notices=(*cfg.notices, *tool_warnings, *budgets, *cfg.generate_config.widening_notice(),
                                 *checks.inert_keys(cfg)))


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
        with warnings.catch_warnings(), initialize_config_dir(config_dir=str(directory), version_base=None):
            # MindSpeed-RL files omit `_self_`; Hydra then applies the file after its defaults, which they mean.
            warnings.filterwarnings("ignore", message=".*Defaults list is missing `_self_`", category=UserWarning)
            composed = hydra_compose(config_name, overrides=[*overrides, *search])
    except (HydraException, OmegaConfBaseException, ValueError) as err:  # ValueError: a group given a non-name
        first = str(err).strip().splitlines()[0].rstrip(".").replace(". ", "; ")
        raise ConfigError(f"Hydra cannot compose {config_name} with overrides {list(overrides)} ({first}); check the "
                          f"key names (a key the file lacks needs a leading +) and the values' syntax.") from None
    data = OmegaConf.to_container(composed, resolve=True)
    return _recipe_relative_paths(data, directory)


def _recipe_relative_paths(data: dict, directory: Path) -> dict:
    """A relative `tool_config_path` that is not found from the working directory is looked up against the recipe's
    folder and each folder above it: MindSpeed-RL writes it from its repository's root (`./configs/tools/…` beside
    `configs/<recipe>.yaml`), mindrl's recipes from theirs (`configs/tools/…` two folders above configs/rlxf/), and a
    recipe moved elsewhere with its tool file keeps working wherever it is started from."""
    rl = data.get("rl_config")
    given = rl.get("tool_config_path") if isinstance(rl, dict) else None
    if not isinstance(given, str) or Path(given).expanduser().is_absolute() or Path(given).is_file():
        return data
    for folder in (directory, *directory.parents):
        if (folder / given).is_file():
            rl["tool_config_path"] = str((folder / given).resolve())
            break
    return data


def load_trainer_config(config_name: str, overrides: Sequence[str] = (), config_dir: str | Path | None = None,
                        command: str | None = None) -> TrainerConfig:
    """configs/rlxf/<config_name>.yaml (or `config_dir`) with Hydra overrides, checked; raises ConfigError, naming
    every unsupported key at once (and the first other mistake after them). `command`: see build_trainer_config."""
    notes: list[KeyNote] = []
    try:
        cfg = build_trainer_config(compose(config_name, overrides, config_dir), notes, command)
    except ConfigError as err:
        if not notes:
            raise
        raise ConfigError(unsupported_keys_message(notes, also=str(err))) from None
    if notes:
        raise ConfigError(unsupported_keys_message(notes))
    return cfg


def trainer_loader(stage: str) -> Callable[[str, Sequence[str], str | Path | None], TrainerConfig]:
    """load_trainer_config for the command of `stage` (cli/train_grpo.py: ray_grpo, cli/train_dapo.py: ray_dapo,
    cli/train_ppo.py: ray_ppo), refusing a config meant for another command."""

    def load(config_name: str, overrides: Sequence[str] = (), config_dir: str | Path | None = None) -> TrainerConfig:
        cfg = load_trainer_config(config_name, overrides, config_dir, stage)
        if cfg.stage == stage:
            return cfg
        if cfg.rl_config.trains_critic:
            raise ConfigError(f"adv_estimator gae trains a critic; run {config_name} with cli/train_ppo.py.")
        if stage == "ray_ppo":
            raise ConfigError(f"cli/train_ppo.py trains a critic for adv_estimator: gae, but {config_name}'s is "
                              f"{cfg.rl_config.adv_estimator}; set rl_config.adv_estimator: gae or run "
                              f"{STAGES[cfg.stage]}.")
        raise ConfigError(f"{config_name} is stage {cfg.stage}; run it with {STAGES[cfg.stage]}.")

    return load


def load_mindspeed_config(path: str | Path, overrides: Sequence[str] = ()) -> tuple[Any, list[str]]:
    """A MindSpeed-RL trainer yaml (its model/ folder beside it): the config (a TrainerConfig, or a DPO or SFT
    recipe's StageConfig) and one sentence per dropped key.

    Keys mindrl does not support are removed and reported rather than raised, so the whole list
    comes at once; anything else wrong (a value, a layout, a length) still raises ConfigError.
    """
    _, cfg, notes = read_mindspeed_recipe(Path(path), overrides)
    return cfg, list(dict.fromkeys(note.sentence for note in notes))


def read_mindspeed_recipe(path: Path, overrides: Sequence[str] = (), transform: Callable[[dict], dict] | None = None,
                          ) -> tuple[dict, Any, list[KeyNote]]:
    """The recipe as Hydra composes it (then `transform`ed), the config mindrl builds from it (a TrainerConfig, or
    the StageConfig of a DPO or SFT recipe), and the keys it left out (once each)."""
    notes: list[KeyNote] = []
    data = compose(path.stem, overrides, path.parent)
    if transform is not None:
        data = transform(data)
    stage = (data.get("megatron_training") or {}).get("stage")
    if stage in STAGE_CONFIGS:
        from importlib import import_module

        module, name = STAGE_CONFIGS[stage]
        cfg = getattr(import_module(module), name).from_dict(data, notes)
    else:
        cfg = build_trainer_config(data, notes)
    return data, cfg, list(dict.fromkeys(notes))
