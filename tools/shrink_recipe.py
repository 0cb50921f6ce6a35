"""Shrink a trainer recipe to two CPU cores, its algorithm kept, and write the config that trains it.

    python tools/shrink_recipe.py path/to/MindSpeed-RL/configs/dapo_qwen3_32b_A3.yaml \\
        --tokenizer data/tiny_tokenizer --data data/synthetic_math --save runs/shrunk/dapo_qwen3_32b_A3

Works on MindSpeed-RL's recipes (their model/ folder beside them) and on mindrl's own. The model keeps its
family's switches at a tiny width, every role gets two CPU ranks, lengths and the batch scale down, the
recipe's rl_config keys stay (mindrl.trainer.shrink says exactly what changes). Keys mindrl drops are
listed with their reasons, as by cli/import_mindspeed.py. Prepare tiny data first:

    python cli/build_tiny_tokenizer.py --out data/tiny_tokenizer
    python cli/preprocess_data.py --config-name synthetic_math
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mindrl.config.errors import ConfigError
from mindrl.console import error, exit_now, say


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", type=Path, help="a trainer yaml (MindSpeed-RL's or mindrl's)")
    parser.add_argument("--tokenizer", required=True, type=Path, help="a local HF tokenizer directory")
    parser.add_argument("--data", required=True, type=Path, help="cli/preprocess_data.py output")
    parser.add_argument("--save", required=True, type=Path, help="the shrunk run's save folder")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write the config (default: <save>/<recipe name>.yaml)")
    parser.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the recipe, key=value, before shrinking")
    args = parser.parse_intermixed_args(argv)
    from mindrl.data.tokenizer import load_tokenizer
    from mindrl.trainer.mindspeed_import import import_recipe
    from mindrl.trainer.shrink import shrink

    out = args.out or args.save / f"{args.recipe.stem}.yaml"
    try:
        if not args.recipe.is_file():
            raise ConfigError(f"recipe {args.recipe} does not exist; give the path of a trainer yaml.")
        if args.steps < 1:
            raise ConfigError(f"--steps must be at least 1, got {args.steps}.")
        vocab = len(load_tokenizer(args.tokenizer))
        imported = import_recipe(args.recipe, args.overrides, functools.partial(
            shrink, tokenizer=str(args.tokenizer), data_path=str(args.data), save=str(args.save),
            vocab_size=-(-vocab // 64) * 64, steps=args.steps))
    except ConfigError as err:
        error(str(err))
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# {args.recipe.name} shrunk to two CPU ranks by tools/shrink_recipe.py\n"
                   + yaml.safe_dump(imported.data, sort_keys=False))
    for line in imported.report(out).splitlines():
        say(line)
    return 0


if __name__ == "__main__":
    exit_now(main())
