"""Train the tiny offline tokenizer the CPU demo uses (byte-level BPE, ChatML tokens).

    python cli/build_tiny_tokenizer.py --out data/tiny_tokenizer [--vocab-size 1024]
    python cli/build_tiny_tokenizer.py --out data/facts_tokenizer --task facts --vocab-size 512 --split-digits
    python cli/build_tiny_tokenizer.py --out data/tiny_vl_tokenizer --task shapes --vision-tokens
    python cli/build_tiny_tokenizer.py --out data/tools_tokenizer --task tools --vocab-size 512 --split-digits

Trained on the synthetic problems of `--task` and every template's text, so prompts tokenize
into reasonably few ids; its vocabulary fits the tiny model configs (configs/model/).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mindrl.data.images import VISION_TOKENS
from mindrl.data.shapes import generate_shape_problems
from mindrl.data.synthetic import TOOL_TOKENS, generate_problems
from mindrl.data.templates import load_templates
from mindrl.data.tokenizer import build_tiny_tokenizer


def corpus(task: str = "mixed") -> list[str]:
    """Template text and synthetic problems; `shapes` adds the image questions' text to the mixed problems."""
    texts = [t.render("", "") for t in load_templates().values() if not t.prefix]
    if task == "shapes":
        texts += [f"{row['problem']}\n{row['solution']}" for row in generate_shape_problems("mixed", 2000, seed=12345)]
        task = "mixed"
    if task == "tools":
        # Qwen's user turn with ReTool's answer-format instruction (the recipe the tools are for), after Qwen's own
        # turn, then each question with its answer
        texts.insert(3, "<|im_start|>user\n\nThe answer format must be: \\boxed{'The final answer goes here.'}"
                        "<|im_end|>\n<|im_start|>assistant\n")
        return texts + [f"{p['question']}\n{p['solution']}" for p in generate_problems("tools", 4000, seed=12345)]
    for problem in generate_problems(task, 4000, seed=12345):
        texts += [problem["question"], problem["solution"],
                  f"<think>{problem['solution']}</think>\n<answer>\\boxed{{{problem['answer']}}}</answer>"]
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory (an HF tokenizer directory)")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--task", default="mixed",
                        help="synthetic problems to train on: mixed (default), facts, shapes (mixed and the image "
                             "task's text), or tools (two-digit products answered through the python tool; the "
                             "tool-call tags become tokens)")
    parser.add_argument("--split-digits", action="store_true", help="one token per digit")
    parser.add_argument("--vision-tokens", action="store_true",
                        help="end the vocabulary with Qwen2.5-VL's image markers (for tiny_qwen25_vl)")
    args = parser.parse_args(argv)
    vision = VISION_TOKENS if args.vision_tokens else ()
    path = build_tiny_tokenizer(args.out, corpus(args.task), vocab_size=args.vocab_size,
                                split_digits=args.split_digits, vision_tokens=vision,
                                tool_tokens=TOOL_TOKENS if args.task == "tools" else ())
    print(f"[tokenizer] wrote {path} (vocab {args.vocab_size})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
