"""Qwen2.5-VL on megatron-core: the converted model's logits and gradients against HF transformers'
Qwen2_5_VLForConditionalGeneration on the same weights and image+text batch (TP=1, TP=2, PP=2), multimodal
positions against HF's get_rope_index, and bit-exact hf -> mg -> hf round trips of the whole model."""

import itertools

import pytest
import torch

from mindrl.checkpoint import megatron as mg
from mindrl.ckpt_convert import hf_to_mcore, mcore_to_hf, mcore_to_mcore
from mindrl.config import ConfigError, load_model_arch
from mindrl.models import hf_mapping as hfm
from mindrl.models.vision import mrope_positions
from tests.hf_models import VL_TOKENS, build_hf_vl_model, save_hf_model
from tests.test_convert import read_hf

IMAGE, START, END = VL_TOKENS["image_token_id"], VL_TOKENS["vision_start_token_id"], VL_TOKENS["vision_end_token_id"]
# (t, h, w) patch grids: one window; four whole windows; windows cut short on the right and at the bottom
GRIDS = [(1, 4, 4), (1, 8, 8), (1, 6, 10)]


def image_batch(seed: int = 0, seq_length: int = 64) -> dict[str, torch.Tensor]:
    """Two rows: the first with image 0 after some text, the second with images 1 and 2 between texts; random
    patches as a processor lays them out, text tokens drawn below the vision ids."""
    gen = torch.Generator().manual_seed(seed)

    def text(n):
        return torch.randint(0, START, (n,), generator=gen).tolist()

    def image(grid):
        t, h, w = grid
        return [START] + [IMAGE] * (t * h * w // 4) + [END]

    rows = [text(5) + image(GRIDS[0]) + text(7),
            text(3) + image(GRIDS[1]) + text(4) + image(GRIDS[2]) + text(2)]
    tokens = torch.tensor([row + text(seq_length - len(row)) for row in rows])
    grid_thw = torch.tensor(GRIDS)
    patches = torch.randn(int(grid_thw.prod(-1).sum()), 3 * 2 * 14 * 14, generator=gen)
    return {"tokens": tokens, "pixel_values": patches, "image_grid_thw": grid_thw}


def hf_forward(model, batch: dict) -> torch.Tensor:
    return model(input_ids=batch["tokens"], pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                 mm_token_type_ids=(batch["tokens"] == IMAGE).int()).logits


@pytest.fixture(scope="module")
def hf_model():
    return build_hf_vl_model(seed=3)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, hf_model):
    return save_hf_model(hf_model, tmp_path_factory.mktemp("vl_hf") / "hf", max_shard_size="200KB")


def test_multimodal_positions_equal_hfs_rope_index(hf_model):
    batch = image_batch()
    arch = hfm.arch_from_hf_config(hf_model.config.to_dict(), "qwen2_5_vl")
    expected, _ = hf_model.model.get_rope_index(batch["tokens"], (batch["tokens"] == IMAGE).int(),
                                                image_grid_thw=batch["image_grid_thw"])
    got = mrope_positions(batch["tokens"], batch["image_grid_thw"], arch.vision)
    assert torch.equal(got, expected)
    assert not torch.equal(got[1], got[2])  # rows and columns differ inside the images


def test_placeholders_that_do_not_fit_their_images_are_one_sentence(hf_model):
    batch = image_batch()
    arch = hfm.arch_from_hf_config(hf_model.config.to_dict(), "qwen2_5_vl")
    with pytest.raises(ConfigError, match=r"^row 1: image 2 has 15 placeholder tokens but its grid \[1, 4, 10\] make"):
        mrope_positions(batch["tokens"], torch.tensor([GRIDS[0], GRIDS[1], (1, 4, 10)]), arch.vision)
    with pytest.raises(ConfigError, match="the batch has 4 images but 3 runs of image placeholders"):
        mrope_positions(batch["tokens"], torch.tensor([*GRIDS, (1, 4, 4)]), arch.vision)


