"""Evaluate a checkpoint: generate for a test parquet, score with the verifiers, report pass@k.

    python cli/evaluate.py --load runs/grpo_tiny_cpu/ckpt --data data/synthetic_math \\
        --tokenizer data/tiny_tokenizer [--n-samples 8 --temperature 1.0 --k 4 8] [--output gen.parquet]

With `--multi-turn` each answer may call tools between turns (the trainer's agent loop and tools:
`--tool-config`, `--max-tool-calls`, `--max-total-response-length`); the summary adds the share of answers
that called a tool and the turns per answer.

`--load` is a Megatron checkpoint (converted, SFT or GRPO; its latest iteration) or an HF model
folder. Greedy by default, exactly as the trainer's validation. Prints one JSON line: pass@1
(and each pass@k), mean score and response length, overall and per data_source. What the engines and
libraries print on the way goes to `--log` (default runs/evaluate.log), every line kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mindrl.config.errors import ConfigError
from mindrl.console import error, exit_now, run_log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True, help="Megatron checkpoint root or HF model folder")
    parser.add_argument("--data", required=True, help="prompt parquet, or a preprocessed folder (its test split)")
    parser.add_argument("--tokenizer", required=True, help="the tokenizer folder the prompts were made with")
    parser.add_argument("--n-samples", type=int, default=1, help="samples per prompt (default 1)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens per response (default 256)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verifiers", nargs="+", default=["acc", "format"],
                        help="verifier names, one of them an accuracy verifier (default: acc format)")
    parser.add_argument("--weights", nargs="+", type=float, default=None,
                        help="one weight per verifier for the score (default 1.0, then 0.1 each)")
    parser.add_argument("--k", nargs="*", type=int, default=[], help="pass@k values beside pass@1")
    parser.add_argument("--backend", default="vllm", choices=["vllm", "megatron", "auto"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--output", default=None, help="parquet to write the generations and their scores to")
    parser.add_argument("--prompt-type", default=None,
                        help="template the prompts were rendered with, for its stop words (default: the one the data "
                             "records)")
    parser.add_argument("--prompt-type-path", default=None, help="templates file for --prompt-type (default: "
                                                                 "configs/model/templates.json)")
    parser.add_argument("--multi-turn", action="store_true",
                        help="answers may call tools between turns (the data's template needs a tool turn)")
    parser.add_argument("--tool-config", default=None,
                        help="tools YAML (default: the built-in python and calculator tools)")
    parser.add_argument("--max-tool-calls", type=int, default=8, help="tool calls per answer (default 8)")
    parser.add_argument("--max-total-response-length", type=int, default=None,
                        help="tokens of a whole multi-turn answer (default: --max-model-len minus the longest prompt)")
    parser.add_argument("--log", default="runs/evaluate.log",
                        help="where the engines' and libraries' own output goes (appended; default %(default)s)")
    args = parser.parse_args(argv)
    weights = args.weights or [1.0] + [0.1] * (len(args.verifiers) - 1)
    try:
        from mindrl.evaluation import EvalConfig, evaluate

        cfg = EvalConfig(load=args.load, data=args.data, tokenizer=args.tokenizer, n_samples=args.n_samples,
                         temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed,
                         verifiers=args.verifiers, weights=weights, ks=args.k, backend=args.backend,
                         dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                         output=args.output, prompt_type=args.prompt_type,
                         prompt_type_path=args.prompt_type_path, multi_turn=args.multi_turn,
                         tool_config=args.tool_config, max_tool_calls=args.max_tool_calls,
                         max_total_response_length=args.max_total_response_length)
        with run_log(args.log):
            summary = evaluate(cfg)
    except ConfigError as err:
        error(str(err))
        return 2
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    exit_now(main())
