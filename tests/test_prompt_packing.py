"""A prompt's samples packed behind one copy of it: the same log-probs as HF transformers scoring each
row on its own, the same gradients as the plain rows, under TP=2, PP=2 and DP=2; auto packs only where
it saves FLOPs."""

import dataclasses

import pytest
import torch

from mindrl.ckpt_convert import hf_to_mcore
from mindrl.config import ParallelConfig, load_model_arch
from mindrl.distributed import release_model_parallel
from mindrl.launch import run_ranks
from mindrl.models import sharding
from mindrl.models.prompt_packing import pack, packing_pays, prompt_groups
from mindrl.workers.megatron_worker import ActorWorker, MegatronWorker
from tests.grads import reduced_grads
from tests.hf_models import build_hf_model, save_hf_model
from tests.test_actor_layouts import BASE

TEMPERATURE = 0.7
# two prompts (5 and 8 tokens) with three samples each; one response is a single token
PROMPTS, RESPONSES = (5, 8), ((4, 7, 1), (3, 6, 2))


def grouped_batch(vocab: int, seed: int = 3, prompts: tuple = PROMPTS, responses: tuple = RESPONSES) -> dict:
    gen = torch.Generator().manual_seed(seed)
    width = max(p + max(r) for p, r in zip(prompts, responses, strict=True)) + 2
    rows, prompt_lengths, response_lengths = [], [], []
    for prompt_length, lengths in zip(prompts, responses, strict=True):
        prompt = torch.randint(1, vocab, (prompt_length,), generator=gen)
        for length in lengths:
            row = torch.zeros(width, dtype=torch.long)  # right-padded with id 0
            row[:prompt_length] = prompt
            row[prompt_length:prompt_length + length] = torch.randint(1, vocab, (length,), generator=gen)
            rows.append(row)
            prompt_lengths.append(prompt_length)
            response_lengths.append(length)
    tokens = torch.stack(rows)
    loss_mask = torch.zeros(tokens.shape)
    for r, (p, n) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
        loss_mask[r, p - 1:p + n - 1] = 1  # the positions whose logits score the response tokens
    return {"tokens": tokens, "loss_mask": loss_mask, "prompt_lengths": torch.tensor(prompt_lengths),
            "response_lengths": torch.tensor(response_lengths)}


def _visible(layout, flat: int) -> set[int]:
    """The keys (Megatron's flat [W, G] indices) that the query at `flat` attends to under `layout`."""
    for g, i in (divmod(row, layout.prompt_index.shape[1]) for row in layout.prompt_rows.tolist()):
        index = layout.prompt_index[g]
        if index[i] == flat:
            return set(index[layout.prompt_allowed[g, 0, i]].tolist())
    for s, i in (divmod(row, layout.response_index.shape[1]) for row in layout.response_rows.tolist()):
        index = layout.response_index[s]
        if index[i] == flat:
            keys = torch.cat([layout.prompt_index[layout.response_group[s]], index])
            return set(keys[layout.response_allowed[s, 0, i]].tolist())
    raise AssertionError(f"{flat} is no prompt's or response's token")


def test_a_packed_row_gives_each_response_token_its_own_rows_context():
    """For every scored token: the packed position that scores it holds the token it follows, at the RoPE
    position it has in its own row, and sees exactly the packed images of that row's earlier tokens."""
    batch = grouped_batch(50)
    tokens, prompts, responses = batch["tokens"], batch["prompt_lengths"], batch["response_lengths"]
    assert [list(g) for g in prompt_groups(tokens, prompts)] == [[0, 1, 2], [3, 4, 5]]
    packed = pack(tokens, prompts, responses, rows=3, width=30)
    assert packed.tokens.shape == (3, 30)  # one more row and more width than needed, as a pipeline may ask
    rows, width = packed.tokens.shape
    flat_tokens, flat_positions = packed.tokens.reshape(-1), packed.position_ids.reshape(-1)
    for row in range(tokens.shape[0]):
        p, n = int(prompts[row]), int(responses[row])
        image = {}  # plain position → packed flat index
        for t in range(p + n - 1):
            if t < p - 1:
                continue
            src = int(packed.source[row, t])
            assert flat_tokens[src] == tokens[row, t] and flat_positions[src] == t
            image[t] = src
        g = image[p - 1] // width
        image.update({t: g * width + t for t in range(p)})  # the prompt sits at the start of its packed row
        for t, src in image.items():
            # the layout indexes Megatron's sequence-first activations: packed (g, u) is u·G + g there
            visible = _visible(packed.layout, src % width * rows + g)
            assert visible == {image[u] % width * rows + g for u in range(t + 1)}, (row, t)
        scored = packed.source[row] >= 0
        assert scored.sum() == n and (batch["loss_mask"][row].bool() == scored).all()
    real = sorted(packed.layout.destination.tolist())
    assert len(real) == len(set(real)) == int(prompts[0] + responses[:3].sum() + prompts[3] + responses[3:].sum())