def _megatron_logits_and_grads(rank: int, root: str, batch: dict, weights: torch.Tensor):
    from megatron.core import parallel_state
    from torch.nn.functional import pad

    from mindrl.models.forward import gather_logits, run_microbatches
    from tests.hf_models import load_converted

    model, arch = load_converted(root)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    captured = []

    def weighted_sum(logits, _):
        full = gather_logits(logits)
        captured.append(full.detach().clone())
        # the same scalar HF's side differentiates: logits · fixed weights (vocab padding rows weigh nothing)
        loss = (full * pad(weights, (0, full.shape[-1] - weights.shape[-1]))).sum()
        return loss, {}

    micro = dict(batch, position_ids=mrope_positions(batch["tokens"], batch["image_grid_thw"], arch.vision))
    run_microbatches(model, [micro], weighted_sum)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return {"tp": tp_rank, "pp": pp_rank, "dp": 0, "logits": captured[0] if captured else None, "grads": grads}


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_logits_and_gradients_equal_hf_transformers(tmp_path, hf_model, hf_dir, tp, pp):
    from mindrl.launch import run_ranks
    from tests.grads import assert_gradients_equal
    from tests.hf_models import checkpoint_state

    batch = image_batch()
    weights = torch.randn(*batch["tokens"].shape, hf_model.config.text_config.vocab_size,
                          generator=torch.Generator().manual_seed(7))
    hf_model.zero_grad()
    expected = hf_forward(hf_model, batch)
    (expected * weights).sum().backward()
    hf_grads = checkpoint_state(hf_model, {n: p.grad for n, p in hf_model.named_parameters()})
    hf_model.zero_grad()

    root = hf_to_mcore(hf_dir, tmp_path / "mg", "qwen2_5_vl", tp, pp, params_dtype=torch.float32, progress=False)
    runs = run_ranks(_megatron_logits_and_grads, tp * pp, str(root), batch, weights)
    logits = next(r["logits"] for r in runs if r["logits"] is not None)
    assert (logits[..., :256] - expected.detach()).abs().max().item() <= 1e-5
    arch, par = mg.arch_of(mg.load_args(root)), mg.parallel_of(mg.load_args(root))
    assert any(name.startswith("visual.") for name in hf_grads)
    assert_gradients_equal(runs, hf_grads, arch, par, f"TP{tp} PP{pp}")


@pytest.mark.parametrize("tp, pp", list(itertools.product((1, 2), (1, 2))))
def test_hf_to_mcore_to_hf_is_bit_exact(tmp_path, hf_dir, tp, pp):
    hf_to_mcore(hf_dir, tmp_path / "mg", "qwen2_5_vl", tp, pp, params_dtype=torch.float32, progress=False)
    mcore_to_hf(tmp_path / "mg", tmp_path / "back", max_shard_size="300KB", progress=False)
    original, back = read_hf(hf_dir), read_hf(tmp_path / "back")
    assert sorted(back) == sorted(original)
    assert "visual.patch_embed.proj.weight" in back and "visual.merger.mlp.2.bias" in back
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


def test_vision_tower_sits_in_the_first_stage_replicated_over_tensor_parallel_ranks(tmp_path, hf_dir):
    root = hf_to_mcore(hf_dir, tmp_path / "mg", "qwen2_5_vl", 2, 2, params_dtype=torch.float32, progress=False)
    first = [mg.load_rank(root, t, 0)["model"] for t in (0, 1)]
    last = mg.load_rank(root, 0, 1)["model"]
    name = "vision_model.blocks.1.attn.qkv.weight"
    assert torch.equal(first[0][name], first[1][name]) and first[0][name].shape == (192, 64)
    assert not any(n.startswith("vision_model.") for n in last)
    moved = mcore_to_mcore(root, tmp_path / "tp1", 1, 1, progress=False)
    assert torch.equal(mg.load_rank(moved, 0, 0)["model"][name], first[0][name])


def test_vision_language_architectures_load_and_refuse_what_is_not_built():
    arch = load_model_arch("qwen25_vl_3b")
    assert arch.vision.fullatt_block_indexes == (7, 15, 23, 31) and arch.mrope_section == (16, 24, 24)
    assert load_model_arch("qwen25_vl_7b").vision.image_token_id == 151655
    tiny = load_model_arch("tiny_qwen25_vl")
    assert hfm.model_type_hf_of(tiny) == "qwen2_5_vl"
    assert hfm.arch_from_hf_config(hfm.hf_config_from_arch(tiny, "qwen2_5_vl", torch.float32), "qwen2_5_vl",
                                   name=tiny.name) == tiny
    with pytest.raises(ConfigError, match=r"mrope_section=.* must be three positive counts summing to head_dim / 2"):
        type(tiny)(**{**tiny.__dict__, "mrope_section": (4, 6, 4)})
    with pytest.raises(ConfigError, match="a vision tower needs position_embedding_type: mrope"):
        type(tiny)(**{**tiny.__dict__, "position_embedding_type": "rope", "mrope_section": None})
    with pytest.raises(ConfigError, match=r"HF qwen2 .* cannot hold"):
        hfm.check_hf_can_hold(tiny, "qwen2")
    with pytest.raises(ConfigError, match="vision must be a mapping of the vision tower's keys, got True"):
        type(tiny)(**{**tiny.__dict__, "vision": True})


