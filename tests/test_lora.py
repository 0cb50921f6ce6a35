"""LoRA on the Megatron actor: the adapters' gradients against HF PEFT's on the same A and B (TP=2, PP=2, DP=2,
sequence parallelism, prompts packed), the base frozen and out of the optimizer, B = 0 starting as the base bit for
bit, share_backbone's reference equal to the frozen base, and adapters-only checkpoints that resume exactly and
refuse another base."""

import pytest
import torch
import transformers

from mindrl.algorithms.policy_loss import LossConfig
from mindrl.algorithms.value_loss import ValueLossConfig
from mindrl.config import ConfigError, ParallelConfig, load_model_arch
from mindrl.config.lora import TARGETS, LoraConfig
from mindrl.distributed import release_model_parallel
from mindrl.launch import run_ranks
from mindrl.models import hf_mapping as hfm
from mindrl.models import lora, sharding
from mindrl.workers.critic_worker import CriticWorker
from mindrl.workers.megatron_worker import ActorConfig, ActorWorker, BackboneReference, MegatronWorker
from tests.grads import reduced_grads
from tests.hf_models import mcore_to_hf_state

R, ALPHA, ROWS, SEQ = 4, 8.0, 4, 16
#: (prompt length, response length) per row; rows 0-1 and 2-3 share a prompt, so they pack behind one copy
SHAPES = [(5, 9), (5, 6), (7, 8), (7, 4)]
LAYOUTS = [(ParallelConfig(2, 1), "on"), (ParallelConfig(1, 2), "on"), (ParallelConfig(1, 1), "on"),
           (ParallelConfig(2, 1, sequence_parallel=True), "off"), (ParallelConfig(1, 1), "off")]
LORA = LoraConfig(TARGETS, R, ALPHA)


def _batch(vocab: int) -> dict:
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (ROWS, SEQ), generator=gen)
    tokens[1, :5], tokens[3, :7] = tokens[0, :5], tokens[2, :7]
    mask = torch.zeros(ROWS, SEQ)
    for row, (prompt, response) in enumerate(SHAPES):
        mask[row, prompt - 1:prompt + response - 1] = 1
    advantages = torch.randn(ROWS, 1, generator=gen).expand(ROWS, SEQ) * mask
    return {"tokens": tokens, "loss_mask": mask, "advantages": advantages.contiguous(),
            "prompt_lengths": torch.tensor([s[0] for s in SHAPES]),
            "response_lengths": torch.tensor([s[1] for s in SHAPES])}


def _adapter_values(arch, seed: int = 9, r: int = R) -> dict[str, torch.Tensor]:
    """Whole A and B of every targeted layer, B non-zero so that every gradient is."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sharding.full_param_shapes(arch).items():
        prefix = name.removesuffix(".weight")
        if name.startswith("decoder.") and prefix.rsplit(".", 1)[-1] in TARGETS:
            out[f"{prefix}.{lora.A_NAME}"] = 0.1 * torch.randn(r, shape[1], generator=gen)
            out[f"{prefix}.{lora.B_NAME}"] = 0.05 * torch.randn(shape[0], r, generator=gen)
    return out


def _full_names(worker: ActorWorker) -> dict[str, str]:
    local = sharding.stage_names(worker.arch, worker.par, worker.pp_rank, worker.ep_rank)
    return {name: full for full, name in local.items()}


def _adapter_names(worker: ActorWorker) -> dict[str, str]:
    """Each adapter parameter's local name → its full name (layer and expert numbers of the whole model)."""
    full, out = _full_names(worker), {}
    for name, _ in worker.model.named_parameters():
        if lora.is_adapter(name):
            module, _, half = name.rpartition(f".{lora.ADAPTER}.")
            out[name] = full[f"{module}.weight"].removesuffix(".weight") + f".{lora.ADAPTER}.{half}"
    return out


def _set_adapters(worker: ActorWorker, values: dict[str, torch.Tensor]) -> None:
    names, params = _adapter_names(worker), dict(worker.model.named_parameters())
    with torch.no_grad():
        for name, whole in names.items():
            cut = lora.split_adapter(whole, values[whole], worker.par.tp, worker.arch.swiglu)
            params[name].copy_(cut[worker.tp_rank])


