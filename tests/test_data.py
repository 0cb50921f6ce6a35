"""Templates, the tiny tokenizer, dataset reading and deterministic preprocessing."""

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mindrl.config import ConfigError, load_model_arch
from mindrl.data.preprocess import PreprocessConfig, preprocess
from mindrl.data.readers import read_columns, read_rows
from mindrl.data.synthetic import generate_problems
from mindrl.data.templates import get_template
from mindrl.data.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_TEMPLATES = ROOT.parent / "shared/reference/mindspeed_rl/configs/model/templates.json"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tiny_tokenizer"
    subprocess.run([sys.executable, str(ROOT / "cli" / "build_tiny_tokenizer.py"), "--out", str(out)], check=True)
    return out


def test_qwen_r1_is_the_r1_zero_prompt():
    text = get_template("qwen_r1").render("What is 1+1?")
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                           "A conversation between User and Assistant.")
    assert "<think> </think> and <answer> </answer> tags" in text and "within \\boxed{}." in text
    assert text.endswith("\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n")
    assert get_template("qwen_r1").render("q", system="Be brief.").startswith("<|im_start|>system\nBe brief.")


@pytest.mark.skipif(not REFERENCE_TEMPLATES.is_file(), reason="MindSpeed-RL reference templates not present")
@pytest.mark.parametrize("name", ["qwen_r1", "qwen", "empty"])
def test_templates_render_like_mindspeed_rl(name):
    theirs = get_template(name, REFERENCE_TEMPLATES).render("Find x.")
    assert get_template(name).render("Find x.") == theirs


def test_template_special_tokens_and_the_tokenizers_own(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    tokenizer.bos_token = "<|endoftext|>"
    assert get_template("llama3").render("hi", tokenizer=tokenizer).startswith(
        "<|endoftext|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>")
    assert get_template("tokenizer").render("hi", tokenizer=tokenizer) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ConfigError, match=r"unknown prompt_type 'qwen9'; known: .*qwen_r1"):
        get_template("qwen9")


def test_user_templates_file(tmp_path):
    path = tmp_path / "templates.json"
    path.write_text(json.dumps([{"name": "mine", "format_user": {"slots": ["Q: {{content}}\nA:"]}}]))
    assert get_template("mine", path).render("2+2?") == "Q: 2+2?\nA:"


def test_tiny_tokenizer_round_trips_and_fits_the_tiny_model(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    assert len(tokenizer) <= 1024
    text = get_template("qwen_r1").render("Ava has 3 apples. How many?")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids and tokenizer.eos_token == "<|im_end|>"


def test_a_folder_without_a_tokenizer_and_a_tokenizer_larger_than_the_model_are_one_sentence(tmp_path,
                                                                                         tokenizer_dir):
    (tmp_path / "notes.txt").write_text("not a tokenizer")
    with pytest.raises(ConfigError, match=r"^tokenizer_name_or_path .* holds no tokenizer transformers can load"):
        load_tokenizer(tmp_path)
    small = replace(load_model_arch("tiny_qwen"), padded_vocab_size=100)
    with pytest.raises(ConfigError, match=r"has \d+ token ids but model tiny_qwen has 100 embedding rows"):
        load_tokenizer(tokenizer_dir, small)


def test_a_prompt_file_that_is_not_parquet_is_one_sentence(tmp_path):
    (tmp_path / "train.parquet").write_text("{}")
    with pytest.raises(ConfigError, match=r"train.parquet is not a parquet file .*; it must be the output of "
                                          r"cli/preprocess_data.py\.$"):
        read_columns(tmp_path / "train.parquet", ("prompt",))


def test_synthetic_problems_are_deterministic_and_correct():
    a, b = generate_problems("mixed", 200, seed=3), generate_problems("mixed", 200, seed=3)
    assert a == b and a != generate_problems("mixed", 200, seed=4)
    for problem in a:
        assert problem["solution"].endswith(f"#### {problem['answer']}")
        if problem["kind"] == "arithmetic":
            expression = problem["question"].removeprefix("Compute ").removesuffix(".")
            assert eval(expression) == int(problem["answer"])  # an independent check of the generator


def test_fact_problems_are_times_table_facts_answered_in_one_sentence():
    problems = generate_problems("facts", 600, seed=2)
    assert problems == generate_problems("facts", 600, seed=2)
    assert {p["kind"] for p in problems} == {"fact_bare", "fact_word"}
    for problem in problems:
        a, op, b = problem["fact"].split()
        assert 0 <= int(a) <= 9 and 0 <= int(b) <= 9 and op == "*"
        assert int(a) * int(b) == int(problem["answer"])  # an independent check of the generator
        assert problem["solution"] == f"The answer is {problem['answer']}."
        numbers = [int(n) for n in re.findall(r"\d+", problem["question"])]
        assert numbers[:2] == [int(a), int(b)]  # the question states the fact's two numbers, in order
    assert len({p["fact"] for p in problems}) > 95  # nearly all of the 100 facts


def test_the_facts_tokenizer_spells_numbers_digit_by_digit(tmp_path):
    cli = Path(__file__).resolve().parents[1] / "cli" / "build_tiny_tokenizer.py"
    subprocess.run([sys.executable, str(cli), "--out", str(tmp_path / "tok"), "--task", "facts", "--vocab-size", "512",
                    "--split-digits"], check=True, capture_output=True)
    tokenizer = load_tokenizer(tmp_path / "tok")
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("The answer is 28.", add_special_tokens=False))
    assert tokens[-3:] == ["2", "8", "."] and len(tokenizer) <= 512


