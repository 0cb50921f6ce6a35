"""Same weights, same batch: TP=2 (plain and sequence-parallel), PP=2, TP=2×PP=2 and uneven PP equal TP=1 (fp32,
4 gloo ranks)."""

import pytest

from mindrl.config import ParallelConfig, load_model_arch
from mindrl.launch import run_ranks
from mindrl.models.parity import join_layout, run_layouts

LAYOUTS = {
    "tp1": ParallelConfig(1, 1),
    "tp2": ParallelConfig(2, 1),
    "tp2_sequence_parallel": ParallelConfig(2, 1, sequence_parallel=True),
    "pp2": ParallelConfig(1, 2),
    "tp2pp2": ParallelConfig(2, 2),
    "pp2_uneven_1_3": ParallelConfig(1, 2, num_layer_list="1,3"),
    "tp2pp2_uneven_3_1": ParallelConfig(2, 2, num_layer_list="3,1"),
}


def _all_layouts(rank: int, arch_name: str) -> list:
    return run_layouts(rank, load_model_arch(arch_name), list(LAYOUTS.values()))


@pytest.fixture(scope="module")
def joined():
    arch = load_model_arch("tiny_qwen")
    per_rank = run_ranks(_all_layouts, 4, "tiny_qwen")
    return {key: join_layout([ranks[i] for ranks in per_rank], arch, par)
            for i, (key, par) in enumerate(LAYOUTS.items())}


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "tp1"])
def test_logits_and_loss_match_tp1(joined, layout):
    ref_logits, ref_losses, _ = joined["tp1"]
    logits, losses, _ = joined[layout]
    assert logits.shape == ref_logits.shape == (4, 16, 1024)
    assert (logits - ref_logits).abs().max().item() < 1e-5
    assert losses == pytest.approx(ref_losses, abs=1e-5)


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "tp1"])
def test_gradients_match_tp1(joined, layout):
    _, _, ref = joined["tp1"]
    _, _, grads = joined[layout]
    assert grads.keys() == ref.keys()
    for name in ref:
        scale = ref[name].abs().max().item()
        assert scale > 0, f"{name} got no gradient"
        assert (grads[name] - ref[name]).abs().max().item() <= 1e-5 * max(scale, 1.0), name



def test_sequence_parallel_matches_plain_tp2(joined):
    """Only where the norms run and which collective joins the partial sums differ: the numbers hardly move."""
    logits, losses, grads = joined["tp2_sequence_parallel"]
    ref_logits, ref_losses, ref = joined["tp2"]
    assert (logits - ref_logits).abs().max().item() < 1e-6
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    for name in ref:
        assert (grads[name] - ref[name]).abs().max().item() <= 1e-6 * max(ref[name].abs().max().item(), 1.0), name