def _rows_batch() -> tuple[dict, list[int]]:
    """Four rows (the image batch's rows 0, 1, 1, 0) as the workers take them: each row's images zero-padded."""
    from mindrl.models.vision import rows_of_images

    batch = image_batch()
    sizes = batch["image_grid_thw"].prod(-1).tolist()
    per_image = list(batch["pixel_values"].split(sizes))
    rows = [(per_image[0], batch["image_grid_thw"][:1]), (torch.cat(per_image[1:]), batch["image_grid_thw"][1:])]
    order = [0, 1, 1, 0]
    pixels, grids = rows_of_images([rows[r] for r in order])
    return {"tokens": batch["tokens"][order], "pixel_values": pixels, "image_grid_thw": grids}, order


def _worker_log_probs(rank: int, root: str, batch: dict):
    from mindrl.workers.megatron_worker import MegatronWorker

    args = mg.load_args(root)
    worker = MegatronWorker(mg.arch_of(args), mg.parallel_of(args), weights=root, temperature=1.0,
                            micro_batch_size=1)
    return worker.compute_log_prob(batch)


@pytest.mark.parametrize("tp, pp, world", [(1, 1, 2), (1, 2, 2)])
def test_worker_log_probs_of_rows_with_images_equal_hf(tmp_path, hf_model, hf_dir, tp, pp, world):
    """Data-parallel ranks (or pipeline stages) each take their rows with those rows' images."""
    from mindrl.launch import run_ranks

    batch, order = _rows_batch()
    source = image_batch()
    with torch.no_grad():
        hf = torch.log_softmax(hf_forward(hf_model, source), -1)
    expected = hf[:, :-1].gather(-1, source["tokens"][:, 1:, None]).squeeze(-1)[order]
    root = hf_to_mcore(hf_dir, tmp_path / "mg", "qwen2_5_vl", tp, pp, params_dtype=torch.float32, progress=False)
    results = [r for r in run_ranks(_worker_log_probs, world, str(root), batch) if r is not None]
    got = torch.cat([r["log_probs"] for r in results]) if pp == 1 else results[0]["log_probs"]
    assert (got[:, :-1] - expected).abs().max().item() <= 1e-5


def _vl_update(rank: int, freeze: bool) -> dict:
    from megatron.core import parallel_state

    from mindrl.config import ParallelConfig
    from mindrl.workers.megatron_worker import ActorConfig, ActorWorker

    arch = load_model_arch("tiny_qwen25_vl")
    actor = ActorWorker(arch, ParallelConfig(2, 1), ActorConfig(lr=1e-2, mini_batch_size=4, micro_batch_size=2,
                                                                freeze_vision_tower=freeze))
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    batch, _ = _rows_batch()
    # the tiny VL model's vocabulary: the test batch's vision ids (252-255) are plain ids to it; its own are 1020-1023
    ids = {VL_TOKENS[k]: getattr(arch.vision, k) for k in VL_TOKENS}
    batch["tokens"] = batch["tokens"].apply_(lambda t: ids.get(t, t))
    mask = torch.zeros_like(batch["tokens"], dtype=torch.float)
    mask[:, 50:63] = 1
    batch.update(loss_mask=mask, old_log_probs=torch.full_like(mask, -6.9), ref_log_probs=torch.full_like(mask, -6.9),
                 advantages=torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * mask)
    actor.update(batch)
    after = dict(actor.model.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    return {"tp": parallel_state.get_tensor_model_parallel_rank(), "moved": moved,
            "vision": {n: p.detach().clone() for n, p in after.items() if n.startswith("vision_model.")},
            "vision_before": {n: t for n, t in before.items() if n.startswith("vision_model.")}}


@pytest.mark.parametrize("freeze", [False, True], ids=["trained", "frozen"])
def test_a_fresh_vision_tower_is_the_same_on_every_rank_and_freezing_keeps_it(freeze):
    """From scratch, both TP ranks draw the same tower (it is replicated, not cut); an update moves it the same
    on both, or, frozen, not at all while the language model still learns."""
    from mindrl.launch import run_ranks

    ranks = run_ranks(_vl_update, 2, freeze)
    first, second = ranks
    for name, tensor in first["vision_before"].items():
        assert torch.equal(tensor, second["vision_before"][name]), name
        assert torch.isfinite(tensor).all() and (name.endswith("bias") or tensor.abs().sum() > 0), name
    for name, tensor in first["vision"].items():
        assert torch.equal(tensor, second["vision"][name]), name
    vision_moved = {n for n in first["moved"] if n.startswith("vision_model.")}
    assert any(n.startswith("decoder.") for n in first["moved"])
    assert (not vision_moved) if freeze else "vision_model.patch_embed.proj.weight" in vision_moved


# Qwen2.5-VL-3B-Instruct's published config.json (transformers 4.x layout: the language model's keys at the top
# level, the sections under rope_scaling typed "mrope", the vision tower's channels as in_chans)
PUBLISHED_3B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 2048,
    "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
    "vocab_size": 151936, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "hidden_act": "silu", "use_sliding_window": False, "sliding_window": 32768,
    "max_window_layers": 70, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654,
    "image_token_id": 151655, "video_token_id": 151656, "torch_dtype": "bfloat16",
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2}}