def _config(tokenizer_dir, out, **kw):
    base = dict(output_dir=str(out), tokenizer_name_or_path=str(tokenizer_dir), prompt_type="qwen_r1",
                map_keys={"prompt": "question", "answer": "answer"}, max_prompt_length=512)
    return PreprocessConfig(**{**base, **kw})


def test_preprocessing_twice_gives_byte_identical_parquet(tokenizer_dir, tmp_path):
    gen = {"kind": "mixed", "num_samples": 300, "seed": 1}
    first = preprocess(_config(tokenizer_dir, tmp_path / "a", generator=gen, test_fraction=0.1))
    second = preprocess(_config(tokenizer_dir, tmp_path / "b", generator=gen, test_fraction=0.1))
    assert (first.train, first.test) == (second.train, second.test) == (270, 30)
    for split in ("train", "test"):
        assert (tmp_path / "a" / f"{split}.parquet").read_bytes() == (tmp_path / "b" / f"{split}.parquet").read_bytes()
    train = pq.read_table(tmp_path / "a" / "train.parquet").to_pylist()
    test = pq.read_table(tmp_path / "a" / "test.parquet").to_pylist()
    assert {r["index"] for r in train}.isdisjoint({r["index"] for r in test})
    row = train[0]
    tokenizer = load_tokenizer(tokenizer_dir)
    assert tokenizer.decode(row["prompt_ids"]) == row["prompt"] and row["prompt"].endswith("assistant\n")
    assert json.loads(row["extra_info"])["kind"] in ("arithmetic", "word")
    assert row["data_source"] == "generator:mixed"


def test_unseen_test_prompts_keeps_every_test_prompt_out_of_training(tokenizer_dir, tmp_path):
    """Bare facts repeat ("3 * 4 = ?" many times): with the option, no test prompt's text is left in training,
    the rows dropped are counted, and everything else is kept."""
    gen = {"kind": "facts", "num_samples": 600, "seed": 4}
    plain = preprocess(_config(tokenizer_dir, tmp_path / "plain", generator=gen, test_fraction=0.1))
    unseen = preprocess(_config(tokenizer_dir, tmp_path / "unseen", generator=gen, test_fraction=0.1,
                                unseen_test_prompts=True))
    read = {name: {split: pq.read_table(tmp_path / name / f"{split}.parquet").to_pylist()
                   for split in ("train", "test")} for name in ("plain", "unseen")}
    test_prompts = {r["prompt"] for r in read["unseen"]["test"]}
    assert read["unseen"]["test"] == read["plain"]["test"]
    overlap = [r for r in read["plain"]["train"] if r["prompt"] in test_prompts]
    assert len(overlap) > 0  # without the option, repeated bare prompts reach both splits
    assert read["unseen"]["train"] == [r for r in read["plain"]["train"] if r["prompt"] not in test_prompts]
    assert unseen.dropped_seen_in_test == len(overlap) and unseen.train == plain.train - len(overlap)
    with pytest.raises(ConfigError, match="there is no test split"):
        _config(tokenizer_dir, tmp_path / "x", generator=gen, unseen_test_prompts=True)


