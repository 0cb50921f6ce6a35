"""What the ranks of one model-parallel replica (its TP × PP ranks) send each other while generating.

Hidden states go down the pipeline with point-to-point sends over the pipeline group, as
in training. On the last stage the TP ranks' vocabulary slices of the last position's
logits are gathered on one rank, the sampler (TP rank 0 of the last stage): a [rows,
vocab] tensor per step, the only full-vocabulary copy. The sampler draws, and one
broadcast over the model-parallel group gives every rank the new tokens (the first stage
embeds them next; every rank needs them to know which rows are done) and their log-probs.
Only model-parallel groups are used, so data-parallel replicas generate independently, except
that replicas sharing a mixture of experts' expert-parallel group step together (ExpertLockstep).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


class ReplicaLinks:
    def __init__(self, device: torch.device) -> None:
        self.pipeline = ps.get_pipeline_model_parallel_group()
        self.tensor = ps.get_tensor_model_parallel_group()
        self.replica = ps.get_model_parallel_group()
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.is_sampler = self.last and ps.get_tensor_model_parallel_rank() == 0
        self.sampler_rank = dist.get_rank()
        if dist.get_world_size(self.replica) > 1:  # collective: every rank of the replica builds its links
            rank = torch.tensor([self.sampler_rank if self.is_sampler else -1], device=device)
            dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=self.replica)
            self.sampler_rank = int(rank.item())

    def receive_hidden(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        hidden = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank(), group=self.pipeline)
        return hidden

    def send_hidden(self, hidden: torch.Tensor) -> None:
        dist.send(hidden.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank(), group=self.pipeline)

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab / TP] slices in, the sampler's full [rows, vocab] out (None elsewhere)."""
        if self.tp_size == 1:
            return local
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.tp_size)] if self.is_sampler else None
        dist.gather(local, parts, dst=self.sampler_rank, group=self.tensor)
        return torch.cat(parts, dim=-1) if self.is_sampler else None

    def share_samples(self, tokens: torch.Tensor | None, log_probs: torch.Tensor | None, rows: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampler's tokens and log-probs on every rank of the replica, in one fp32 broadcast: it carries
        fp32 log-probs and token ids below 2^24 exactly (every vocabulary), and every backend broadcasts it."""
        if dist.get_world_size(self.replica) == 1:
            return tokens, log_probs
        packed = (torch.stack([tokens.float(), log_probs.float()]) if self.is_sampler
                  else torch.empty(2, rows, dtype=torch.float32, device=device))
        dist.broadcast(packed, src=self.sampler_rank, group=self.replica)
        return packed[0].long(), packed[1].float()


class ExpertLockstep:
    """Replicas whose experts are spread over each other (EP > 1) meet in an all-to-all in every MoE layer of
    every forward, so they must run the same number of forwards though each decodes its own prompts for as many
    steps as they need. Before each forward the replicas of an EP group vote whether they still have work; a
    replica that has finished runs a one-token forward for every vote some other one still wins."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.group = ps.get_expert_model_parallel_group() if ps.get_expert_model_parallel_world_size() > 1 else None

    def _vote(self, working: bool) -> bool:
        """Whether any replica of the group is working (collective over the group)."""
        flag = torch.tensor([1 if working else 0], device=self.device)
        dist.all_reduce(flag, group=self.group)
        return bool(flag.item())

    def before_forward(self) -> None:
        if self.group is not None:
            self._vote(True)

    def until_all_done(self, idle_forward: Callable[[], None]) -> None:
        """Run `idle_forward` for as long as another replica of the group still forwards."""
        if self.group is not None:
            while self._vote(False):
                idle_forward()