def test_the_published_config_layout_reads_as_the_shipped_architecture():
    from mindrl.models import arch_fields as af

    read = hfm.arch_from_hf_config(PUBLISHED_3B, "qwen2_5_vl", name="qwen25_vl_3b")
    shipped = load_model_arch("qwen25_vl_3b")
    assert af.arch_differences(read, shipped, 1) == [] and read.vision == shipped.vision
    with pytest.raises(ConfigError, match="has no mrope_section"):
        hfm.arch_from_hf_config({**PUBLISHED_3B, "rope_scaling": {"type": "mrope"}}, "qwen2_5_vl")
    wider = {**PUBLISHED_3B, "vision_config": {**PUBLISHED_3B["vision_config"], "out_hidden_size": 3584}}
    with pytest.raises(ConfigError, match=r"out_hidden_size=3584 differs from the language model's hidden_size"):
        hfm.arch_from_hf_config(wider, "qwen2_5_vl")


def _shape_prompts() -> tuple[list[list[int]], list]:
    """Text alone, two shape images, one: in this order the engine's 80-token prefill chunks split the image
    prompts over two forwards, and left padding shifts every prompt but the longest."""
    from mindrl.data.images import ImageSizing, PromptImages
    from mindrl.data.shapes import generate_shape_problems

    sizing = ImageSizing(112 * 112, 112 * 112)  # 8 x 8 patches, 16 tokens
    files = [row["images"][0] for row in generate_shape_problems("mixed", 3, seed=5)]
    image = [START] + [IMAGE] * 16 + [END]
    prompts = [[12, 13, 14, 15], [3, *image, 8, *image, 11], [5, 9, *image, 40, 41, 7]]
    return prompts, [None, PromptImages((files[0], files[1]), sizing), PromptImages((files[2],), sizing)]


def _megatron_engine_rollouts(rank: int, root: str) -> dict:
    from mindrl.rollout.config import SamplingConfig
    from mindrl.rollout.megatron_engine import MegatronEngine
    from mindrl.trainer.experience import rollout_batch
    from mindrl.workers.megatron_worker import ActorConfig, ActorWorker

    args = mg.load_args(root)
    actor = ActorWorker(mg.arch_of(args), mg.parallel_of(args),
                        ActorConfig(lr=1e-3, temperature=0.8, mini_batch_size=6, micro_batch_size=2), weights=root)
    engine = MegatronEngine(actor.model, actor.arch, actor.par, [], max_model_len=96, max_num_batched_tokens=80)
    prompts, images = _shape_prompts()
    greedy = engine.generate(prompts, SamplingConfig(top_k=1, max_tokens=6), images=images)
    sampled = engine.generate(prompts, SamplingConfig(temperature=0.8, max_tokens=6, seed=3), n=2, images=images)
    batch = rollout_batch(prompts, sampled, 2, images=images)
    scored = actor.compute_log_prob(batch)
    out = {"greedy": greedy.responses}
    if scored is not None:
        mask = batch["loss_mask"]
        out["diff"] = ((scored["log_probs"] - batch["engine_log_probs"]) * mask).abs().max().item()
    return out


