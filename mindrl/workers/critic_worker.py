"""PPO's critic: the actor's architecture ending in a one-output value head, trained on the GAE returns.

Like the actor's passes, the critic's pack a prompt's samples behind one copy of the prompt where that
costs fewer FLOPs (`prompt_packing`): the prompt is computed once instead of n times.

The model is the reward model's (RewardGPTModel: HF's *ForSequenceClassification `score` head as
`rm_head`), so a critic checkpoint is a reward-model checkpoint and converts to HF like one. Its value at
position t is V of the state that predicts token t + 1, aligned with the actor's log-probs and the
`loss_mask`. It starts from (`critic_config.load`, else the actor's initial weights):
- a reward-model checkpoint (cli/convert_ckpt.py --orm, or an earlier critic): every tensor, head included;
- a causal LM checkpoint (the actor's, converted from HF): its trunk, with a head freshly initialised
  from the seed (the LM head is dropped);
- nothing: random initialisation from the seed, like the tiny actor's.
It trains with its own optimizer and LR schedule (critic_config's lr, clip_grad, ...), in the actor's
update loop (epochs × mini-batches, micro-batches, TP/PP/DP normalisers), on the clipped value loss.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mindrl.algorithms.value_loss import ValueLossConfig, value_loss
from mindrl.checkpoint import dist as dist_ckpt
from mindrl.checkpoint import files
from mindrl.checkpoint import megatron as mg
from mindrl.config import ConfigError, ModelArch, ParallelConfig
from mindrl.models import context_parallel
from mindrl.workers.megatron_worker import ActorConfig, ActorWorker, check_batch, start_weights

#: the head a causal LM checkpoint has and a critic does not
_LM_HEAD = "output_layer.weight"


def critic_arch(arch: ModelArch) -> ModelArch:
    """The critic's architecture: the actor's trunk with a one-output head."""
    return replace(arch, num_labels=1)


def start_arch(root: str, arch: ModelArch) -> ModelArch:
    """The architecture the checkpoint at `root` must have to start a critic of `arch`: the same trunk, with an LM
    head or one value head (checked by the driver before any worker starts, and again by each rank)."""
    stored = mg.arch_of(files.load_args(root), root)
    if stored.num_labels not in (None, 1):
        raise ConfigError(f"critic_config.load={root} has a score head of {stored.num_labels} outputs; a critic "
                          f"starts from a causal LM or a reward model of one output.")
    return replace(arch, num_labels=stored.num_labels)


class CriticWorker(ActorWorker):
    trained_with_adapters = ("rm_head.",)  # the value head is new: LoRA trains it in full

    def __init__(self, arch: ModelArch, par: ParallelConfig, cfg: ActorConfig, loss: ValueLossConfig,
                 weights: str | None = None, params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(critic_arch(arch), par, cfg, weights, params_dtype)
        self.value_cfg = loss

    def _stage_weights(self, root: str) -> dict[str, torch.Tensor]:
        state = dict(start_weights(dist_ckpt.stage_start(self.model, root, self.tp_rank, self.pp_rank,
                                                    start_arch(root, self.arch), self.par, self.ep_rank,
                                                    new_heads=("rm_head.",)), root))
        state.pop(_LM_HEAD, None)
        if self.is_last_stage and "rm_head.weight" not in state:
            state["rm_head.weight"] = self.model.rm_head.weight.detach().clone()
        return state

    def _token_scores(self, logits: torch.Tensor, mb: dict, temperature: float, with_entropy: bool,
                      entropy_grad: bool = True) -> tuple[torch.Tensor, None]:
        """The values [rows, S] (fp32): the model's one output at every position of plain rows; from rows packed
        behind shared prompts, at the response positions only (0 elsewhere), read where the actor reads the
        logits that score the next token — the prompt's last position gives every sample of it V(prompt)."""
        values = logits[..., 0].float()
        if "source" not in mb:
            return values, None
        valid = mb["source"] >= 0
        picked = values.reshape(-1).index_select(0, mb["source"][valid])
        scattered = torch.zeros(mb["source"].shape, dtype=torch.float32, device=values.device).masked_scatter(valid,
                                                                                                               picked)
        return context_parallel.merge(scattered), None

    def compute_values(self, batch: dict) -> torch.Tensor | None:
        """V at every position of this rank's rows ([rows, S], fp32) on the last stage; None elsewhere."""
        check_batch(batch, ())
        out = self._forward_rows(batch, lambda values, mb: {"values": self._token_scores(values, mb, 1.0, False)[0]})
        return None if out is None else out["values"]

    def update(self, batch: dict) -> dict[str, float]:
        """`epochs` passes of the clipped value loss over the batch (`tokens`, `loss_mask`, `values` as scored
        before the update, `returns`; with `prompt_lengths` and `response_lengths` a prompt's samples may be
        packed, as the actor's are); metrics as the actor's update's."""
        check_batch(batch, ("loss_mask", "values", "returns"))
        return self._epochs(batch, self._value_loss, entropy=False)

    def _value_loss(self, values: torch.Tensor, entropy: None, mb: dict,
                    normalisers: dict[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
        return value_loss(values, mb["values"], mb["returns"], mb["loss_mask"], self.value_cfg, **normalisers)