def _joined(layout: list[dict], par: ParallelConfig) -> dict[str, torch.Tensor]:
    """The adapters' gradients of one layout under full names, TP slices joined; the ranks' runs in rank order, so
    the first of each TP rank is data-parallel rank 0's (every replica holds the same reduced values), and at EP > 1
    each expert-parallel rank brings its own experts'."""
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for run in layout:
        for name, grad in run["grads"].items():
            shards.setdefault(run["full"][name], {}).setdefault(run["tp"], grad)
    return {name: lora.merge_adapter_shards(name, [held[t] for t in range(par.tp)], True)
            for name, held in shards.items()}


def _after_update(actor: ActorWorker, arch, par: ParallelConfig, batch: dict, root: str) -> dict:
    """On the TP=2 actor after its update: offload and onload, a checkpoint a new run starts from, a LoRA critic."""
    out = {}
    params = {name: p.detach().clone() for name, p in actor.model.named_parameters()}
    copied = actor.offloader.copied_bytes
    actor.offload()
    actor.onload()
    first = actor.offloader.copied_bytes - copied
    actor.offload()
    actor.onload()
    second = actor.offloader.copied_bytes - copied - first
    trained = sum(p.numel() * p.element_size() for p in actor.model.parameters() if p.requires_grad)
    base = sum(p.numel() * p.element_size() for p in actor.model.parameters() if not p.requires_grad)
    # the base is copied to the host once; later offloads move the adapters and their optimizer state only
    out["offload"] = (all(torch.equal(p, params[n]) for n, p in actor.model.named_parameters()),
                      first >= base + trained, second < base, second >= trained)
    actor.save_checkpoint(root, 1, {"initial_weights": None})
    mine = actor.compute_log_prob(batch)
    started = MegatronWorker(arch, par, root).compute_log_prob(batch)  # a new run from it: the merged weights
    out["start_diff"] = 0.0 if mine is None else (mine["log_probs"] - started["log_probs"]).abs().max().item()
    release_model_parallel()
    cfg = ActorConfig(lr=1e-3, mini_batch_size=ROWS, micro_batch_size=2,
                      lora=LoraConfig(TARGETS, R, ALPHA, ckpt_filter=True))
    critic = CriticWorker(arch, par, cfg, ValueLossConfig(), weights=None)
    out["critic_trained"] = sorted({name.rsplit(".", 1)[-1] if lora.is_adapter(name) else name
                                    for name, p in critic.model.named_parameters() if p.requires_grad})
    # an adapters-only critic checkpoint keeps its trained value head and resumes on the same base
    with torch.no_grad():
        for p in critic.model.parameters():
            if p.requires_grad:
                p.add_(0.01)
    trained = {name: p.detach().clone() for name, p in critic.model.named_parameters() if p.requires_grad}
    critic.save_checkpoint(f"{root}_critic", 1, {})
    again = CriticWorker(arch, par, cfg, ValueLossConfig(), weights=None)
    again.load_checkpoint(f"{root}_critic", load_optim=False, load_rng=False)
    out["critic_resumed"] = all(torch.equal(p, trained[n]) for n, p in again.model.named_parameters()
                                if p.requires_grad)
    return out


