"""A Megatron GPTModel loaded from converted TP=2×PP=2 shards gives HF transformers' logits (fp32)."""

import pytest
import torch

from mindrl.ckpt_convert import hf_to_mcore
from mindrl.launch import run_ranks
from tests.hf_models import build_hf_model, megatron_logits, save_hf_model

KINDS = ("qwen2", "llama3", "qwen3")
# A fractional RoPE base as HF keeps it: Megatron's rotary embedding must not round it (at 2.5 an
# integer base moved logits by over 1).
OVERRIDES = {"llama3": {"rope_theta": 2.5}}


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_logits")
    tokens = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(5))
    expected, checkpoints = {}, []
    for kind in KINDS:
        model = build_hf_model(kind, seed=11, **OVERRIDES.get(kind, {}))
        with torch.no_grad():
            expected[kind] = model(tokens).logits
        hf_dir = save_hf_model(model, root / f"hf_{kind}")
        checkpoints.append(str(hf_to_mcore(hf_dir, root / f"mg_{kind}", kind, 2, 2,
                                           params_dtype=torch.float32, progress=False)))
    per_rank = run_ranks(megatron_logits, 4, checkpoints, tokens)
    last_stage = [r for r in per_rank if r[0] is not None]
    assert len(last_stage) == 2  # the two TP ranks of the last pipeline stage
    return {kind: (expected[kind], last_stage[0][i], last_stage[1][i]) for i, kind in enumerate(KINDS)}


@pytest.mark.parametrize("kind", KINDS)
def test_megatron_tp2_pp2_logits_equal_hf(compared, kind):
    hf, megatron, other_tp_rank = compared[kind]
    assert megatron.shape == hf.shape
    assert hf.abs().max() > 1.0  # real, non-trivial logits
    assert (megatron - hf).abs().max().item() < 1e-4
    assert torch.equal(megatron, other_tp_rank)
