"""Offline arithmetic and GSM8K-style word problems, for the CPU demo and the tests.

Deterministic for a seed; every answer is an integer computed from the same numbers the
text shows, and `solution` ends GSM8K-style with `#### <answer>`.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable

NAMES = ("Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goro", "Hana", "Ivan", "Jia")
ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells")


def _arithmetic(rng: random.Random) -> dict:
    a, b, c = rng.randint(2, 50), rng.randint(2, 50), rng.randint(2, 12)
    op1, op2 = rng.choice("+-"), rng.choice("+-*")
    expression = f"{a} {op1} {b} {op2} {c}"
    tail = b * c if op2 == "*" else None  # * binds tighter than the + or - before it
    if tail is not None:
        answer = a + tail if op1 == "+" else a - tail
    else:
        head = a + b if op1 == "+" else a - b
        answer = head + c if op2 == "+" else head - c
    return {"question": f"Compute {expression}.", "answer": str(answer),
            "solution": f"{expression} = {answer}\n#### {answer}", "kind": "arithmetic"}


def _buy_more(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start, packs, per = rng.randint(2, 30), rng.randint(2, 9), rng.randint(2, 12)
    answer = start + packs * per
    return {"question": f"{name} has {start} {item}. {name} buys {packs} packs with {per} {item} in each pack. "
                        f"How many {item} does {name} have now?",
            "answer": str(answer),
            "solution": f"{packs} * {per} = {packs * per}; {start} + {packs * per} = {answer}\n#### {answer}",
            "kind": "word"}


def _share(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each, left = rng.randint(2, 8), rng.randint(2, 15), rng.randint(0, 9)
    total = friends * each + left
    return {"question": f"{name} had {total} {item} and gave {each} to each of {friends} friends. "
                        f"How many {item} are left?",
            "answer": str(left),
            "solution": f"{friends} * {each} = {friends * each}; {total} - {friends * each} = {left}\n#### {left}",
            "kind": "word"}


def _weekly(rng: random.Random) -> dict:
    name = rng.choice(NAMES)
    per_day, days = rng.randint(3, 20), rng.randint(2, 7)
    spent = rng.randint(1, per_day * days)
    answer = per_day * days - spent
    return {"question": f"{name} earns {per_day} dollars a day for {days} days and then spends {spent} dollars. "
                        f"How many dollars does {name} have left?",
            "answer": str(answer),
            "solution": f"{per_day} * {days} = {per_day * days}; {per_day * days} - {spent} = {answer}\n#### {answer}",
            "kind": "word"}


def _fact(rng: random.Random, worded: bool) -> dict:
    """A times-table fact (0–9 × 0–9), asked bare or as a one-line word problem; answered "The answer is N.".

    One operation keeps the demo's task to 100 facts: GRPO on two CPU cores gets to each of them
    dozens of times in its three minutes, which it needs to change a fact's greedy answer."""
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    if worded:
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        question = rng.choice((f"{name} has {a} bags with {b} {item} in each. How many {item} are there?",
                               f"{name} buys {a} packs of {b} {item}. How many {item} does {name} buy?"))
    else:
        question = rng.choice((f"What is {a} times {b}?", f"{a} * {b} = ?"))
    return {"question": question, "answer": str(a * b), "solution": f"The answer is {a * b}.",
            "kind": "fact_word" if worded else "fact_bare", "fact": f"{a} * {b}"}


def _fact_pair(rng: random.Random, worded: bool) -> dict:
    """A times-table fact with a preference pair: its answer sentence chosen, a near miss rejected (a neighbouring
    product or one off, the confusions a learner makes), for the DPO stage. The miss is drawn from the question's
    own generator, so `fact_pairs` asks the same questions in the same order as `facts` for a seed: a recipe
    with the facts recipe's split keeps the same prompts held out."""
    fact = _fact(rng, worded)
    a, b = (int(x) for x in fact["fact"].split(" * "))
    misses = sorted({(a + 1) * b, (a - 1) * b, a * (b + 1), a * (b - 1), a * b + 1, a * b - 1} - {a * b})
    wrong = random.Random(fact["question"]).choice([m for m in misses if m >= 0])
    return {**fact, "chosen": fact["solution"], "rejected": f"The answer is {wrong}."}


#: Qwen's tool-call and tool-response tags, one token each in the tools task's tokenizer
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def tool_trajectory(question: str) -> str:
    """The ChatML trajectory that answers a product question through the python tool, as the agent loop writes it
    (model turn, tool turn with print's output and its newline, model turn)."""
    a, b = (int(x) for x in re.findall(r"\d+", question)[:2])
    call = json.dumps({"name": "python", "arguments": {"code": f"print({a} * {b})"}})
    return (f"<tool_call>\n{call}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{a * b}\n\n"
            f"</tool_response><|im_end|>\n<|im_start|>assistant\nThe answer is {a * b}.")


def _product(rng: random.Random) -> dict:
    """A two-digit product, which a 2.5M-parameter model cannot work out in its head but can hand to the python
    tool. `solution` is the SFT warm start's answer: for 30 % of the problems the tool trajectory, for 70 % the
    product written straight away, a guess the model cannot learn — so the warm start calls the tool for some
    prompts and guesses for others, and RL has the choice to learn; `answer` is the product."""
    a, b = rng.randint(11, 99), rng.randint(11, 99)
    question = rng.choice((f"What is {a} times {b}?", f"{a} * {b} = ?", f"Compute {a} * {b}."))
    solution = f"The answer is {a * b}." if rng.random() < 0.7 else tool_trajectory(question)
    return {"question": question, "answer": str(a * b), "solution": solution, "kind": "product"}


GENERATORS: dict[str, tuple[Callable[[random.Random], dict], ...]] = {
    "arithmetic": (_arithmetic,),
    "word": (_buy_more, _share, _weekly),
    "mixed": (_arithmetic, _buy_more, _share, _weekly),
    # the learning demo's task: the 100 times-table facts, half of the problems worded
    "facts": (lambda rng: _fact(rng, worded=False), lambda rng: _fact(rng, worded=True)),
    # the same facts with a chosen and a rejected answer each (the demo's optional DPO stage)
    "fact_pairs": (lambda rng: _fact_pair(rng, worded=False), lambda rng: _fact_pair(rng, worded=True)),
    # the tool-use demo's task: two-digit products, solved through the python tool
    "tools": (_product,),
}


def generate_problems(kind: str = "mixed", num_samples: int = 1000, seed: int = 0) -> list[dict]:
    """`num_samples` problems of `kind` (arithmetic, word, mixed, facts, fact_pairs or tools), the same for the
    same seed."""
    if kind not in GENERATORS:
        raise ValueError(f"unknown problem kind {kind!r}; choose one of {', '.join(GENERATORS)}.")
    rng = random.Random(seed)
    makers = GENERATORS[kind]
    return [{**rng.choice(makers)(rng), "id": i} for i in range(num_samples)]
