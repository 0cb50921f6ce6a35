"""Loading HF tokenizers from local directories, and building a tiny one offline.

The tiny tokenizer (byte-level BPE trained on local text, ChatML special tokens, a chat
template) lets the CPU demo and the tests tokenize real text with no hub access; its
vocabulary fits the tiny model (1024 rows).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from mindrl.config.errors import ConfigError
from mindrl.config.model import ModelArch

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def load_tokenizer(path: str | Path, model: ModelArch | None = None):
    """An HF tokenizer from a local directory (never the hub); with `model`, one whose every token id
    has a row in the model's embedding (a larger id would index past it in the first forward pass)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"tokenizer_name_or_path {path} is not a directory; point it at a local HF model "
                          f"or tokenizer directory.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"tokenizer_name_or_path {path} holds no tokenizer transformers can load ({first}); point "
                          f"it at a local HF model or tokenizer directory.") from None
    if model is not None and len(tokenizer) > model.padded_vocab_size:
        raise ConfigError(f"the tokenizer at {path} has {len(tokenizer)} token ids but model {model.name} has "
                          f"{model.padded_vocab_size} embedding rows; use the model's own tokenizer or a model with "
                          f"padded_vocab_size >= {len(tokenizer)}.")
    return tokenizer


def build_tiny_tokenizer(out_dir: str | Path, texts: Iterable[str], vocab_size: int = 1024,
                         split_digits: bool = False, vision_tokens: Sequence[str] = (),
                         tool_tokens: Sequence[str] = ()) -> Path:
    """Train a byte-level BPE of `vocab_size` ids on `texts` and save it as an HF tokenizer.

    `split_digits` gives every digit its own token (as Qwen's and Llama-3's tokenizers do): a
    number's tokens then spell it, instead of each frequent number being one unrelated id —
    what lets a tiny model learn arithmetic facts it can generalise across. `vision_tokens` (a
    vision-language model's image markers) take the last ids, where tiny_qwen25_vl expects them. `tool_tokens`
    (the tool-call tags) become one token each but stay text, as in Qwen's tokenizer: decoding keeps them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]) \
        if split_digits else byte_level
    tokenizer.decoder = decoders.ByteLevel()
    learned = vocab_size - len(vision_tokens) - len(tool_tokens)
    trainer = trainers.BpeTrainer(vocab_size=learned, special_tokens=CHATML_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() != learned:
        raise ValueError(f"the texts yield {tokenizer.get_vocab_size()} BPE tokens, fewer than the "
                         f"{learned} asked for; give more text or a smaller vocab_size.")
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in tool_tokens])
    tokenizer.add_special_tokens(list(vision_tokens))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=[*CHATML_SPECIALS[1:], *vision_tokens])
    fast.chat_template = CHATML_TEMPLATE
    out_dir = Path(out_dir)
    fast.save_pretrained(str(out_dir))
    return out_dir