def test_megatron_engine_generates_image_prompts_as_hf_and_scores_them_as_the_actor(tmp_path, hf_model, hf_dir):
    """PP=2: the first stage embeds the images, both stages rotate at the multimodal positions, and each response
    continues past its images' grids (HF's rope delta)."""
    from mindrl.launch import run_ranks

    prompts, images = _shape_prompts()
    expected = []
    with torch.no_grad():
        for prompt, entry in zip(prompts, images, strict=True):
            ids = torch.tensor([prompt])
            pixels = {} if entry is None else dict(zip(("pixel_values", "image_grid_thw"), entry.pixels(), strict=True))
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == IMAGE).int(),
                                    do_sample=False, max_new_tokens=6, min_new_tokens=6, pad_token_id=0, **pixels)
            expected.append(out[0, len(prompt):].tolist())
    root = hf_to_mcore(hf_dir, tmp_path / "mg", "qwen2_5_vl", 1, 2, params_dtype=torch.float32, progress=False)
    ranks = run_ranks(_megatron_engine_rollouts, 2, str(root))
    assert ranks[0]["greedy"] == ranks[1]["greedy"] == expected
    diff = next(r["diff"] for r in ranks if "diff" in r)
    print(f"Megatron engine vs actor on image prompts, PP2: max {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.parametrize("grid", [(1, 8, 8), (1, 6, 10), (1, 12, 4)])
def test_vision_flops_equal_torchs_count_of_the_towers_matmuls(grid):
    """Whole windows, windows cut short on the right and at the bottom: the benchmark's formula against what
    torch's FlopCounterMode counts in the tower's forward."""
    from torch.utils.flop_counter import FlopCounterMode

    from mindrl.models.flops import vision_flops
    from mindrl.models.vision import VisionEncoder

    arch = load_model_arch("tiny_qwen25_vl")
    tower = VisionEncoder(arch.vision, arch.hidden_size)
    with FlopCounterMode(display=False) as counter:
        tower(torch.randn(grid[0] * grid[1] * grid[2], arch.vision.patch_values), torch.tensor([grid]))
    assert vision_flops(arch, grid) == counter.get_total_flops()


def test_image_pad_tokens_a_policy_sampled_are_text(tmp_path, hf_model, hf_dir):
    """A response holding image-pad tokens (a policy may sample them): the worker embeds and positions them as text,
    as the engines fed them, not as more image placeholders. The oracle is HF's model on embeddings built by hand:
    its image features in the prompt's placeholders only, and get_rope_index told which tokens are the image's."""
    from mindrl.launch import run_ranks
    from mindrl.models.vision import rows_of_images

    source = image_batch()
    grid = source["image_grid_thw"][:1]
    pixels = source["pixel_values"][:int(grid.prod())]
    prompt = [7, 8, START] + [IMAGE] * 4 + [END, 9]
    response = [11, IMAGE, IMAGE, 12, START, 13, IMAGE]
    tokens = torch.tensor([prompt + response])
    in_prompt = torch.zeros_like(tokens, dtype=torch.int)
    in_prompt[0, 3:7] = 1
    with torch.no_grad():
        features = hf_model.get_image_features(pixels, grid).pooler_output[0]
        embeds = hf_model.get_input_embeddings()(tokens)
        embeds[0, 3:7] = features
        positions, _ = hf_model.model.get_rope_index(tokens, in_prompt, image_grid_thw=grid)
        logits = hf_model(inputs_embeds=embeds, position_ids=positions).logits
    expected = torch.log_softmax(logits, -1)[0, :-1].gather(-1, tokens[0, 1:, None]).squeeze(-1)
    pixel_rows, grid_rows = rows_of_images([(pixels, grid)])
    batch = {"tokens": tokens, "pixel_values": pixel_rows, "image_grid_thw": grid_rows,
             "prompt_lengths": torch.tensor([len(prompt)]), "response_lengths": torch.tensor([len(response)])}
    root = hf_to_mcore(hf_dir, tmp_path / "mg", "qwen2_5_vl", 1, 1, params_dtype=torch.float32, progress=False)
    got = next(r for r in run_ranks(_worker_log_probs, 1, str(root), batch) if r is not None)["log_probs"]
    assert (got[0, :-1] - expected).abs().max().item() <= 1e-5
