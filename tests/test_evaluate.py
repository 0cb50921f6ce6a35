"""cli/evaluate.py: the pass@k estimator, its refusals, and the same figures from an HF model and
from its Megatron conversion at TP=2."""

import itertools

import pyarrow.parquet as pq
import pytest
import torch

from mindrl.ckpt_convert import hf_to_mcore
from mindrl.config import ConfigError
from mindrl.evaluation import EvalConfig, pass_at_k
from tests import jobs
from tests.hf_models import build_hf_model, save_hf_model


@pytest.mark.parametrize("n, c, k", [(5, 0, 1), (5, 2, 1), (5, 2, 2), (6, 3, 4), (8, 1, 8), (7, 5, 3)])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample(n, c, k):
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)


@pytest.mark.parametrize("kwargs, message", [
    (dict(n_samples=4), "greedy decoding"),
    (dict(n_samples=4, temperature=1.0, ks=[8]), "1 <= k <= n_samples=4"),
    (dict(verifiers=["format"], weights=[1.0]), "no accuracy verifier"),
    (dict(max_tokens=2048), "leaves no room"),
])
def test_evaluation_mistakes_are_one_sentence(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EvalConfig(load="x", data="y", tokenizer="z", **kwargs)


@pytest.mark.job
def test_an_hf_model_and_its_tp2_megatron_conversion_evaluate_the_same(tiny_math_data, tmp_path):
    tokenizer, root = tiny_math_data
    model = build_hf_model("qwen2", seed=3, vocab_size=1024, hidden_size=128, intermediate_size=352,
                           max_position_embeddings=1024, rope_theta=1e6)
    hf = save_hf_model(model, tmp_path / "hf")
    mg = hf_to_mcore(hf, tmp_path / "mg", "qwen2", 2, 1, params_dtype=torch.float32, progress=False)
    common = ["--data", str(root / "math"), "--tokenizer", str(tokenizer), "--max-tokens", "24",
              "--n-samples", "3", "--temperature", "1.0", "--k", "2", "3", "--seed", "5"]
    from_hf = jobs.evaluate("--load", str(hf), "--output", str(tmp_path / "hf.parquet"), *common)
    from_mg = jobs.evaluate("--load", str(mg), "--output", str(tmp_path / "mg.parquet"), *common)
    hf_rows, mg_rows = (pq.read_table(tmp_path / f"{name}.parquet").to_pylist() for name in ("hf", "mg"))
    assert len(hf_rows) == 20 * 3 and [r["response"] for r in hf_rows] == [r["response"] for r in mg_rows]
    assert from_hf["by_source"] == from_mg["by_source"]
    overall = from_hf["by_source"]["all"]
    assert overall["prompts"] == 20 and set(from_hf["by_source"]) == {"all", "synthetic_math"}
    assert overall["pass@1"] <= overall["pass@2"] <= overall["pass@3"]
    assert overall["response_length_mean"] == pytest.approx(sum(r["response_length"] for r in hf_rows) / 60)
    assert {"score/acc_mean", "score/format_mean", "score_mean"} <= set(overall)
    assert len({r["response"] for r in hf_rows}) > 50  # sampled, seeded per sample: the three samples differ
