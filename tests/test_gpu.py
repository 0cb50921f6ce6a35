"""The parity check on CUDA/NCCL (skipped without a GPU): same logits and gradients as on CPU."""

import pytest
import torch

from mindrl.config import ParallelConfig, load_model_arch
from mindrl.launch import run_ranks
from mindrl.models.parity import join_layout, run_layouts, train_replicas

pytestmark = pytest.mark.gpu


def _layouts(rank: int, layouts: list) -> list:
    return run_layouts(rank, load_model_arch("tiny_qwen"), layouts)


def _gpu_layouts() -> list[ParallelConfig]:
    layouts = [ParallelConfig(1, 1)]
    if torch.cuda.device_count() >= 2:
        layouts += [ParallelConfig(2, 1), ParallelConfig(1, 2)]
    return layouts


def test_cuda_logits_and_grads_match_cpu():
    arch = load_model_arch("tiny_qwen")
    layouts = _gpu_layouts()
    world = 2 if len(layouts) > 1 else 1
    gpu = run_ranks(_layouts, world, layouts, device="cuda")
    cpu = run_ranks(_layouts, 1, [ParallelConfig(1, 1)], device="cpu")
    ref_logits, ref_losses, ref_grads = join_layout([cpu[0][0]], arch, ParallelConfig(1, 1))
    for i, par in enumerate(layouts):
        logits, losses, grads = join_layout([ranks[i] for ranks in gpu], arch, par)
        assert (logits - ref_logits).abs().max().item() < 1e-4
        assert losses == pytest.approx(ref_losses, abs=1e-4)
        for name in ref_grads:
            assert (grads[name] - ref_grads[name]).abs().max().item() < 1e-4, name


def _train(rank: int):
    return train_replicas(rank, load_model_arch("tiny_qwen"), ParallelConfig(1, 1), steps=3)


def test_cuda_distributed_optimizer_learns():
    world = min(torch.cuda.device_count(), 2)
    results = run_ranks(_train, world, device="cuda")
    assert results[0].losses[-1] < results[0].losses[0]
    if world == 2:
        assert all(torch.equal(results[0].params[k], results[1].params[k]) for k in results[0].params)


def test_cuda_moe_logits_and_gradients_equal_hf():
    """megatron-core's MoE layer (router, SequentialMLP experts, alltoall dispatcher) on CUDA gives HF's
    Qwen3-MoE / Qwen2-MoE logits and gradients; EP=2 with two GPUs."""
    from tests.test_moe import hf_cases, run_cases

    layouts = {"ep1": ParallelConfig(1, 1)}
    if torch.cuda.device_count() >= 2:
        layouts["ep2"] = ParallelConfig(1, 1, expert_model_parallel_size=2)
    cases, expected = hf_cases()
    out = run_cases(cases, layouts, 2 if len(layouts) > 1 else 1, device="cuda")
    for (kind, aux, layout), (logits, grads) in out.items():
        if aux:
            continue
        hf_logits, hf_grads = expected[kind]
        diff = (logits - hf_logits).abs().max().item()
        print(f"cuda {kind} {layout}: max |logits - HF| = {diff:.2e}")
        assert diff < 1e-4
        for name, grad in hf_grads.items():
            assert (grads[name] - grad).abs().max().item() <= 1e-4 * grad.abs().max().item() + 1e-7, name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="vLLM's expert split needs an engine over two GPUs")
def test_vllm_expert_parallel_engine_scores_its_samples_as_the_expert_parallel_actor():
    """generate_config.enable_expert_parallel: one vLLM engine over two GPUs holds half the experts on each
    (vLLM-CPU cannot, so this runs on GPUs only); its log-probs of its own samples are the EP=2 actor's."""
    import dataclasses

    from tests.test_rollout_vllm import GENERATE, moe_engine_vs_actor

    pytest.importorskip("vllm")
    generate = dataclasses.replace(GENERATE, infer_tensor_parallel_size=2, enable_expert_parallel=True,
                                   infer_expert_parallel_size=2, gpu_memory_utilization=0.3)
    for rank in run_ranks(moe_engine_vs_actor, 2, generate, device="cuda"):
        print(f"cuda vLLM EP=2 engine vs actor: max {rank['max']:.2e} mean {rank['mean']:.2e}")
        assert rank["metrics"]["sync/differing_tensors"] == 0 and rank["max"] <= 1e-4