@pytest.fixture
def raw_rows():
    return [{"problem": "What is 2+2?", "answer": 4, "level": 1},
            {"problem": "What is 10-3?", "answer": "7", "level": 2},
            {"problem": "Long " + "word " * 600, "answer": "1", "level": 3}]


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "saved_dataset"])
def test_every_input_format_reads_the_same_rows(tmp_path, raw_rows, kind):
    if kind == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in raw_rows))
    elif kind == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(raw_rows))
    elif kind == "parquet":
        path = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist([{**r, "answer": str(r["answer"])} for r in raw_rows]), path)
    else:  # the layout of datasets' save_to_disk: arrow stream files listed in state.json
        path = tmp_path / "saved"
        path.mkdir()
        table = pa.Table.from_pylist([{**r, "answer": str(r["answer"])} for r in raw_rows])
        with pa.OSFile(str(path / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(
                sink, table.schema) as writer:
            writer.write_table(table)
        (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    rows = list(read_rows(path))
    assert [r["problem"] for r in rows] == [r["problem"] for r in raw_rows]
    assert [str(r["answer"]) for r in rows] == ["4", "7", "1"]


def test_long_prompts_are_dropped_and_counted_and_response_is_an_alias(tokenizer_dir, tmp_path, raw_rows):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in raw_rows))
    report = preprocess(_config(tokenizer_dir, tmp_path / "out", input=str(path),
                                map_keys={"prompt": "problem", "response": "answer"}))
    assert (report.rows_read, report.kept, report.dropped_too_long) == (3, 2, 1)
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [r["answer"] for r in rows] == ["4", "7"]
    assert json.loads(rows[0]["extra_info"]) == {"level": 1}
    assert not (tmp_path / "out" / "test.parquet").exists()


@pytest.mark.parametrize("bad_row, message", [
    ({"answer": "1"}, r"row 1 has no 'problem' \(mapped to prompt\)"),
    ({"problem": "   ", "answer": "1"}, r"row 1: 'problem' \(mapped to prompt\) is empty"),
    ({"problem": ["a", "list"], "answer": "1"}, r"row 1: 'problem' \(mapped to prompt\) is a list, not text"),
    ({"problem": "ok?", "answer": None}, r"row 1 has no 'answer' \(mapped to answer\)"),
])
def test_bad_rows_name_the_row_and_key_or_are_skipped_and_counted(tokenizer_dir, tmp_path, bad_row, message):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"problem": "fine?", "answer": "2"}) + "\n" + json.dumps(bad_row) + "\n")
    kw = dict(input=str(path), map_keys={"prompt": "problem", "answer": "answer"})
    with pytest.raises(ConfigError, match=message + r".*skip_bad_rows: true"):
        preprocess(_config(tokenizer_dir, tmp_path / "out", **kw))
    assert not (tmp_path / "out").exists()
    report = preprocess(_config(tokenizer_dir, tmp_path / "out", skip_bad_rows=True, **kw))
    assert (report.kept, report.skipped_bad) == (1, 1) and len(report.bad_examples) == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "give exactly one of input"),
    (dict(input="x", map_keys={"prompt": "q"}), "must name the input columns for prompt and answer"),
    (dict(input="x", map_keys={"prompt": "q", "answer": "a", "label": "l"}), "unknown fields"),
    (dict(input="x", test_fraction=1.0), "test_fraction must be in"),
])
def test_recipe_mistakes(tmp_path, kwargs, message):
    base = dict(output_dir=str(tmp_path), tokenizer_name_or_path="t")
    with pytest.raises(ConfigError, match=message):
        PreprocessConfig(**{**base, **kwargs})


def test_cli_with_hydra_recipe_and_overrides(tokenizer_dir, tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "cli" / "preprocess_data.py"), "--config-name",
                          "synthetic_math", f"tokenizer_name_or_path={tokenizer_dir}", f"output_dir={tmp_path}",
                          "generator.num_samples=120"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert (summary["rows_read"], summary["train"], summary["test"]) == (120, 114, 6)
    assert "kept 120" in out.stderr
    bad = subprocess.run([sys.executable, str(ROOT / "cli" / "preprocess_data.py"), "--config-name", "nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "no recipe 'nope'" in bad.stderr and "synthetic_math" in bad.stderr
