"""A vision-language actor's weights, vision tower included, synced into vLLM: the engine's log-probs of its own
samples for image prompts are the actor's, and the images' tokens stay off the loss."""

import pytest

from mindrl.config import ParallelConfig, load_model_arch
from mindrl.data.images import ImageSizing, PromptImages
from mindrl.data.shapes import generate_shape_problems
from mindrl.launch import run_ranks
from mindrl.models import sharding
from mindrl.rollout.config import GenerateConfig, SamplingConfig
from mindrl.trainer.experience import rollout_batch
from mindrl.workers.megatron_worker import ActorConfig, ActorWorker

pytestmark = pytest.mark.job  # every test here starts a Ray job or a vLLM engine

pytest.importorskip("vllm")

SIZING = ImageSizing(112 * 112, 112 * 112)  # one 112-pixel image: 8 x 8 patches, 16 tokens
GENERATE = GenerateConfig(dtype="float32", max_model_len=128, cpu_kv_cache_mb=16, max_num_seqs=64,
                          max_num_batched_tokens=1024, check_weight_sync=True, limit_mm_per_prompt=2,
                          sampling_config=SamplingConfig(max_tokens=12, temperature=0.8))


def image_prompts(arch) -> tuple[list[list[int]], list[PromptImages | None]]:
    """Three prompts: one image, two images, and text alone; placeholders expanded as preprocessing does."""
    vision = arch.vision
    start, end, pad = vision.vision_start_token_id, vision.vision_end_token_id, vision.image_token_id
    files = [row["images"][0] for row in generate_shape_problems("mixed", 3, seed=2)]
    image = [start] + [pad] * 16 + [end]
    prompts = [[5, 9, *image, 40, 41, 7], [3, *image, 8, *image, 11], [12, 13, 14, 15]]
    return prompts, [PromptImages((files[0],), SIZING), PromptImages((files[1], files[2]), SIZING), None]


def _engine_vs_actor(rank: int, tp: int, pp: int) -> dict:
    from mindrl.rollout.vllm_engine import VllmEngine
    from mindrl.workers.colocated import ColocatedRollout

    arch = load_model_arch("tiny_qwen25_vl")
    cfg = ActorConfig(lr=1e-3, temperature=0.8, mini_batch_size=6, micro_batch_size=2)
    actor = ActorWorker(arch, ParallelConfig(tp, pp), cfg, weights=sharding.random_full_state_dict(arch, seed=4,
                                                                                                     std=0.1))
    rollout = ColocatedRollout(actor, VllmEngine(arch, GENERATE), GENERATE)
    prompts, images = image_prompts(arch)
    result, metrics = rollout.generate(prompts, n=2, images=images)
    batch = rollout_batch(prompts, result, 2, images=images)
    scored = actor.compute_log_prob(batch)
    rollout.engine.close()
    out = {"metrics": metrics, "responses": result.responses, "batch": batch}
    if scored is not None:
        rows = actor.local_rows(batch["tokens"].shape[0])
        mask = batch["loss_mask"][rows]
        out["diff"] = ((scored["log_probs"] - batch["engine_log_probs"][rows]) * mask).abs().max().item()
    return out


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_vllm_scores_its_image_samples_as_the_actor_after_a_sync(tp, pp):
    ranks = run_ranks(_engine_vs_actor, 2, tp, pp)
    diffs = [r["diff"] for r in ranks if "diff" in r]
    print(f"vl engine vs actor at TP{tp} PP{pp}: max {max(diffs):.2e}")
    assert diffs and max(diffs) <= 1e-4, diffs
    metrics = ranks[0]["metrics"]
    assert metrics["sync/differing_tensors"] == 0 and metrics["sync/checked_tensors"] > 0
    batch = ranks[0]["batch"]
    image = load_model_arch("tiny_qwen25_vl").vision.image_token_id
    # the images' tokens (and everything else of the prompts) are off the loss; the responses are on it
    assert not (batch["loss_mask"].bool() & (batch["tokens"] == image)).any()
    assert batch["loss_mask"].sum() == sum(len(r) for r in ranks[0]["responses"])
    assert batch["image_grid_thw"].shape == (6, 2, 3) and batch["image_grid_thw"][4:].sum() == 0
    assert len({tuple(r) for r in ranks[0]["responses"]}) == 6  # sampled, not one answer repeated
