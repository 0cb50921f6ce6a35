"""Preference pairs (prompt, chosen, rejected): from raw rows into the pairwise parquet, and from it into the
DPO stage's batches.

Rows come in the layouts HF preference datasets use:
- plain strings: `prompt`, `chosen`, `rejected`;
- chat messages: `prompt` a list of {role, content}, `chosen` / `rejected` a list ending in the assistant's
  message (or a bare string);
- chat messages with the prompt implicit: `chosen` and `rejected` whole conversations that share every message
  but the last, the assistant's answer.
The prompt is rendered with the same template as GRPO's and SFT's prompts; each response is its text's tokens
and the tokenizer's EOS, as SFT teaches (what the rollout stops on). Pairs longer than the sequence length are
dropped and counted by the caller, never cut.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mindrl.config.errors import ConfigError
from mindrl.data.readers import read_columns
from mindrl.data.templates import ChatTemplate, Template

#: fields a pairwise row maps (`map_keys`); `prompt` may be absent when the conversations carry it
PAIR_KEYS = ("prompt", "chosen", "rejected", "system")


@dataclass(frozen=True)
class Pair:
    prompt: str | list[dict[str, str]]
    chosen: str
    rejected: str
    system: str | None = None


def _messages(value: Any, what: str) -> list[dict[str, str]] | None:
    """`value` as chat messages, None if it is text; anything else is a sentence naming `what`."""
    if isinstance(value, str):
        return None
    if isinstance(value, Sequence) and value and all(isinstance(m, Mapping) and {"role", "content"} <= set(m)
                                                     for m in value):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in value]
    raise ConfigError(f"{what} is neither text nor a list of {{role, content}} messages")


def _answer(row: Mapping[str, Any], field: str, column: str, where: str) -> tuple[str, list[dict[str, str]]]:
    """(the assistant's answer, the messages before it) of the response in `column`, given as text or messages."""
    what = f"{where}: {column!r} (mapped to {field})"
    if row.get(column) is None:
        raise ConfigError(f"{where} has no {column!r} (mapped to {field})")
    messages = _messages(row[column], what)
    answer, context = (row[column], []) if messages is None else (messages[-1]["content"], messages[:-1])
    if messages is not None and messages[-1]["role"] != "assistant":
        raise ConfigError(f"{what} ends with a {messages[-1]['role']!r} message, not the assistant's answer")
    if not answer.strip():
        raise ConfigError(f"{what} is an empty response")
    return answer, context


def read_pair(row: Mapping[str, Any], keys: Mapping[str, str], where: str) -> Pair:
    """One row's pair through `map_keys` (output field → input column); a malformed row is a ConfigError naming
    `where` (the file and row), the field and what is wrong."""
    chosen, chosen_context = _answer(row, "chosen", keys["chosen"], where)
    rejected, rejected_context = _answer(row, "rejected", keys["rejected"], where)
    if chosen == rejected:
        raise ConfigError(f"{where}: {keys['chosen']!r} and {keys['rejected']!r} (chosen and rejected) are the same "
                          f"response, a pair that teaches nothing")
    system = row.get(keys["system"]) if "system" in keys else None
    if "prompt" in keys and row.get(keys["prompt"]) is not None:
        prompt = row[keys["prompt"]]
        messages = _messages(prompt, f"{where}: {keys['prompt']!r}")
        return Pair(prompt if messages is None else messages, chosen, rejected, system)
    if not chosen_context or chosen_context != rejected_context:
        raise ConfigError(f"{where} has no prompt column and its chosen and rejected conversations do not share the "
                          f"messages before the answer; map `prompt` to the prompt's column")
    return Pair(chosen_context, chosen, rejected, system)


def render_prompt(pair: Pair, template: Template | ChatTemplate, tokenizer: Any, where: str) -> str:
    """The prompt text the policy continues, as GRPO's and SFT's prompts are rendered."""
    if isinstance(pair.prompt, str):
        return template.render(pair.prompt, pair.system, tokenizer)
    messages = pair.prompt
    if isinstance(template, ChatTemplate):
        with_system = ([{"role": "system", "content": pair.system}] if pair.system else []) + messages
        return tokenizer.apply_chat_template(with_system, tokenize=False, add_generation_prompt=True)
    system = pair.system
    if messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    if len(messages) != 1 or messages[0]["role"] != "user":
        raise ConfigError(f"{where}: template {template.name} renders one user turn, but the prompt has "
                          f"{[m['role'] for m in messages]}; use prompt_type: tokenizer (the tokenizer's chat "
                          f"template) for conversations")
    return template.render(messages[0]["content"], system, tokenizer)


def response_ids(text: str, tokenizer: Any) -> list[int]:
    """A response's tokens and the EOS the rollout stops on (as SFT teaches it)."""
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer at {tokenizer.name_or_path} has no EOS token; preference responses must "
                          f"end with the token generation stops on.")
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


#: the columns of a preprocessed pairwise parquet the DPO trainer reads
PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


@dataclass(frozen=True)
class PairExample:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


def read_pairs(path: str | Path, seq_length: int) -> tuple[list[PairExample], int]:
    """The pairs of a pairwise parquet (cli/preprocess_data.py with is_pairwise_dataset) whose prompt and longer
    response fit `seq_length`, and how many did not: a pair is dropped whole, never cut (a cut response would teach
    the policy to stop mid-answer, and a pair cut on one side only compares unlike things)."""
    try:
        columns = read_columns(path, PAIR_COLUMNS)
    except ConfigError as err:
        raise ConfigError(f"{err.args[0].rstrip('.')}; the DPO trainer reads preference pairs: preprocess the data "
                          f"with is_pairwise_dataset: true.") from None
    pairs, too_long = [], 0
    for row, (prompt, chosen, rejected) in enumerate(zip(*columns.values(), strict=True)):
        if len(prompt) >= seq_length:
            raise ConfigError(f"{path} row {row}: its prompt of {len(prompt)} tokens leaves no room for a response "
                              f"within seq_length={seq_length}; raise seq_length or preprocess with a "
                              f"max_prompt_length below it.")
        if len(prompt) + max(len(chosen), len(rejected)) > seq_length:
            too_long += 1
            continue
        pairs.append(PairExample(list(prompt), list(chosen), list(rejected)))
    if not pairs:
        raise ConfigError(f"every pair of {path} is longer than seq_length={seq_length} tokens; raise seq_length.")
    return pairs, too_long


def dpo_batch(pairs: list[PairExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Rows 2i and 2i + 1 are pair i's prompt with its chosen and its rejected response, right-padded: `tokens`,
    the `loss_mask` of the worker's convention (1 at t when tokens[t + 1] is a response token, EOS included), and
    `prompt_lengths` / `response_lengths`, which let the two rows of a pair share one copy of their prompt."""
    rows = [(p.prompt_ids, response) for p in pairs for response in (p.chosen_ids, p.rejected_ids)]
    width = max(len(prompt) + len(response) for prompt, response in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), width)
    for row, (prompt, response) in enumerate(rows):
        tokens[row, :len(prompt) + len(response)] = torch.tensor(prompt + response)
        loss_mask[row, len(prompt) - 1:len(prompt) + len(response) - 1] = 1.0
    return {"tokens": tokens, "loss_mask": loss_mask, "prompt_lengths": torch.tensor([len(p) for p, _ in rows]),
            "response_lengths": torch.tensor([len(r) for _, r in rows])}