def _layouts(rank: int, full: dict, adapters: dict, root: str) -> dict:
    arch = load_model_arch("tiny_qwen")
    batch = _batch(arch.padded_vocab_size)
    out = {"layouts": []}
    for index, (par, packing) in enumerate(LAYOUTS):
        release_model_parallel()
        cfg = ActorConfig(lr=1e-2, mini_batch_size=ROWS, micro_batch_size=2, clip_grad=1e9, prompt_packing=packing,
                          lora=LORA, loss=LossConfig(use_kl_loss=False, entropy_coeff=0.0))
        actor = ActorWorker(arch, par, cfg, weights=full)
        if index == 0:  # TP=2: B = 0 is the base, bit for bit; share_backbone's reference stays it
            base = MegatronWorker(arch, par, full, prompt_packing=packing).compute_log_prob(batch)
            out["zero_b_equal"] = base is None or torch.equal(actor.compute_log_prob(batch)["log_probs"],
                                                              base["log_probs"])
        _set_adapters(actor, adapters)
        if index == 0:
            reference = BackboneReference(actor, 2).compute_log_prob(batch)
            adapted = actor.compute_log_prob(batch)
            out["backbone_equal"] = base is None or torch.equal(reference["log_probs"], base["log_probs"])
            out["adapted_differs"] = base is None or not torch.equal(adapted["log_probs"], base["log_probs"])
            out["trained"] = sorted(name for name, p in actor.model.named_parameters() if p.requires_grad)
            out["optimized"] = sum(len(g["params"]) for g in actor.optimizer.param_groups)
            before = {name: p.detach().clone() for name, p in actor.model.named_parameters()}
        metrics = actor.update(batch)
        out["layouts"].append({"tp": actor.tp_rank, "pp": actor.pp_rank, "dp": actor.dp_rank, "metrics": metrics,
                               "grads": reduced_grads(actor), "full": _adapter_names(actor)})
        if index == 0:
            after = dict(actor.model.named_parameters())
            out["moved"] = sorted(name for name, p in before.items() if not torch.equal(p, after[name]))
            out.update(_after_update(actor, arch, par, batch, root))
    return out


def _peft_oracle(arch, full: dict, adapters: dict) -> tuple[dict[str, torch.Tensor], float]:
    """HF's Qwen2 under PEFT with the same A and B: the gradients of the token-mean policy-gradient loss at ratio 1
    (−Σ A·log π / tokens), under Megatron's full adapter names, and the surrogate's value there."""
    peft = pytest.importorskip("peft")
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**hfm.hf_config_from_arch(arch, "qwen2",
                                                                                            torch.float32)))
    model.load_state_dict(mcore_to_hf_state(full, arch), strict=False)
    hf_targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=hf_targets,
                                                       lora_dropout=0.0))
    model = model.double()  # the oracle in fp64: what is left is the fp32 actor's rounding
    params = dict(model.named_parameters())
    back = {}  # PEFT's parameter → (Megatron name, how its gradient adds up)
    for layer in range(arch.num_layers):
        prefix = hfm.mcore_layer_prefix(layer)
        for name, value in adapters.items():
            if not name.startswith(prefix):
                continue
            for hf_name, part in hfm.lora_to_hf_layer({name[len(prefix):]: value}, arch).items():
                param = params[f"base_model.model.{hfm.hf_layer_prefix(layer)}"
                               f"{hf_name.removesuffix('.weight')}.default.weight"]
                with torch.no_grad():
                    param.copy_(part.double())
                back.setdefault(name, []).append(param)
    batch = _batch(arch.padded_vocab_size)
    logits = model(batch["tokens"]).logits[:, :-1]
    log_probs = torch.log_softmax(logits, -1).gather(-1, batch["tokens"][:, 1:, None])[..., 0]
    mask, adv = batch["loss_mask"][:, :-1].double(), batch["advantages"][:, :-1].double()
    loss = -(adv * log_probs * mask).sum() / mask.sum()
    loss.backward()
    pg_loss = -(adv * mask).sum() / mask.sum()  # the clipped surrogate's value at ratio 1
    grads = {}
    for name, parts in back.items():
        if name.endswith("lora_A"):  # one A serves every part of a fused layer: its gradient is their sum
            grads[name] = sum(p.grad for p in parts).float()
        else:  # B's rows are the parts' B's, laid out as the fused weight's rows
            module = name.rpartition(f".{lora.ADAPTER}.")[0].rsplit(".", 1)[-1]
            stacked = [p.grad for p in parts]
            grads[name] = (hfm._fuse_qkv(*stacked, arch) if module == "linear_qkv" else torch.cat(stacked)).float()
    return grads, pg_loss.item()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    arch = load_model_arch("tiny_qwen")
    full = sharding.random_full_state_dict(arch, seed=6)
    adapters = _adapter_values(arch)
    return arch, full, adapters, run_ranks(_layouts, 2, full, adapters, str(tmp_path_factory.mktemp("lora_ckpt")))


