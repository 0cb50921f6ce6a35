"""Megatron policy workers: the reference (forward only) and the actor (log-probs, RL updates, SFT steps).

They run inside a rank whose process group is up (mindrl.distributed); the Ray actor that
hosts them is a thin shell. A batch is a dict of host tensors over the *whole* batch:
  tokens [B, S]         prompt + response ids, right-padded
  loss_mask [B, S]      1 where position t's logits score a response token (tokens[t + 1])
  old_log_probs, advantages, ref_log_probs [B, S]   (for updates)
  prompt_lengths, response_lengths [B]   (optional: rows that share a prompt are then packed behind
                        one copy of it where that costs fewer FLOPs, mindrl/models/prompt_packing.py)
  pixel_values [B, P, D], image_grid_thw [B, I, 3]   (a vision-language model's: each row's images, zero-padded
                        (mindrl.models.vision.rows_of_images); each micro-batch takes its rows' images and the
                        multimodal positions they make)
Each data-parallel rank takes its contiguous share of the rows, or with `Batching.balance` a share of equal
cost. Each pass cuts them into micro-batches of right-padded rows, or (`Batching.remove_padding`) of padding-free
packed sequences cut by a row count or a token budget (mindrl/models/micro_batches.py); the loss reads the plain
rows either way. Results (log-probs, entropy) come back on the last pipeline stage for that rank's rows; other
stages get None.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from mindrl.algorithms.dpo_loss import DPOLossConfig, chosen_nll, pair_losses, sequence_log_probs
from mindrl.algorithms.policy_loss import LossConfig, actor_loss
from mindrl.algorithms.rollout_is import mismatch_shares
from mindrl.algorithms.sft_loss import sft_loss
from mindrl.checkpoint import dist as dist_ckpt
from mindrl.checkpoint import files, training
from mindrl.checkpoint import megatron as mg
from mindrl.config import ConfigError, ModelArch, ParallelConfig
from mindrl.config.batching import Batching
from mindrl.config.lora import LoraConfig
from mindrl.config.recompute import Recompute
from mindrl.distributed import init_model_parallel
from mindrl.models import context_parallel, lora, sharding
from mindrl.models.flops import forward_flops
from mindrl.models.forward import run_microbatches
from mindrl.models.gpt import build_gpt_model, load_stage_weights
from mindrl.models.micro_batches import balanced_shares, cut, pack_rows
from mindrl.models.moe import ExpertLoad
from mindrl.models.optimizer import wrap_for_training, zero_grads
from mindrl.models.prompt_packing import pack, packed_width, packing_pays, prompt_groups
from mindrl.models.vision import flat_images, mrope_positions
from mindrl.platform import get_platform
from mindrl.workers.logprob import (
    gathered_log_probs,
    shifted_labels,
    vocab_parallel_entropy,
    vocab_parallel_log_probs,
)
from mindrl.workers.offload import StorageOffloader, storage_keys, storage_ptrs


@dataclass(frozen=True)
class ActorConfig:
    """Optimiser and update-loop keys (MindSpeed-RL names; batch sizes count samples)."""

    lr: float = 1e-6
    min_lr: float = 0.0
    lr_decay_style: str = "constant"
    lr_warmup_fraction: float = 0.0
    #: the schedule's length in iterations (train steps; an iteration is one `update` call)
    lr_decay_iters: int = 1000
    #: optimizer steps per iteration (epochs × mini-batches per batch): the schedule moves 1/this of an
    #: iteration with each, so it reads the same in iterations however the batch is cut
    steps_per_iteration: int = 1
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    mini_batch_size: int = 8
    micro_batch_size: int = 2
    epochs: int = 1
    shuffle_mini_batch: bool = False
    temperature: float = 1.0
    seed: int = 1234
    #: auto | on | off: pack a prompt's samples behind one copy of it (auto: when that costs fewer FLOPs)
    prompt_packing: str = "auto"
    #: how updates cut their rows: padding-free packing and a token budget (the worker's log-prob passes start with
    #: it too; a trainer gives them their own)
    batching: Batching = field(default_factory=Batching)
    #: what the backward recomputes instead of keeping from the forward (mindrl/models/recompute.py)
    recompute: Recompute = field(default_factory=Recompute)
    #: a vision-language model's tower (merger included) takes no gradient and no optimizer state
    freeze_vision_tower: bool = False
    #: on resume, this config's LR / weight-decay schedule replaces the checkpoint's from the checkpoint's step on
    #: (Megatron's override_opt_param_scheduler); by default the checkpoint's goes on, with a warning where it differs
    override_opt_param_scheduler: bool = False
    #: on resume, the checkpoint's schedule goes on without that warning (Megatron's use_checkpoint_opt_param_scheduler)
    use_checkpoint_opt_param_scheduler: bool = False
    #: the format checkpoints are saved in: torch (Megatron's per-rank files) or torch_dist (megatron-core's
    #: distributed checkpoint, which resumes at another layout); a load reads the format it finds
    ckpt_format: str = "torch"
    #: torch_dist saves are written while training goes on, published once every rank's writes are done
    async_save: bool = False
    #: the optimizer state lives in host memory, on the device only for the optimizer step and a checkpoint's save
    #: or load (MindSpeed's swap_optimizer, moved whole rather than in overlapped pieces)
    swap_optimizer: bool = False
    #: adapters on the linear layers (mindrl/models/lora.py); the base weights then take no gradient or optimizer state
    lora: LoraConfig = field(default_factory=LoraConfig)
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        for key in ("mini_batch_size", "micro_batch_size", "epochs", "lr_decay_iters", "steps_per_iteration"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{key} must be a positive integer, got {value!r}.")
        if self.lr_decay_style not in ("constant", "cosine", "linear"):
            raise ConfigError(f"lr_decay_style must be constant, cosine or linear, got {self.lr_decay_style!r}.")
        if not 0.0 <= self.lr_warmup_fraction < 1.0:
            raise ConfigError(f"lr_warmup_fraction must be in [0, 1), got {self.lr_warmup_fraction}.")
        if self.mini_batch_size % self.micro_batch_size:
            raise ConfigError(f"mini_batch_size={self.mini_batch_size} is not a multiple of "
                              f"micro_batch_size={self.micro_batch_size}.")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be positive, got {self.temperature}.")
        check_prompt_packing(self.prompt_packing)
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError("override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are both true, but "
                              "a resume takes either the config's LR schedule or the checkpoint's; set one of them "
                              "to false.")
        self.lora.check("actor")
        files.check_ckpt_format(self.ckpt_format, self.async_save, "actor", self.swap_optimizer)


PROMPT_PACKING = ("auto", "on", "off")


def check_prompt_packing(value: str) -> None:
    if value not in PROMPT_PACKING:
        raise ConfigError(f"prompt_packing must be one of {', '.join(PROMPT_PACKING)}, got {value!r}.")


def _schedule(warmup: float, decay: float, lr: float, min_lr: float, style: str, wd: float) -> tuple:
    """What sets the rates of an OptimizerParamScheduler (mindrl's weight decay is constant; a constant
    schedule never reaches its min_lr)."""
    return (warmup, decay, lr, None if style == "constant" else min_lr, style, wd)


def _schedule_text(warmup: float, decay: float, lr: float, min_lr: float | None, style: str, wd: float) -> str:
    rate = f"lr {lr:g} constant" if min_lr is None else f"lr {lr:g} to {min_lr:g} {style}"
    return f"{decay:g} optimizer steps, {warmup:g} of warm-up, {rate}, weight decay {wd:g}"


#: the key under which each micro-batch's share of the mini-batch's loss joins the loss's metric shares: summed
#: over micro-batches and data-parallel ranks it is the loss the optimizer step would follow
_LOSS = "_loss"

#: (log-probs of the labels, their entropies if asked for, micro-batch, whole-batch normalisers)
#: → (loss share, metric shares)
LossOf = Callable[[torch.Tensor, torch.Tensor | None, dict, dict[str, float]], tuple[torch.Tensor, dict[str, float]]]


def _sft_loss(log_probs: torch.Tensor, entropy: torch.Tensor | None, mb: dict,
              normalisers: dict[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
    return sft_loss(log_probs, mb["loss_mask"], normalisers["num_tokens"])


def _dpo_loss(cfg: DPOLossConfig, chosen_tokens: float) -> LossOf:
    """The DPO loss of a micro-batch whose rows are pairs (chosen, rejected), as a share of the mini-batch's
    mean over pairs, plus `rpo_alpha` times its share of the chosen responses' NLL (`chosen_tokens`: the
    mini-batch's chosen response tokens); the metrics are TRL's, as shares of their means."""

    def loss_of(log_probs: torch.Tensor, entropy: torch.Tensor | None, mb: dict,
                normalisers: dict[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mb["loss_mask"]
        losses, per_pair = pair_losses(cfg, sequence_log_probs(cfg, log_probs, mask),
                                       sequence_log_probs(cfg, mb["ref_log_probs"], mask))
        pairs = normalisers["num_seqs"] / 2
        loss = losses.sum() / pairs
        metrics = {key: value.sum().item() / pairs for key, value in per_pair.items()}
        if cfg.rpo_alpha:
            nll = chosen_nll(log_probs, mask, chosen_tokens)
            loss = loss + cfg.rpo_alpha * nll
            metrics["nll_loss"] = nll.item()
        return loss, metrics

    return loss_of


class MegatronWorker:
    """A frozen model of one role (the reference): weights in, log-probs out.

    Several workers may share a process (the reference colocated with the actor) if they
    share its TP×PP layout; they then share Megatron's process groups.
    """

    def __init__(self, arch: ModelArch, par: ParallelConfig, weights: str | dict | None = None,
                 params_dtype: torch.dtype = torch.float32, temperature: float = 1.0,
                 micro_batch_size: int = 2, seed: int = 1234, prompt_packing: str = "auto",
                 batching: Batching | None = None, recompute: Recompute | None = None) -> None:
        check_prompt_packing(prompt_packing)
        self.arch, self.par, self.temperature, self.micro_batch_size = arch, par, temperature, micro_batch_size
        self.prompt_packing = prompt_packing
        #: how the forward passes (log-probs, values, scores) cut their rows
        self.batching = batching or Batching()
        self.packed = False  # whether the last pass packed its rows (auto decides per pass)
        self.vocab_size = arch.padded_vocab_size  # the model's own vocabulary; TP padding beyond it is masked
        self.platform = get_platform()
        init_model_parallel(par, seed=seed, arch=arch)
        self.model = build_gpt_model(arch, par, params_dtype, recompute=recompute)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.ep_rank = parallel_state.get_expert_model_parallel_rank() if par.ep > 1 else 0
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        if isinstance(weights, str):
            weights = self._stage_weights(weights)
        elif isinstance(weights, dict):
            weights = sharding.shard_state_dict(weights, arch, par, self.tp_rank, self.pp_rank, self.ep_rank)
        if weights is not None:
            load_stage_weights(self.model, weights)
        if self.frozen:
            # megatron-core runs a frozen weight's layers through their own function (linear_with_frozen_weight),
            # which can round a packed batch's last bit differently: a reference scores as a LoRA actor's frozen
            # base does (share_backbone), bit for bit
            self.model.requires_grad_(False)
        self.offloader = StorageOffloader(self.platform)

    def _stage_weights(self, root: str) -> dict[str, torch.Tensor]:
        """This rank's stage of the Megatron checkpoint at `root`, checked against the model."""
        return start_weights(dist_ckpt.stage_start(self.model, root, self.tp_rank, self.pp_rank, self.arch, self.par,
                                              self.ep_rank), root)

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> int:
        """Free the chosen training state from the device (`offload_train_*`); returns bytes freed. Gradients
        are dropped, not copied: the next update zeroes them before reading them. Weights that never change (a
        frozen model's, the reference's; a LoRA actor's base) are copied to the host once; later offloads reuse that
        copy."""
        model_params = list(self.model.parameters())
        keep = set() if params else storage_ptrs(model_params)
        freed = 0
        if params:
            trained = [p for p in model_params if p.requires_grad and not self.frozen]
            freed += self.offloader.offload([p for p in model_params if not p.requires_grad or self.frozen],
                                            frozen=True)
            freed += self.offloader.offload(trained)
        if grads:
            freed += self.offloader.offload([p.main_grad for p in model_params if hasattr(p, "main_grad")], keep,
                                            discard=True)
        if optimizer:
            freed += self.offloader.offload(self._optimizer_tensors(), keep)
        self.platform.empty_cache()
        return freed

    def onload(self) -> int:
        """Bring back everything offload freed (gradients as zeros); returns bytes restored."""
        return self.offloader.onload()

    @property
    def frozen(self) -> bool:
        """Whether the weights never change after loading (only the actor trains)."""
        return True

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        return []

    def local_rows(self, batch_size: int) -> slice:
        """The contiguous rows of the global batch this data-parallel rank works on."""
        if batch_size % self.dp_size:
            raise ConfigError(f"batch of {batch_size} rows does not split over {self.dp_size} data-parallel ranks; "
                              f"make the number of rows a multiple of {self.dp_size}.")
        share = batch_size // self.dp_size
        return slice(self.dp_rank * share, (self.dp_rank + 1) * share)

    def rows_for(self, batch: dict, batching: Batching) -> torch.Tensor:
        """The rows of the batch this data-parallel rank works on in a pass cut as `batching` says: its contiguous
        share, or (`balance`) a share of about the same cost as every other rank's."""
        share = self.local_rows(batch["tokens"].shape[0])
        if not batching.balance or self.dp_size == 1:
            return torch.arange(share.start, share.stop)
        return self.balanced(batch, torch.arange(batch["tokens"].shape[0]))

    def balanced(self, batch: dict, rows: torch.Tensor) -> torch.Tensor:
        """This data-parallel rank's part of `rows`, every rank's of about the same forward FLOPs (its tokens through
        the weights and its causal attention pairs), a prompt's samples kept together where the groups allow."""
        lengths = real_lengths(batch)[rows].tolist()
        costs = [forward_flops(self.arch, n, n * (n + 1) / 2) for n in lengths]
        units = [range(row, row + 1) for row in range(len(lengths))]
        if {"prompt_lengths", "response_lengths"} <= batch.keys():
            units = prompt_groups(batch["tokens"][rows], batch["prompt_lengths"][rows])
        return rows[balanced_shares(costs, units, self.dp_size)[self.dp_rank]]

    def _micro_batches(self, batch: dict, rows: torch.Tensor | slice, size: int,
                       batching: Batching | None = None) -> list[dict]:
        """This pass's micro-batches of `rows`, cut as `batching` says (the worker's forward batching by default):
        padding-free packed sequences (mindrl/models/micro_batches.py), or right-padded rows (`_padded`). Every
        per-token tensor the loss reads stays in the plain rows' [rows, S] layout."""
        batching = self.batching if batching is None else batching
        selected = {k: v[rows] for k, v in batch.items() if torch.is_tensor(v)}
        if "pixel_values" in selected and self.arch.vision is None:
            raise ConfigError(f"the batch holds images but model {self.arch.name} has no vision tower to see them; "
                              f"give this role a vision-language model or use text-only data.")
        self.packed = False
        if self.par.cp > 1 and not batching.remove_padding:
            raise ConfigError(f"context_parallel_size={self.par.cp} cuts padding-free packed sequences over its "
                              f"ranks; set use_remove_padding: true (in rl_config, sft_config or dpo_config).")
        out = self._packed(selected, size, batching) if batching.remove_padding else \
            self._padded(selected, size, (int(batch["prompt_lengths"].max()), int(batch["response_lengths"].max()))
                         if "prompt_lengths" in batch and "response_lengths" in batch else None)
        for mb in out:
            real = mb.pop("real_lengths")
            if self.arch.is_moe:  # the routers' load-balancing and z-losses count the real tokens only
                mb["padding_mask"] = torch.arange(mb["tokens"].shape[1]) >= real.unsqueeze(1)
        device = self.platform.device()
        return [{k: v.to(device) for k, v in mb.items()} for mb in out]

    def _packed(self, selected: dict[str, torch.Tensor], size: int, batching: Batching) -> list[dict]:
        """Each micro-batch's rows as one padding-free sequence, a prompt's samples behind one copy of it (unless
        `prompt_packing: off`); under PP every sequence of the pass takes the longest one's length (the pipeline
        exchanges one shape), under sequence parallelism a multiple of TP."""
        if self.arch.vision is not None:
            raise ConfigError(f"use_remove_padding packs text rows, but model {self.arch.name} is a vision-language "
                              f"model whose multimodal positions are per padded row; set use_remove_padding: false.")
        tokens = selected["tokens"]
        lengths = real_lengths(selected)
        # replayed routes are each sample's own, its prompt's included
        share = self.prompt_packing != "off" and {"prompt_lengths", "response_lengths"} <= selected.keys() \
            and "routes" not in selected
        groups = prompt_groups(tokens, selected["prompt_lengths"]) if share else \
            [range(row, row + 1) for row in range(tokens.shape[0])]
        cuts = cut(lengths.tolist(), selected["prompt_lengths"].tolist() if share else None, groups, size, batching)
        if batching.max_tokens is not None:
            cuts += [None] * self._missing_micro_batches(len(cuts))
        multiple = self.par.tp if self.model.config.sequence_parallel else 1
        width = 1
        # under PP: again, at the longest one's length (under CP each rank's share of it)
        for _ in range(2 if self.par.pp > 1 else 1):
            out = [self._packed_one(selected, lengths, share, rows, width, multiple) for rows in cuts]
            width = max(mb["tokens"].shape[1] for mb in out)
        return out

    def _packed_one(self, selected: dict[str, torch.Tensor], lengths: torch.Tensor, share: bool, rows: range | None,
                    width: int, multiple: int) -> dict[str, torch.Tensor]:
        """One packed micro-batch of `rows`; None: a stand-in that keeps this data-parallel rank's micro-batch count
        equal to the others' (expert parallelism exchanges tokens in every one), the rank's shortest row with every
        per-token value zero, so it adds nothing to the loss or the results kept. A mixture of experts' routers do
        count its tokens in their load-balancing and z-losses (megatron-core cannot average them over no tokens: all
        padding gives NaN), as one more micro-batch of those per-micro-batch losses."""
        if rows is None:
            shortest = int(lengths.argmin())
            mb = {k: v[shortest:shortest + 1].clone() for k, v in selected.items()}
            for key, value in mb.items():
                if key not in ("tokens", "prompt_lengths", "response_lengths", "routes"):
                    value.zero_()
            lengths = lengths[shortest:shortest + 1]
        else:
            mb = {k: v[rows.start:rows.stop] for k, v in selected.items()}
            lengths = lengths[rows.start:rows.stop]
        groups = prompt_groups(mb["tokens"], mb["prompt_lengths"]) if share else None
        split = self.par.cp > 1
        packed = pack_rows(mb["tokens"], lengths, mb.get("prompt_lengths"), groups, 1 if split else width,
                           1 if split else multiple)
        self.packed |= packed.shared
        mb["labels"] = shifted_labels(mb["tokens"])
        if "routes" in mb:  # each packed token replays the routes of the plain token it is; padding 0 … k − 1
            routes = mb["routes"].reshape(-1, *mb["routes"].shape[2:])[packed.origin]
            routes[packed.real:] = torch.arange(routes.shape[-1], dtype=routes.dtype)
            mb["routes"] = routes.unsqueeze(0)
        mb.update(tokens=packed.tokens, position_ids=packed.position_ids, attention_mask=packed.segments,
                  source=packed.source, real_lengths=torch.tensor([packed.real]))
        if split:
            mb.update(context_parallel.share(mb, packed.real, self.par.cp, self.cp_rank, self.par.cp_algo, multiple,
                                             width))
        return mb

    def _missing_micro_batches(self, count: int) -> int:
        """How many micro-batches this data-parallel rank lacks beside the rank with the most (token budgets cut
        each rank's rows into its own number)."""
        counts = torch.tensor([count], device=self.platform.device())
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
        return int(counts.item()) - count

    def _padded(self, selected: dict[str, torch.Tensor], size: int, segments: tuple[int, int] | None) -> list[dict]:
        """Micro-batches of exactly `size` rows: the pipeline exchanges fixed-shape activations,
        so a short last one is filled with rows of padding whose loss mask is zero. Given prompt and
        response lengths, rows sharing a prompt are packed (`prompt_packing`: on, or auto where that
        costs fewer FLOPs); the model then sees the packed rows, the loss still the plain ones, and every
        packed row's segments take the whole batch's longest prompt and response (`segments`)."""
        out, lengths = [], real_lengths(selected)
        for start in range(0, selected["tokens"].shape[0], size):
            mb = {k: v[start:start + size] for k, v in selected.items()}
            short = size - mb["tokens"].shape[0]
            if short:
                mb = {k: torch.cat([v, v.new_zeros((short, *v.shape[1:]))]) for k, v in mb.items()}
            mb["labels"] = shifted_labels(mb["tokens"])
            mb["real_lengths"] = torch.cat([lengths[start:start + size], lengths.new_zeros(short)])
            out.append(mb)
        if self.arch.vision is not None:
            out = [self._with_images(mb) for mb in out]
        # replayed routes are per plain row (a packed row would need them re-laid as its tokens are), a
        # sequence-parallel model's rows are padded to a multiple of TP, which the packed index would not follow,
        # and multimodal positions are per plain row too
        if self.prompt_packing != "off" and segments is not None \
                and "routes" not in out[0] and not self.model.config.sequence_parallel and self.arch.vision is None:
            groups = [prompt_groups(mb["tokens"], mb["prompt_lengths"]) for mb in out]
            # one packed shape for every micro-batch, as the pipeline needs
            shape = (max(map(len, groups)), max(packed_width(mb["prompt_lengths"], mb["response_lengths"], g)
                                                for mb, g in zip(out, groups, strict=True)))
            packed = [pack(mb["tokens"], mb["prompt_lengths"], mb["response_lengths"], *shape, groups=g,
                           segments=segments) for mb, g in zip(out, groups, strict=True)]
            self.packed = self.prompt_packing == "on" or packing_pays(self.arch, tuple(out[0]["tokens"].shape),
                                                                      packed)
            if self.packed:
                for mb, p in zip(out, packed, strict=True):
                    mb.update(tokens=p.tokens, position_ids=p.position_ids, attention_mask=p.layout, source=p.source,
                              real_lengths=p.lengths)
        if self.model.config.sequence_parallel:
            out = [_padded_to(mb, self.par.tp) for mb in out]
        return out

    def _with_images(self, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A vision-language micro-batch: its rows' images as the tower takes them, where their placeholders are,
        and [3, b, s] positions. Where the prompt lengths are known, only a prompt's image-pad tokens are
        placeholders: one the policy sampled is text, as the rollout engines fed it."""
        grids = None
        mask = mb["tokens"] == self.arch.vision.image_token_id
        if "prompt_lengths" in mb:
            mask &= torch.arange(mask.shape[1]) < mb["prompt_lengths"].unsqueeze(1)
        if "pixel_values" in mb:
            mb["pixel_values"], grids = flat_images(mb["pixel_values"], mb.pop("image_grid_thw"))
            mb["image_grid_thw"], mb["image_mask"] = grids, mask
            if not len(grids):  # text-only rows: nothing for the tower
                del mb["pixel_values"], mb["image_grid_thw"], mb["image_mask"]
        mb["position_ids"] = mrope_positions(mb["tokens"], grids, self.arch.vision, mask)
        return mb

    def _token_scores(self, logits: torch.Tensor, mb: dict, temperature: float, with_entropy: bool,
                      entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of the micro-batch's labels [rows, S] (and entropies), from plain or packed rows (under CP
        each rank scores the tokens of its share, and the ranks' scores are summed)."""
        if "source" in mb:
            log_probs, entropy = gathered_log_probs(logits, mb["source"], mb["labels"], temperature, self.vocab_size,
                                                    with_entropy, entropy_grad)
            return context_parallel.merge(log_probs), None if entropy is None else context_parallel.merge(entropy)
        log_probs = vocab_parallel_log_probs(logits, mb["labels"], temperature, self.vocab_size)
        entropy = vocab_parallel_entropy(logits, temperature, self.vocab_size, entropy_grad) if with_entropy else None
        return log_probs, entropy

    def compute_log_prob(self, batch: dict, with_entropy: bool = False,
                         temperature: float | None = None) -> dict[str, torch.Tensor] | None:
        """log π(token t+1 | ≤ t) at every position of this rank's rows (and the entropy), at the
        worker's sampling temperature unless `temperature` is given. From packed rows only the response
        tokens are scored (zero elsewhere): nothing downstream reads the prompt's."""
        check_batch(batch, ("tokens",))
        temperature = self.temperature if temperature is None else temperature

        def score(logits: torch.Tensor, mb: dict) -> dict[str, torch.Tensor]:
            log_probs, entropy = self._token_scores(logits, mb, temperature, with_entropy)
            return {"log_probs": log_probs, **({"entropy": entropy} if with_entropy else {})}

        return self._forward_rows(batch, score)

    @torch.no_grad()
    def _forward_rows(self, batch: dict, keep: Callable[[torch.Tensor, dict], dict[str, torch.Tensor]]
                      ) -> dict[str, torch.Tensor] | None:
        """A forward-only pass over this rank's rows in micro-batches; `keep(output, micro-batch)` picks each
        micro-batch's per-row results. Those of the rank's rows (padding rows dropped), on the host, on the last
        pipeline stage; None elsewhere."""
        rows = self.rows_for(batch, self.batching)
        self.model.eval()
        micro = self._micro_batches(batch, rows, self.micro_batch_size)
        outputs = run_microbatches(self.model, micro, lambda out, mb: (out.new_zeros(()), keep(out, mb)),
                                   forward_only=True)
        if not self.is_last_stage:
            return None
        count, width = len(rows), batch["tokens"].shape[1]
        # [rows, width] results lose the columns a sequence-parallel pass padded
        return {key: _cut(torch.cat([o[key] for o in outputs])[:count], width).cpu() for key in outputs[0]}


def start_weights(contents: dict, root: str) -> dict[str, torch.Tensor]:
    """The weights a run starts from in a rank file: a LoRA run's adapters merged into its base, as the engines
    and the HF export see them (a new run puts its own adapters, if any, on top)."""
    saved = contents.get("lora")
    if not saved:
        return contents["model"]
    if saved["adapters_only"]:
        raise ConfigError(LoraConfig.no_base(root))
    return lora.merge_state_dict(contents["model"], saved["alpha"] / saved["r"])


def real_lengths(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each right-padded row's tokens before its padding: its prompt and response where their lengths are
    given, else up to the token after its last scored position (an SFT row's EOS) or up to its scored position (a
    reward model's), else the whole row."""
    rows, width = batch["tokens"].shape
    if "prompt_lengths" in batch and "response_lengths" in batch:
        return (batch["prompt_lengths"] + batch["response_lengths"]).long()
    if "score_positions" in batch:
        return batch["score_positions"].long() + 1
    if "loss_mask" in batch:
        scored = batch["loss_mask"] != 0
        last = torch.where(scored, torch.arange(width), -1).max(dim=1).values
        return torch.where(scored.any(dim=1), last + 2, width).clamp(max=width)
    return torch.full((rows,), width, dtype=torch.long)


def _cut(values: torch.Tensor, width: int) -> torch.Tensor:
    return values[:, :width] if values.ndim >= 2 else values


def _padded_to(mb: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """The micro-batch with its per-token tensors padded to a width divisible by `multiple` (a sequence-parallel
    model cuts the sequence in that many equal shards): pad tokens, mask 0, replayed routes 0 … k − 1."""
    width = mb["tokens"].shape[1]
    extra = -width % multiple
    if not extra:
        return mb
    out = {}
    for key, value in mb.items():
        if torch.is_tensor(value) and value.ndim >= 2 and value.shape[1] == width:
            pad = value.new_zeros((value.shape[0], extra, *value.shape[2:]))
            if key == "routes":
                pad[:] = torch.arange(value.shape[-1], dtype=value.dtype)
            value = torch.cat([value, pad], dim=1)
        out[key] = value
    return out


def check_batch(batch: dict, keys: tuple[str, ...]) -> None:
    """Every key present as a [B, S] tensor of the tokens' shape, in one sentence if not."""
    tokens = batch.get("tokens")
    if not torch.is_tensor(tokens) or tokens.ndim != 2 or tokens.is_floating_point():
        raise ValueError("batch['tokens'] must be a [batch, sequence] tensor of token ids.")
    for key in keys:
        value = batch.get(key)
        if not torch.is_tensor(value):
            raise ValueError(f"batch lacks {key!r}, a [batch, sequence] tensor like its tokens.")
        if value.shape != tokens.shape:
            raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)} but the tokens have "
                             f"{tuple(tokens.shape)}; give one value per token position.")


class ActorWorker(MegatronWorker):
    """The trained policy: log-probs, PPO-style updates, and offload of its training state."""

    #: parameters that train in full beside LoRA's adapters (a critic's new value head)
    trained_with_adapters: tuple[str, ...] = ()

    def __init__(self, arch: ModelArch, par: ParallelConfig, cfg: ActorConfig, weights: str | dict | None = None,
                 params_dtype: torch.dtype = torch.float32) -> None:
        dp_size = dist.get_world_size() // par.model_ranks
        if cfg.mini_batch_size % (dp_size * cfg.micro_batch_size):
            raise ConfigError(
                f"mini_batch_size={cfg.mini_batch_size} over {dp_size} data-parallel ranks does not give each "
                f"rank a whole number of micro-batches of micro_batch_size={cfg.micro_batch_size}; make "
                f"mini_batch_size a multiple of {dp_size * cfg.micro_batch_size}.")
        super().__init__(arch, par, weights, params_dtype, cfg.temperature, cfg.micro_batch_size, cfg.seed,
                         cfg.prompt_packing, cfg.batching, cfg.recompute)
        self.cfg = cfg
        self._base_digest: str | None = None
        if cfg.lora.enabled:  # before the wrap: DDP and the optimizer see only what trains
            local = sharding.stage_names(arch, par, self.pp_rank, self.ep_rank)
            lora.add_adapters(self.model, cfg.lora, {name: full for full, name in local.items()}, cfg.seed,
                              trained=self.trained_with_adapters)
        if cfg.freeze_vision_tower and hasattr(self.model, "vision_model"):
            self.model.vision_model.requires_grad_(False)  # before the wrap: DDP and the optimizer skip them
        self.ddp, self.optimizer = wrap_for_training(self.model, lr=cfg.lr, min_lr=cfg.min_lr,
                                                     weight_decay=cfg.weight_decay, clip_grad=cfg.clip_grad,
                                                     adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2)
        # Megatron's scheduler counts what it is stepped by: here optimizer steps, so the iterations of the
        # schedule's keys are multiplied by the optimizer steps one takes (as Megatron multiplies by samples)
        decay_steps = cfg.lr_decay_iters * cfg.steps_per_iteration
        #: (warm-up, decay) in optimizer steps as this config sets them; a loaded checkpoint may bring others
        self.schedule_steps = (cfg.lr_warmup_fraction * decay_steps, decay_steps)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if cfg.lr_warmup_fraction else cfg.lr, max_lr=cfg.lr, min_lr=cfg.min_lr,
            lr_warmup_steps=cfg.lr_warmup_fraction * decay_steps, lr_decay_steps=decay_steps,
            lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
            wd_incr_steps=decay_steps, wd_incr_style="constant",
            # a load keeps the checkpoint's step count either way; override takes the config's schedule values,
            # otherwise the checkpoint's are used (megatron-core's default, where Megatron-LM's with neither
            # switch would assert that they match)
            override_opt_param_scheduler=cfg.override_opt_param_scheduler,
            use_checkpoint_opt_param_scheduler=not cfg.override_opt_param_scheduler)
        self.updates = 0
        self._saving: dist_ckpt.PendingSave | None = None
        self.expert_load = (ExpertLoad(self.model, arch.moe_layers, arch.num_experts, self.platform.device())
                            if arch.is_moe else None)
        self._swap_optimizer_out()  # the fp32 masters exist already: off the device before the engine starts

    def update(self, batch: dict) -> dict[str, float]:
        """`epochs` passes over the batch in mini-batches; one optimizer step per mini-batch.

        Without `old_log_probs` the update must be a single optimizer step: the policy that
        sampled the batch is then the one being updated, and the forward pass of the update
        gives the old log-probs itself (ratio 1, no separate pass). With `engine_log_probs`
        it also reports the engine-vs-actor gap, which the skipped pass would have shown.
        Metrics are the global values (over every data-parallel rank), the same on every
        rank, averaged over the optimizer steps.
        """
        cfg = self.cfg
        optional = ("old_log_probs", "rollout_is_weights", "engine_log_probs")
        keys = ("loss_mask", "advantages") + (("ref_log_probs",) if cfg.loss.use_kl_loss else ())
        check_batch(batch, keys + tuple(key for key in optional if key in batch))
        minis = self._mini_batches_of(batch)
        if "old_log_probs" not in batch and (cfg.epochs > 1 or minis > 1):
            raise ConfigError(f"this update takes {cfg.epochs * minis} optimizer steps (epochs={cfg.epochs}, {minis} "
                              f"mini-batches), so the batch needs old_log_probs from a pass before the update.")
        # the entropy is always measured (the collapse signal of RL runs), with gradient only as a bonus
        return self._epochs(batch, self._policy_loss, entropy=True)

    def _mini_batches_of(self, batch: dict) -> int:
        rows_total = batch["tokens"].shape[0]
        if rows_total % self.cfg.mini_batch_size:
            raise ConfigError(f"batch of {rows_total} rows is not a whole number of mini-batches of "
                              f"mini_batch_size={self.cfg.mini_batch_size}; make the rows a multiple of it.")
        return rows_total // self.cfg.mini_batch_size

    def _epochs(self, batch: dict, loss_of: LossOf, entropy: bool) -> dict[str, float]:
        """`epochs` passes over this rank's rows in mini-batches, one optimizer step each; the metrics averaged
        over the steps."""
        cfg = self.cfg
        self._mini_batches_of(batch)
        self.model.train()
        history: dict[str, list[float]] = {}
        for epoch in range(cfg.epochs):
            for rows in self._mini_batch_rows(batch, epoch):
                metrics = self._step(batch, rows, loss_of, entropy=entropy)
                for key, value in metrics.items():
                    history.setdefault(key, []).append(value)
        self.updates += 1
        return {key: sum(values) / len(values) for key, values in history.items()}

    def _mini_batch_rows(self, batch: dict, epoch: int) -> list[torch.Tensor]:
        """This rank's rows of each mini-batch of the epoch: mini-batches of its contiguous share (shuffled with
        `shuffle_mini_batch`); with `balance`, each mini-batch of the whole batch's rows (shuffled alike) split over
        the data-parallel ranks by cost."""
        cfg = self.cfg
        total = batch["tokens"].shape[0]
        generator = torch.Generator().manual_seed(cfg.seed + 1000 * self.updates + epoch)
        if cfg.batching.balance and self.dp_size > 1:
            order = torch.randperm(total, generator=generator) if cfg.shuffle_mini_batch else torch.arange(total)
            return [self.balanced(batch, order[start:start + cfg.mini_batch_size].sort().values)
                    for start in range(0, total, cfg.mini_batch_size)]
        rows = self.local_rows(total)
        n_local, mini = rows.stop - rows.start, cfg.mini_batch_size // self.dp_size
        order = torch.arange(rows.start, rows.stop)
        if cfg.shuffle_mini_batch:
            order = rows.start + torch.randperm(n_local, generator=generator)
        return [order[start:start + mini] for start in range(0, n_local, mini)]

    def _backward(self, batch: dict, rows: torch.Tensor, loss_of: LossOf, entropy: bool) -> tuple[list[dict], int]:
        """Forward and backward of one mini-batch (this rank's `rows`); gradients end reduced
        over data-parallel ranks in Megatron's grad buffers. Returns the loss's metric shares and the number of
        micro-batches."""
        cfg = self.cfg
        micro = self._micro_batches(batch, rows, cfg.micro_batch_size, cfg.batching)
        # Normalise by the whole mini-batch across data-parallel ranks, and undo Megatron's
        # division by the micro-batch count and DDP's gradient averaging: every TP/PP/DP
        # layout and micro-batch size then minimises the same loss.
        totals = torch.tensor([float(sum(mb["loss_mask"].sum() for mb in micro)), float(len(rows))],
                              device=self.platform.device())
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        normalisers = {"num_tokens": totals[0].item(), "num_seqs": totals[1].item()}
        scale = len(micro) * self.dp_size

        def loss_fn(logits: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict]:
            log_probs, entropies = self._token_scores(logits, mb, cfg.temperature, entropy,
                                                      bool(cfg.loss.entropy_coeff))
            loss, metrics = loss_of(log_probs, entropies, mb, normalisers)
            return loss * scale, {_LOSS: loss.detach(), **{k: torch.tensor(v) for k, v in metrics.items()}}

        # every optimizer step of every trainer (actor, critic, SFT, DPO) passes here, on every rank alike: an
        # asynchronous save whose writes are done is published at the first one after
        self.finish_saves(wait=False)
        zero_grads(self.ddp, self.optimizer)
        return run_microbatches(self.ddp, micro, loss_fn), len(micro)

    def _policy_loss(self, log_probs: torch.Tensor, entropy: torch.Tensor | None, mb: dict,
                     normalisers: dict[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.cfg
        old = mb.get("old_log_probs")
        loss, metrics = actor_loss(log_probs, log_probs.detach() if old is None else old, mb["advantages"],
                                   mb["loss_mask"], cfg.loss, ref_log_prob=mb.get("ref_log_probs"),
                                   entropy=entropy, is_weights=mb.get("rollout_is_weights"), **normalisers)
        if old is None and "engine_log_probs" in mb:
            metrics.update(mismatch_shares(log_probs, mb["engine_log_probs"], mb["loss_mask"],
                                           normalisers["num_tokens"]))
        return loss, metrics

    def _step(self, batch: dict, rows: torch.Tensor, loss_of: LossOf, entropy: bool = False) -> dict[str, float]:
        """One optimizer step on `rows`, skipped on every rank alike where the mini-batch's loss (the same on every
        rank) or the global gradient norm is not finite: the optimizer's grad scaler (mindrl.models.optimizer)
        finds the latter, as Megatron's does for fp16, so the weights, Adam's moments and the LR schedule stay
        as they were (mindrl/trainer/nonfinite.py)."""
        self._swap_optimizer_out()
        outputs, num_microbatches = self._backward(batch, rows, loss_of, entropy)
        metrics = self._global_metrics(outputs)
        loss = metrics.pop(_LOSS)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses; the scheduler moves it after
        updated, grad_norm = False, None
        if math.isfinite(loss):
            with self._optimizer_on_device():
                updated, grad_norm, _ = self.optimizer.step()
        if updated:
            self.scheduler.step(increment=1)
        metrics.update({"grad_norm": float(grad_norm) if grad_norm is not None else math.nan, "lr": lr,
                        "skipped": float(not updated), "nonfinite_loss": float(not math.isfinite(loss)),
                        "prompt_packed": float(self.packed)})
        if self.expert_load is not None:
            metrics.update(self.expert_load.step_metrics(num_microbatches))
        return metrics

    def sft_step(self, batch: dict) -> dict[str, float]:
        """One optimizer step of supervised fine-tuning on the whole batch (`tokens`, `loss_mask`:
        1 where the next token is a response token); metrics as `update`'s, with `sft_loss`."""
        check_batch(batch, ("loss_mask",))
        if self.cfg.temperature != 1.0:
            raise ConfigError(f"supervised fine-tuning scores tokens at temperature 1, but this actor's is "
                              f"{self.cfg.temperature}; build it with temperature=1.0.")
        rows = self.local_rows(batch["tokens"].shape[0])
        self.model.train()
        metrics = self._step(batch, torch.arange(rows.start, rows.stop), _sft_loss)
        self.updates += 1
        return metrics

    def dpo_step(self, batch: dict, loss: DPOLossConfig) -> dict[str, float]:
        """One optimizer step of DPO on the whole batch: rows 2i and 2i + 1 are pair i's chosen and rejected
        response (`tokens`, `loss_mask` over the response, `ref_log_probs` the frozen reference's), so a pair
        is always in one micro-batch and sees one set of weights; metrics as `update`'s, under TRL's names."""
        check_batch(batch, ("loss_mask", "ref_log_probs"))
        rows_total = batch["tokens"].shape[0]
        if rows_total % (2 * self.dp_size) or self.cfg.micro_batch_size % 2:
            raise ConfigError(f"a DPO batch of {rows_total} rows in micro-batches of {self.cfg.micro_batch_size} over "
                              f"{self.dp_size} data-parallel ranks splits a chosen/rejected pair; give each rank and "
                              f"each micro-batch whole pairs.")
        if self.cfg.temperature != 1.0:
            raise ConfigError(f"DPO scores tokens at temperature 1, but this actor's is {self.cfg.temperature}; "
                              f"build it with temperature=1.0.")
        if self.cfg.batching.max_tokens is not None:
            raise ConfigError("a token budget would cut DPO's micro-batches by tokens, but its loss takes each "
                              "chosen/rejected pair whole in one micro-batch; build the actor without one.")
        rows = self.local_rows(rows_total)
        self.model.train()
        chosen_tokens = batch["loss_mask"][0::2].sum().item()  # the whole batch's: every rank holds it
        metrics = self._step(batch, torch.arange(rows.start, rows.stop), _dpo_loss(loss, chosen_tokens))
        self.updates += 1
        return metrics

    def _global_metrics(self, outputs: list[dict]) -> dict[str, float]:
        """Sum the loss's metric shares over micro-batches and data-parallel ranks on the last
        stage, and hand the result to every pipeline stage."""
        metrics: dict[str, float] | None = None
        if self.is_last_stage:
            keys = sorted(outputs[0])
            # fp32: HCCL's AllReduce has no fp64 (on Atlas A2/A3); shares of per-step means need no more
            values = torch.tensor([float(sum(o[k] for o in outputs)) for k in keys], dtype=torch.float32,
                                  device=self.platform.device())
            dist.all_reduce(values, group=parallel_state.get_data_parallel_group())
            metrics = dict(zip(keys, values.tolist(), strict=True))
        if self.par.pp > 1:
            box = [metrics]
            dist.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                       group=parallel_state.get_pipeline_model_parallel_group())
            metrics = box[0]
        return metrics

    @property
    def frozen(self) -> bool:
        return False

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        return training.optimizer_tensors(self.optimizer)

    def base_digest(self) -> str:
        """The digest of this rank's frozen base (mindrl.models.lora.base_digest), taken once: hashing a 32B stage
        costs seconds, and the base changes only when a checkpoint is loaded."""
        if self._base_digest is None:
            self._base_digest = lora.base_digest(self.model)
        return self._base_digest

    def onload(self) -> int:
        """Bring back what offload freed; with swap_optimizer the optimizer's own state stays in host memory (not
        what it shares with the model's parameters: fp32 master weights can be views of them)."""
        if not self.cfg.swap_optimizer:
            return self.offloader.onload()
        return self.offloader.onload(storage_keys(self._optimizer_tensors()) - storage_keys(self.model.parameters()))

    def _swap_optimizer_out(self) -> None:
        """With swap_optimizer, the optimizer state to host memory (nothing to do where it is there already)."""
        if self.cfg.swap_optimizer:
            self.offload(params=False, grads=False, optimizer=True)

    @contextmanager
    def _optimizer_on_device(self) -> Iterator[None]:
        """With swap_optimizer, the optimizer state on the device for the duration, back in host memory after."""
        if not self.cfg.swap_optimizer:
            yield
            return
        self.offloader.onload()
        try:
            yield
        finally:
            self._swap_optimizer_out()

    def _train_state(self, action: str) -> training.TrainState:
        if self.offloader.offloaded_bytes:
            raise RuntimeError(f"the actor's training state is offloaded; call onload() before {action}.")
        return training.TrainState(self.model, self.optimizer, self.scheduler, self.arch, self.par, self.updates,
                                   self.cfg.lora, self.base_digest)

    def save_checkpoint(self, root: str | Path, iteration: int, extra: dict | None = None) -> Path:
        """A resumable training checkpoint in `ckpt_format` (mindrl/checkpoint/training.py, dist.py); every rank
        calls it. `extra` is the caller's state to get back on resume (data position, trainer step, seeds). An
        asynchronous save is published later (`finish_saves`); the one before it is waited for first."""
        self.finish_saves()
        with self._optimizer_on_device():
            state = self._train_state("save_checkpoint")
            if self.cfg.ckpt_format != files.FORMAT:
                return training.save(state, root, iteration, extra)
            pending = dist_ckpt.save(state, root, iteration, extra, self.cfg.async_save)
        self._saving = pending if self.cfg.async_save else None
        return Path(root) / mg.iteration_dir_name(iteration)

    def finish_saves(self, wait: bool = True) -> None:
        """Publish an asynchronous save whose writes are done on every rank (waiting for them where `wait`);
        every rank calls it at the same point."""
        pending, self._saving = self._saving, None
        if pending is not None and not pending.finish(wait):  # a failed one raises, and is not asked again
            self._saving = pending

    def kept_schedule(self) -> str | None:
        """After a resume, a sentence where the LR schedule the checkpoint carried differs from this config's (its
        optimizer steps, warm-up, lr, decay or weight decay): by default the checkpoint's goes on, as megatron-core's
        scheduler keeps a loaded schedule (a changed train_iters, lr_decay_iters or lr, or a checkpoint written
        before the schedule counted iterations, would otherwise change the schedule unannounced). None when they
        agree, with override_opt_param_scheduler (the config's went on) and with use_checkpoint_opt_param_scheduler
        (the checkpoint's was asked for)."""
        cfg, s = self.cfg, self.scheduler
        if cfg.override_opt_param_scheduler or cfg.use_checkpoint_opt_param_scheduler:
            return None
        warmup, decay = self.schedule_steps
        kept = _schedule(s.lr_warmup_steps, s.lr_decay_steps, s.max_lr, s.min_lr, s.lr_decay_style, s.start_wd)
        mine = _schedule(warmup, decay, cfg.lr, cfg.min_lr, cfg.lr_decay_style, cfg.weight_decay)
        if kept == mine:
            return None
        return (f"the checkpoint's LR schedule ({_schedule_text(*kept)}) goes on, as Megatron keeps a loaded "
                f"schedule, though this config's is {_schedule_text(*mine)}; override_opt_param_scheduler: true "
                f"takes this config's from the checkpoint's step on, use_checkpoint_opt_param_scheduler: true keeps "
                f"the checkpoint's without this warning, and no_load_optim: true starts this config's over (with "
                f"fresh Adam moments).")

    def load_checkpoint(self, root: str | Path, iteration: int | None = None, load_optim: bool = True,
                        load_rng: bool = True) -> training.Resumed:
        """Resume from the tracker's (or the given) iteration; `load_optim` / `load_rng` false are
        Megatron's no_load_optim / no_load_rng. Returns the iteration and the saved extra state."""
        with self._optimizer_on_device():
            state = self._train_state("load_checkpoint")
            iteration = mg.read_tracker(root) if iteration is None else iteration
            if files.format_of(root, iteration) == files.FORMAT and iteration != "release":
                resumed = dist_ckpt.load(state, root, iteration, load_optim, load_rng)
            else:
                resumed = training.load(state, root, iteration, load_optim, load_rng)
        self.offloader.forget_copies()
        self._base_digest = None  # a checkpoint with its base weights may have brought others
        self.updates = resumed.updates
        return resumed


class BackboneReference:
    """share_backbone's reference: the actor's own model with its LoRA adapters off, so the KL is taken against the
    frozen base with no second model in memory. It answers as a reference worker does (log-probs, rows, ranks); it
    holds nothing of its own, so it is never among the models offloaded beside the actor."""

    def __init__(self, actor: ActorWorker, micro_batch_size: int, batching: Batching | None = None) -> None:
        if not actor.cfg.lora.enabled:
            raise ConfigError("share_backbone makes the reference the actor with its LoRA adapters off, but the actor "
                              "has none; set lora_target_modules or turn share_backbone off.")
        self.actor, self.micro_batch_size = actor, micro_batch_size
        self.batching = actor.batching if batching is None else batching

    def __getattr__(self, name: str):
        if name == "actor":  # not set yet (a copy being built): no endless lookup
            raise AttributeError(name)
        return getattr(self.actor, name)  # its layout: ranks, local_rows, is_last_stage …

    def compute_log_prob(self, batch: dict, with_entropy: bool = False,
                         temperature: float | None = None) -> dict[str, torch.Tensor] | None:
        actor, kept = self.actor, (self.actor.micro_batch_size, self.actor.batching)
        actor.micro_batch_size, actor.batching = self.micro_batch_size, self.batching
        try:
            with lora.adapters_disabled(actor.model):
                return actor.compute_log_prob(batch, with_entropy, temperature)
        finally:
            actor.micro_batch_size, actor.batching = kept
