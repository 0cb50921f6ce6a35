"""The reward model as the driver sees it: a worker group on its own devices (or the actor's ranks,
which host it under colocate_all_models), and how its scores join the rule rewards.

Scores are requested as soon as a rollout is batched and collected after the reference and old
log-prob passes, which run meanwhile on the actor's devices. A response's reward is then
    Σ verifier_weight[i] · verifier_i  (+ the overlong penalty)  +  reward_model_weight · s
where s is the reward model's score at the response's last token, normalised per
`reward_model_normalize`:
- none: the raw score;
- running: (score − mean) / std over every training score seen so far (this batch included), so a
  reward model whose scale drifts or is far from the verifiers' [0, 1] does not swamp them; the
  statistics are saved with each checkpoint and restored on resume;
- group: (score − group mean) / group std over the n samples of one prompt (GRPO's own
  normalisation, applied to this term alone before it is mixed with the verifiers).
Validation uses the raw score: it describes the model, not the batch.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from mindrl.config import ConfigError
from mindrl.console import say
from mindrl.trainer.megatron import MegatronConfig

NORMALISATIONS = ("none", "running", "group")
#: the reward model's (normalised) scores under this name beside the verifiers' (filter_groups_metric may name it)
REWARD_MODEL = "reward_model"
_EPS = 1e-6


class RunningStats:
    """Count, mean and sum of squared deviations of every score seen (Chan et al.'s batch merge)."""

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: torch.Tensor) -> None:
        values = values.double()
        n, mean = values.numel(), values.mean().item()
        m2 = ((values - mean) ** 2).sum().item()
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return (self.m2 / self.count) ** 0.5 if self.count else 1.0

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def normalise(scores: torch.Tensor, mode: str, group_size: int, stats: RunningStats) -> torch.Tensor:
    """`scores` [samples] (a prompt's samples contiguous) normalised as `mode` says; `stats` is updated first,
    except by a batch holding a NaN or inf: that batch's step is skipped (mindrl/trainer/nonfinite.py), and one
    NaN in the running statistics would make every later score NaN."""
    scores = scores.double()
    if mode == "running":
        if torch.isfinite(scores).all():
            stats.update(scores)
        return (scores - stats.mean) / (stats.std + _EPS)
    if mode == "group":
        grouped = scores.view(-1, group_size)
        std = grouped.std(dim=1, unbiased=False, keepdim=True) if group_size > 1 else torch.ones_like(grouped)
        return ((grouped - grouped.mean(dim=1, keepdim=True)) / (std + _EPS)).view(-1)
    return scores


def reward_spec(cfg: Any) -> Any:
    """The reward ranks' settings, from reward_config (its architecture is the checkpoint's)."""
    from mindrl.workers.ray_ranks import RewardSpec

    reward = cfg.reward_config
    return RewardSpec(reward.arch, reward.parallel, reward.bf16, reward.load, reward.micro_batch_size, reward.seed,
                      cfg.rl_config.batching("reward"))


class RewardModelGroup:
    """The ranks that score: a group of its own (rl_config.reward_resource), or the actor's ranks when every
    model shares the actor's devices (colocate_all_models; the reward model was built with them)."""

    def __init__(self, group: Any, dp_size: int, owned: bool) -> None:
        self.group, self.dp_size, self.owned = group, dp_size, owned

    @classmethod
    def on_own_devices(cls, cfg: Any) -> RewardModelGroup:
        from mindrl.workers.group import COLLECTIVE_TIMEOUT_S, WorkerGroup
        from mindrl.workers.ray_ranks import RewardRank

        group = WorkerGroup("reward", RewardRank, cfg.rl_config.resources["reward_resource"],
                            phase_timeout_s=cfg.rl_config.phase_timeout)
        host, port = group.rendezvous(COLLECTIVE_TIMEOUT_S)
        setup = group.call("setup", host, port, reward_spec(cfg), COLLECTIVE_TIMEOUT_S)[0]
        say(f"reward model on its own {group.world_size} ranks, weights from {cfg.reward_config.load}; "
            f"{setup['precision'].line}")
        return cls(group, setup["dp_size"], owned=True)

    def submit(self, tokens: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor) -> Any:
        """Start scoring each row at its response's last token; returns at once."""
        positions = (prompt_lengths + response_lengths - 1).clamp(min=0)
        return time.perf_counter(), self.group.call_async("score", {"tokens": tokens, "score_positions": positions})

    def collect(self, pending: Any) -> tuple[torch.Tensor, float]:
        """The raw scores [rows] and the seconds from submit until they were all in."""
        from mindrl.workers.group import gather_rows

        start, refs = pending
        scores = gather_rows(self.group.wait(refs, "reward_model", since=start), self.dp_size)
        return scores, time.perf_counter() - start

    def close(self) -> None:
        if self.owned:
            self.group.kill()


def reward_model_role(reward: MegatronConfig, actor: MegatronConfig) -> MegatronConfig:
    """reward_config with the architecture its checkpoint records (a reward model need not be the actor's
    size), after refusing a missing load, a causal LM, a head of more than one output, another layout or a
    vocabulary that cannot take the actor's token ids."""
    from mindrl.checkpoint import megatron as mg

    if reward.load is None:
        raise ConfigError("a reward model (rl_config.reward_resource or reward_config) needs reward_config.load; point "
                          "it at the reward model's Megatron checkpoint (cli/convert_ckpt.py --orm).")
    try:
        args = mg.load_args(reward.load)
        arch, par = mg.arch_of(args, "reward model"), mg.parallel_of(args)
    except (OSError, ConfigError) as err:
        raise ConfigError(f"reward_config.load={reward.load} is not a readable Megatron checkpoint ({err}); point it "
                          f"at cli/convert_ckpt.py --orm output.") from None
    if arch.num_labels is None:
        raise ConfigError(f"reward_config.load={reward.load} is a causal LM (it has an LM head, no score head); a "
                          f"reward model is an HF *ForSequenceClassification converted with cli/convert_ckpt.py --orm.")
    if arch.num_labels != 1:
        raise ConfigError(f"reward_config.load={reward.load} has a score head of {arch.num_labels} outputs; the "
                          f"reward worker takes one score per response (num_labels 1).")
    if (par.tp, par.pp) != (reward.tensor_model_parallel_size, reward.pipeline_model_parallel_size):
        raise ConfigError(f"reward_config.load={reward.load} is sharded TP={par.tp} PP={par.pp} but reward_config asks "
                          f"TP={reward.tensor_model_parallel_size} PP={reward.pipeline_model_parallel_size}; set them "
                          f"to the checkpoint's or re-shard it with cli/convert_ckpt.py (mg -> mg).")
    if arch.padded_vocab_size < actor.arch.padded_vocab_size:
        raise ConfigError(f"the reward model's vocabulary ({arch.padded_vocab_size} ids) is smaller than the actor's "
                          f"({actor.arch.padded_vocab_size}); it scores the actor's token ids, so it needs the actor's "
                          f"tokenizer.")
    return replace(reward, arch=arch, num_layer_list=par.num_layer_list)