def test_adapter_gradients_equal_hf_peft_at_tp2_pp2_dp2_sequence_parallel_and_packed(runs):
    arch, full, adapters, ranks = runs
    expected, loss = _peft_oracle(arch, full, adapters)
    assert len(expected) == 2 * len(TARGETS) * arch.num_layers
    largest = max(g.abs().max().item() for g in expected.values())
    assert largest > 1e-3
    for index, (par, packing) in enumerate(LAYOUTS):
        where = f"TP={par.tp}{' SP' if par.sequence_parallel else ''} PP={par.pp} packing {packing}"
        layout = [rank["layouts"][index] for rank in ranks]
        assert all(run["metrics"]["prompt_packed"] == float(packing == "on") for run in layout), where
        got = _joined(layout, par)
        assert got.keys() == expected.keys(), where
        for name, grad in expected.items():
            diff = (got[name] - grad).abs().max().item()
            assert diff <= 1e-5 * largest, f"{where}: gradient of {name} differs from PEFT's by {diff:.2e}"
        for run in layout:
            assert run["metrics"]["pg_loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6), where


def test_b_zero_starts_as_the_base_and_share_backbone_scores_as_the_frozen_base(runs):
    *_, ranks = runs
    for rank in ranks:
        assert (rank["zero_b_equal"], rank["backbone_equal"], rank["adapted_differs"]) == (True, True, True)


def test_only_the_adapters_train(runs):
    *_, ranks = runs
    for rank in ranks:
        assert rank["trained"] and all(lora.is_adapter(name) for name in rank["trained"])
        # megatron-core's optimizer holds the trained parameters only (its groups split them by weight decay)
        assert rank["optimized"] == len(rank["trained"])
        assert rank["moved"] == rank["trained"]  # an update moves every adapter and nothing else


def test_offload_moves_the_base_once_and_brings_everything_back(runs):
    *_, ranks = runs
    for rank in ranks:
        assert rank["offload"] == (True, True, True, True)


def test_a_run_started_from_a_lora_checkpoint_gets_the_merged_weights(runs):
    *_, ranks = runs
    for rank in ranks:
        assert rank["start_diff"] <= 1e-5


def test_a_lora_critic_trains_its_adapters_and_its_new_value_head_and_resumes_them(runs):
    *_, ranks = runs
    for rank in ranks:
        assert rank["critic_trained"] == ["lora_A", "lora_B", "rm_head.weight"]
        assert rank["critic_resumed"]


@pytest.mark.parametrize("settings, message", [
    (dict(target_modules=("q_proj",)), "HF's q_proj is linear_qkv here"),
    (dict(target_modules=("linear_qkv",), r=0), "lora_r must be a positive integer"),
    (dict(target_modules=("linear_qkv",), alpha=0.0), "lora_alpha must be positive"),
    (dict(ckpt_filter=True), "no adapters to keep"),
    (dict(target_modules=("linear_qkv", "linear_qkv")), "lists a module twice"),
])
def test_bad_lora_settings_are_one_sentence(settings, message):
    with pytest.raises(ConfigError, match=message):
        LoraConfig(**settings).check("actor_config")


def test_the_base_digest_leaves_the_weights_offloadable():
    """An adapters-only save digests the frozen base; the next rollout's offload_train_param then frees the base by
    resizing its storages, which a numpy view of them would have made impossible for good."""
    from mindrl.platform import get_platform
    from mindrl.workers.offload import StorageOffloader

    model = torch.nn.Linear(8, 4)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    digest = lora.base_digest(model)
    assert digest == lora.base_digest(model)
    offloader = StorageOffloader(get_platform())
    assert offloader.offload(model.parameters(), frozen=True) == (8 * 4 + 4) * 4
    assert offloader.onload() == (8 * 4 + 4) * 4
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
