"""Turn raw question/answer data into tokenized prompt parquet files.

    python cli/preprocess_data.py --config-name <recipe> [key=value ...]

`<recipe>` is a file in configs/datasets/ (Hydra config; overrides such as
`max_prompt_length=256` or `input=path.jsonl` follow). Writes train.parquet (and
test.parquet) into the recipe's output_dir and prints a report.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mindrl.config.errors import ConfigError
from mindrl.config.paths import CONFIGS_DIR
from mindrl.data.preprocess import PreprocessConfig, preprocess


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-name", required=True, help="recipe name in configs/datasets/")
    parser.add_argument("--config-dir", default=str(CONFIGS_DIR / "datasets"), help="where recipes live")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, key=value")
    args = parser.parse_args(argv)
    recipe = Path(args.config_dir) / f"{args.config_name}.yaml"
    if not recipe.is_file():
        known = ", ".join(sorted(p.stem for p in Path(args.config_dir).glob("*.yaml")))
        print(f"error: no recipe {args.config_name!r} in {args.config_dir}; known: {known}.", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        with initialize_config_dir(config_dir=str(Path(args.config_dir).resolve()), version_base="1.3"):
            composed = compose(config_name=args.config_name, overrides=args.overrides)
        cfg = PreprocessConfig.from_dict(OmegaConf.to_container(composed, resolve=True))
        print(f"[preprocess] {args.config_name}: reading {cfg.input or cfg.generator}", file=sys.stderr)
        report = preprocess(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    summary = {"recipe": args.config_name, "output_dir": cfg.output_dir, **asdict(report),
               "seconds": round(time.perf_counter() - start, 2)}
    print(f"[preprocess] read {report.rows_read} rows: kept {report.kept} (train {report.train}, test {report.test}), "
          f"dropped {report.dropped_too_long} over max_prompt_length={cfg.max_prompt_length} and "
          f"{report.dropped_seen_in_test} training rows whose prompt is a test prompt, "
          f"skipped {report.skipped_bad} bad rows; longest prompt {report.longest_prompt} tokens", file=sys.stderr)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
