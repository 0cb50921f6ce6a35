"""Import a MindSpeed-RL recipe: print what mindrl will run and write the mindrl trainer config.

    python cli/import_mindspeed.py path/to/MindSpeed-RL/configs/grpo_qwen25_7b_A3.yaml \\
        megatron_training.tokenizer_name_or_path=models/Qwen2.5-7B megatron_training.data_path=data/math

The recipe's model file is read from the model/ folder beside it, as MindSpeed-RL does. Overrides are
Hydra's (`key=value`, `+key=value` for a key the recipe lacks). The report lists each section's kept keys,
every dropped key with its reason (kernel choices, behaviour mindrl fixes, switched-off keys: nothing that
changes what is trained), the notices, and the command that runs the written file. A recipe mindrl cannot run,
or one with a feature key that is on and not built, is refused naming why (exit status 2), and nothing is
written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mindrl.config.errors import ConfigError
from mindrl.console import error, exit_now, say


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", type=Path, help="a MindSpeed-RL trainer yaml")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write the mindrl config (default: imported/<recipe name>.yaml)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, key=value")
    args = parser.parse_intermixed_args(argv)
    from mindrl.trainer.mindspeed_import import import_recipe

    out = args.out or Path("imported") / f"{args.recipe.stem}.yaml"
    try:
        if not args.recipe.is_file():
            raise ConfigError(f"recipe {args.recipe} does not exist; give the path of a MindSpeed-RL trainer yaml.")
        if out.suffix != ".yaml":
            raise ConfigError(f"--out {out} must end in .yaml (the trainers read <config-name>.yaml).")
        imported = import_recipe(args.recipe, args.overrides)
    except ConfigError as err:
        error(str(err))
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(f"# MindSpeed-RL's {args.recipe.name}, imported by cli/import_mindspeed.py\n"
                   + yaml.safe_dump(imported.data, sort_keys=False))
    tmp.replace(out)
    for line in imported.report(out).splitlines():
        say(line)
    return 0


if __name__ == "__main__":
    exit_now(main())
