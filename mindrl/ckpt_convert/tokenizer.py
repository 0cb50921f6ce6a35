"""--tokenizer-model (MindSpeed-LLM's flag): the tokenizer a converted checkpoint carries.

MindSpeed-LLM's converter needs the tokenizer to size the vocabulary; here the size comes
from the weights, so the flag does what a user passing it expects of the output: the
tokenizer files of that path travel with the checkpoint (replacing those of the source),
after checking that every token id has an embedding row.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mindrl.config import ConfigError

# The files HF tokenizers are made of; a directory contributes those it has.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                   "chat_template.json")


def tokenizer_files(path: str | Path, vocab_rows: int) -> list[Path]:
    """The tokenizer files of `path` (a tokenizer file or a directory holding them), checked to fit."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--tokenizer-model {path} does not exist.")
    folder = path if path.is_dir() else path.parent
    files = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if path.is_file() and path not in files:
        files.insert(0, path)
    if not files:
        raise FileNotFoundError(f"--tokenizer-model {path} holds no tokenizer files "
                                f"({', '.join(TOKENIZER_FILES[:3])}, ...).")
    count = _token_count(folder / "tokenizer.json")
    if count is not None and count > vocab_rows:
        raise ConfigError(f"--tokenizer-model {path} has {count} tokens but the model's vocabulary has "
                          f"{vocab_rows} rows; pass the tokenizer of this model.")
    return files


def copy_tokenizer(files: list[Path], target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for path in files:
        shutil.copy2(path, target / path.name)


def _token_count(path: Path) -> int | None:
    """1 + the largest token id of an HF tokenizer.json, or None when there is none to read."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"--tokenizer-model: {path} is not valid JSON; pass an HF tokenizer.") from None
    vocab = (data.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [token["id"] for token in data.get("added_tokens") or [] if isinstance(token.get("id"), int)]
    return 1 + max(ids) if ids else None
