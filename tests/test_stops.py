"""Where a response ends: the template's stop words recorded with the data, turned into the engines' stop ids,
and the text the scorer reads."""

import json
from pathlib import Path

import pytest

from mindrl.config import ConfigError
from mindrl.data.preprocess import PreprocessConfig, preprocess
from mindrl.data.stops import recorded_template, response_text, run_stop_words, stop_token_ids
from mindrl.data.tokenizer import load_tokenizer
from mindrl.rewards import get_verifier


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory):
    """The tiny tokenizer as a base model's: its eos is <|endoftext|>, so <|im_end|> is the template's alone."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("stops")
    cli = Path(__file__).resolve().parents[1] / "cli"
    subprocess.run([sys.executable, str(cli / "build_tiny_tokenizer.py"), "--out", str(root / "chat")], check=True,
                   capture_output=True)
    tokenizer = load_tokenizer(root / "chat")
    tokenizer.eos_token = "<|endoftext|>"
    tokenizer.save_pretrained(str(root / "base"))
    return root / "base"


def _data(tokenizer: Path, out: Path, prompt_type: str, **kw) -> Path:
    preprocess(PreprocessConfig(output_dir=str(out), tokenizer_name_or_path=str(tokenizer), prompt_type=prompt_type,
                                generator={"kind": "arithmetic", "num_samples": 20, "seed": 0},
                                map_keys={"prompt": "question", "answer": "answer"}, **kw))
    return out / "train.parquet"


def test_preprocessing_records_the_template_and_the_trainers_stop_at_its_stop_words(base_tokenizer, tmp_path):
    tokenizer = load_tokenizer(base_tokenizer)
    eos, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    qwen = _data(base_tokenizer, tmp_path / "qwen", "qwen_r1")
    assert recorded_template(qwen) == {"prompt_type": "qwen_r1", "stop_words": ["<|im_end|>"]}
    assert stop_token_ids(tokenizer, run_stop_words(qwen)) == tuple(sorted({eos, im_end}))
    # the tokenizer's own chat template and a template without stop words add none: eos alone
    own = _data(base_tokenizer, tmp_path / "own", "tokenizer")
    assert stop_token_ids(tokenizer, run_stop_words(own)) == (eos,)
    # data preprocessed elsewhere records nothing: prompt_type (MindSpeed-RL's key) names the template
    import pyarrow.parquet as pq

    bare = tmp_path / "bare.parquet"
    pq.write_table(pq.read_table(qwen).replace_schema_metadata(None), bare)
    assert recorded_template(bare) is None and run_stop_words(bare) == ()
    assert run_stop_words(bare, "llama3") == ("<|eot_id|>",)
    with pytest.raises(ConfigError, match=r"^prompt_type='chatml' but .* was preprocessed with template 'qwen_r1'"):
        run_stop_words(qwen, "chatml")
    assert run_stop_words(qwen, "qwen_r1") == ("<|im_end|>",)


def test_a_stop_word_of_several_tokens_is_one_sentence(base_tokenizer, tmp_path):
    templates = tmp_path / "templates.json"
    templates.write_text(json.dumps([{"name": "wordy", "format_user": {"slots": ["{{content}}"]},
                                      "stop_words": ["<|im_end|>", "End of answer."]}]))
    data = _data(base_tokenizer, tmp_path / "wordy", "wordy", prompt_type_path=str(templates))
    with pytest.raises(ConfigError, match=r"^the template's stop word 'End of answer\.' is \d+ tokens of this "
                                          r"tokenizer, but rollouts stop on a single token"):
        stop_token_ids(load_tokenizer(base_tokenizer), run_stop_words(data))


def test_the_scorer_reads_the_response_up_to_the_end_of_its_turn(base_tokenizer):
    """A response that runs past <|im_end|> into an invented turn: decoded without special tokens, the marker
    vanished and the invented turn's answer was graded; kept, the scorer cuts there."""
    tokenizer = load_tokenizer(base_tokenizer)
    stops = stop_token_ids(tokenizer, ["<|im_end|>"])
    turn = "<think>3 + 4 = 7</think> <answer>\\boxed{7}</answer>"
    invented = "<|im_start|>user\nAnd 3 + 5?<|im_end|>\n<|im_start|>assistant\n\\boxed{8}"
    ids = tokenizer.encode(turn + "<|im_end|>" + invented, add_special_tokens=False)
    acc = get_verifier("acc")
    assert response_text(tokenizer, ids, stops) == turn
    assert acc(response_text(tokenizer, ids, stops), "7") == 1.0
    assert acc(tokenizer.decode(ids, skip_special_tokens=True), "7") == -0.5  # what the scorer was handed before
    # an end of turn that is no stop id of the run (data without a recorded template) still reaches the scorer
    unstopped = response_text(tokenizer, ids, stop_token_ids(tokenizer))
    assert unstopped.startswith(turn + "<|im_end|><|im_start|>")
    # a stop word that is no special token is the turn's own text, and stays
    word = tokenizer.encode(" answer", add_special_tokens=False)
    assert response_text(tokenizer, word + ids, word) == " answer"