def _log_probs(rank: int, checkpoint: str, batch: dict, packing: str) -> dict | None:
    from mindrl.checkpoint import megatron as mg

    args = mg.load_args(checkpoint)
    worker = MegatronWorker(mg.arch_of(args), mg.parallel_of(args), weights=checkpoint, temperature=TEMPERATURE,
                            micro_batch_size=4, prompt_packing=packing)
    return worker.compute_log_prob(batch, with_entropy=True)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_packed_log_probs_and_entropy_equal_hf_scoring_each_row(tmp_path, tp, pp):
    """Micro-batches of 4 rows cut the second prompt's group in two: groups need not align with them."""
    model = build_hf_model("qwen2", seed=7)
    checkpoint = hf_to_mcore(save_hf_model(model, tmp_path / "hf"), tmp_path / "mg", "qwen2", tp, pp,
                             params_dtype=torch.float32, progress=False)
    batch = grouped_batch(250)
    with torch.no_grad():
        log_softmax = torch.log_softmax(model(batch["tokens"]).logits / TEMPERATURE, dim=-1)
    expected = torch.zeros(batch["tokens"].shape)
    expected[:, :-1] = log_softmax[:, :-1].gather(-1, batch["tokens"][:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    mask = batch["loss_mask"].bool()
    out = [r for r in run_ranks(_log_probs, 2, str(checkpoint), batch, "on") if r is not None][-1]
    assert (out["log_probs"] - expected)[mask].abs().max().item() < 1e-5
    assert (out["entropy"] - entropy)[mask].abs().max().item() < 1e-5
    assert (out["log_probs"][~mask] == 0).all()  # only response tokens are scored from packed rows


def _cut_differently(rank: int, batch: dict) -> list[torch.Tensor]:
    arch = load_model_arch("tiny_qwen")
    worker = MegatronWorker(arch, ParallelConfig(1, 1), weights=sharding.random_full_state_dict(arch, seed=5),
                            prompt_packing="on")
    out = []
    for micro_batch in (3, 6):
        worker.micro_batch_size = micro_batch
        out.append(worker.compute_log_prob(batch)["log_probs"])
    return out


def test_a_rows_packed_scores_do_not_depend_on_which_rows_share_its_micro_batch():
    """A reference and an actor cutting one batch into different micro-batches must agree to the bit
    (the first GRPO step's KL is then exactly 0); the attention kernel's reductions follow the padded
    segment lengths, so the layout pads them to the whole batch's longest."""
    batch = grouped_batch(1000, prompts=(20, 35), responses=((14, 27, 9), (13, 26, 22)))  # 5 and 8 tokens agree
    by_three, by_six = run_ranks(_cut_differently, 1, batch)[0]
    mask = batch["loss_mask"].bool()
    assert torch.equal(by_three[mask], by_six[mask])


def _updates(rank: int, par: ParallelConfig, micro: int) -> dict:
    arch = load_model_arch("tiny_qwen")
    full = sharding.random_full_state_dict(arch, seed=4)
    batch = grouped_batch(arch.padded_vocab_size)
    gen = torch.Generator().manual_seed(9)
    rows, width = batch["tokens"].shape
    batch["old_log_probs"] = torch.full((rows, width), -6.9) + 0.3 * torch.randn(rows, width, generator=gen)
    batch["ref_log_probs"] = torch.full((rows, width), -6.95)
    batch["advantages"] = torch.randn(rows, 1, generator=gen).expand(rows, width) * batch["loss_mask"]
    out = {}
    for packing in ("off", "on"):
        release_model_parallel()
        cfg = dataclasses.replace(BASE, mini_batch_size=rows, micro_batch_size=micro, prompt_packing=packing)
        worker = ActorWorker(arch, par, cfg, weights=full)
        out[packing] = {"metrics": worker.update(batch), "grads": reduced_grads(worker)}
    return out


@pytest.mark.parametrize("par, micro", [(ParallelConfig(2, 1), 3), (ParallelConfig(1, 2), 3),
                                        (ParallelConfig(1, 1), 3)])
def test_packed_updates_have_the_plain_rows_gradients_and_metrics(par, micro):
    """PP=2 needs one packed shape for all micro-batches; DP=2 gives each rank one prompt's samples."""
    for result in run_ranks(_updates, 2, par, micro):
        plain, packed = result["off"], result["on"]
        assert max(g.abs().max().item() for g in plain["grads"].values()) > 1e-3
        for key, grad in plain["grads"].items():
            assert (packed["grads"][key] - grad).abs().max().item() < 1e-6, key
        assert packed["metrics"].keys() == plain["metrics"].keys()
        assert (plain["metrics"].pop("prompt_packed"), packed["metrics"].pop("prompt_packed")) == (0.0, 1.0)
        for key, value in plain["metrics"].items():
            assert packed["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def _shared_prompt_rows(prompts: int, n: int, prompt: int, response: int) -> dict:
    tokens = torch.randint(1, 100, (prompts * n, prompt + response), generator=torch.Generator().manual_seed(0))
    tokens[:, :prompt] = tokens[::n, :prompt].repeat_interleave(n, dim=0)
    return {"tokens": tokens, "prompt_lengths": torch.full((prompts * n,), prompt),
            "response_lengths": torch.full((prompts * n,), response)}


def test_auto_packs_where_samples_share_a_prompt_and_not_where_each_prompt_has_one_sample():
    tiny, big = load_model_arch("tiny_qwen"), load_model_arch("qwen25_7b")
    for arch, n, prompt, response in ((tiny, 8, 142, 64), (big, 8, 200, 600), (big, 4, 1000, 64)):
        rows = _shared_prompt_rows(2, n, prompt, response)
        packed = pack(rows["tokens"], rows["prompt_lengths"], rows["response_lengths"])
        assert packed.tokens.shape == (2, prompt + n * response)
        assert packing_pays(arch, tuple(rows["tokens"].shape), [packed])
    single = _shared_prompt_rows(16, 1, 200, 100)  # GRPO with n = 1: nothing to share
    packed = pack(single["tokens"], single["prompt_lengths"], single["response_lengths"])
    assert not packing_pays(big, tuple(single["tokens"].shape), [packed])
