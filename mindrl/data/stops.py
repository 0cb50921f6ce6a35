"""Where a response ends: the tokenizer's end of sequence and the prompt template's end of turn.

A base model's tokenizer ends sequences with `<|endoftext|>` while a chat template ends the
assistant's turn with `<|im_end|>` (templates.json's `stop_words`). Stopping only at the first lets a
response run past the end of its turn into an invented next turn, and those tokens are trained on;
so the rollout stops at both, keeps the stop token as the response's last (trained) token, and the
scorer reads the text up to it. The template is chosen when the data is preprocessed, so
cli/preprocess_data.py records it in the parquet's metadata, and the trainers read it from there
(or from `prompt_type`, MindSpeed-RL's key, for data preprocessed elsewhere).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mindrl.config.errors import ConfigError
from mindrl.data.templates import ChatTemplate, Template, get_template

#: the parquet schema-metadata key under which preprocessing records its template
TEMPLATE_METADATA = b"mindrl.template"
#: end-of-sequence tokens every rollout stops at, besides the tokenizer's own eos, where the vocabulary has them
ALWAYS_STOP = ("<|endoftext|>",)


def template_record(prompt_type: str, stop_words: Sequence[str]) -> dict[bytes, bytes]:
    """The schema metadata preprocessing writes beside its rows."""
    return {TEMPLATE_METADATA: json.dumps({"prompt_type": prompt_type, "stop_words": list(stop_words)}).encode()}


def recorded_template(path: str | Path) -> dict[str, Any] | None:
    """{prompt_type, stop_words} recorded in a preprocessed parquet, None for data written without it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        return None
    try:
        metadata = pq.read_schema(path).metadata or {}
    except pa.ArrowException:  # no parquet: the prompt reader says so in its own sentence
        return None
    return json.loads(metadata[TEMPLATE_METADATA]) if TEMPLATE_METADATA in metadata else None


def run_template(data_file: str | Path, prompt_type: str | None = None,
                 prompt_type_path: str | Path | None = None) -> Template | ChatTemplate | None:
    """The template the data was rendered with: `prompt_type`'s if given (it must agree with the one the data
    records), else the recorded one; None for data that records none."""
    recorded = recorded_template(data_file)
    if prompt_type is None:
        return get_template(recorded["prompt_type"]) if recorded else None
    if recorded and recorded["prompt_type"] != prompt_type:
        raise ConfigError(f"prompt_type={prompt_type!r} but {data_file} was preprocessed with template "
                          f"{recorded['prompt_type']!r}; remove prompt_type (the data's template is read from it) or "
                          f"preprocess the data with {prompt_type!r}.")
    return get_template(prompt_type, prompt_type_path)


def run_stop_words(data_file: str | Path, prompt_type: str | None = None,
                   prompt_type_path: str | Path | None = None) -> tuple[str, ...]:
    """The stop words of the template the data was rendered with (the recorded ones where the data records
    them); none for data that records none."""
    recorded = recorded_template(data_file)
    if prompt_type is None:
        return tuple(recorded["stop_words"]) if recorded else ()
    return run_template(data_file, prompt_type, prompt_type_path).stop_words


def stop_token_ids(tokenizer: Any, stop_words: Sequence[str] = ()) -> tuple[int, ...]:
    """The token ids a rollout stops at: the tokenizer's eos, `<|endoftext|>` where it is one token, and each stop
    word, which must be exactly one token of this tokenizer (the engines stop on ids, not on text)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for word in ALWAYS_STOP:
        found = tokenizer.convert_tokens_to_ids(word)
        if found is not None and found != tokenizer.unk_token_id:
            ids.add(found)
    for word in stop_words:
        encoded = tokenizer.encode(word, add_special_tokens=False)
        if len(encoded) != 1:
            raise ConfigError(f"the template's stop word {word!r} is {len(encoded)} tokens of this tokenizer, but "
                              f"rollouts stop on a single token; use a template whose stop words are special tokens "
                              f"of the tokenizer (or add {word!r} to it as one).")
        ids.add(encoded[0])
    if not ids:
        raise ConfigError("the tokenizer has no eos token and the template no stop words, so no response could end "
                          "before max_tokens; use a tokenizer with an eos token or a template with stop_words.")
    return tuple(sorted(ids))


def response_text(tokenizer: Any, response: Sequence[int], stop_ids: Sequence[int]) -> str:
    """The text the scorer reads: the response up to its first stop token (the engines end it there; nothing
    after it is graded). The stop token itself is left out where it is a special token, as decoding without
    special tokens would (a format check then sees the turn's own text whatever the tokenizer's end marker);
    other special tokens stay, so an end-of-turn marker that is no stop id of this run is still there for the
    scorer's own cut (skipping special tokens deleted it, and the scorer graded the turn invented after it)."""
    stops = set(stop_ids)
    end = next((i + 1 for i, token in enumerate(response) if token in stops), len(response))
    if end and response[end - 1] in stops and response[end - 1] in set(tokenizer.all_special_ids):
        end -= 1
    return tokenizer.decode(list(response[:end]), skip_special_tokens=False)


def trajectory_text(tokenizer: Any, response: Sequence[int], stop_ids: Sequence[int]) -> str:
    """A multi-turn response as the scorer reads it: every turn, the model's and the tools' (the built-in answer
    verifiers grade the text after the last assistant turn's start; a custom one may read the whole); the last stop
    token is left out as `response_text` does."""
    end = len(response)
    if end and response[-1] in set(stop_ids) and response[-1] in set(tokenizer.all_special_ids):
        end -= 1
    return tokenizer.decode(list(response[:end]), skip_special_tokens=False)
