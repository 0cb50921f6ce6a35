"""Mixture-of-experts layers: megatron-core's MoELayer (TopKRouter, SequentialMLP experts, the shared
expert) as the local spec builds it, configured for the expert-parallel layout.

The experts are one plain MLP each (SequentialMLP), so their parameters are named and cut like the dense
MLP's (`mlp.experts.local_experts.<i>.linear_fc1/fc2`) on every platform; grouped-GEMM kernels would need
Transformer Engine.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer import ModuleSpec
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from mindrl.config import ModelArch, ParallelConfig
from mindrl.models.recompute import recomputing

# megatron-core 0.16 tests `te_general_gemm is not None` in the router's linear but binds the name only when
# Transformer Engine imports; without it every router forward raises NameError. None is its own "absent".
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None


def moe_config_kwargs(arch: ModelArch, par: ParallelConfig) -> dict[str, Any]:
    """TransformerConfig keywords of an MoE model under `par`.

    megatron-core refuses to train an MoE layer under TP without sequence parallelism (its tokens are
    routed per sequence shard), so at TP > 1 `par.sequence_parallel_for` is always true for it (transformer_config
    sets it); sequences must then divide by TP.

    The expert bias is not megatron-core's (add_expert_bias adds it).
    """
    kwargs = dict(expert_model_parallel_size=par.ep, expert_tensor_parallel_size=par.tp, moe_grouped_gemm=False,
                  # each router gets a RouterReplay, idle (routing as usual) until told to record or replay
                  moe_enable_routing_replay=True)
    if arch.first_k_dense_replace:
        kwargs["moe_layer_freq"] = arch.moe_layer_pattern
    return kwargs


def add_expert_bias(model: torch.nn.Module, arch: ModelArch) -> None:
    """Each router's expert bias (DeepSeek's aux-loss-free balancing) as an fp32 parameter without a gradient, which
    the routing adds to the scores as megatron-core's own bias.

    It is frozen. It balanced the experts' load over pre-training's trillions of tokens; moved by the sign of each RL
    step's few thousand, it would change which experts the policy uses without a gradient saying so, between the
    rollout that sampled the tokens and the update that scores them, and no importance ratio corrects that.
    megatron-core's own bias is a buffer, which no checkpoint, weight load or weight sync of mindrl's (all reading
    parameters) would carry, updated from token counts that megatron-core 0.16 cannot take under a padding mask."""
    if not arch.moe_router_enable_expert_bias:
        return
    for router in routers_of(model):
        router.expert_bias = torch.nn.Parameter(torch.zeros(arch.num_experts, dtype=torch.float32),
                                                requires_grad=False)


def mlp_submodules(spec: ModuleSpec) -> list[MLPSubmodules]:
    """The MLP submodules of a layer spec: the dense MLP's, or the experts' and the shared expert's."""
    mlp = spec.submodules.mlp.submodules
    if isinstance(mlp, MLPSubmodules):
        return [mlp]
    return [mlp.experts.submodules, mlp.shared_experts.submodules]


class ExpertLoad:
    """Tokens routed to each expert of each layer during training passes (forward passes with gradients), read
    from the routers' routing maps.

    `step_metrics` is a collective over all the model's ranks: each rank routes its own tokens (its data-parallel
    rows, its sequence shard, its pipeline stage's layers), so the counts are summed over the world."""

    def __init__(self, model: torch.nn.Module, layers: range, num_experts: int, device: torch.device) -> None:
        self.layers = layers  # the model's MoE layers
        # on the routers' device: a copy to the host in every layer's forward would wait for the device each time
        self.counts = torch.zeros(len(layers), num_experts, dtype=torch.float32, device=device)
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(self._count)

    def _count(self, router: TopKRouter, inputs: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        if torch.is_grad_enabled() and not recomputing():
            self.counts[moe_layer_index(router)] += output[1].sum(dim=0)

    def step_metrics(self, num_microbatches: int) -> dict[str, float]:
        """Per layer the busiest expert's tokens over the mean (1: balanced; `num_experts` / top-k: every token
        on the same experts), their maximum over layers, and the load-balancing (z-) loss megatron-core
        tracked, averaged over layers and micro-batches; the counts start over."""
        counts = self.counts.clone()
        dist.all_reduce(counts)
        self.counts.zero_()
        ratio = (counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-9)).tolist()
        metrics = {f"moe/load_max_over_mean_layer{i:02d}": r for i, r in zip(self.layers, ratio, strict=True)}
        metrics["moe/load_max_over_mean"] = max(ratio)
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        if tracker:
            moe_utils.reduce_aux_losses_tracker_across_ranks()
            for name, entry in sorted(tracker.items()):  # a value per layer, the dense ones' zero
                metrics[f"moe/{name}"] = entry["values"][list(self.layers)].mean().item() / num_microbatches
            moe_utils.clear_aux_losses_tracker()
        return metrics


def moe_layer_index(router: TopKRouter) -> int:
    """The router's layer among the model's MoE layers, which is how routes and loads are kept (an MoE model's
    dense layers come first)."""
    before = router.layer_number - 1
    pattern = router.config.moe_layer_freq
    return before - (pattern[:before].count(0) if isinstance(pattern, list) else 0)


def routers_of(model: torch.nn.Module) -> list[TopKRouter]:
    """The model's routers in layer order (cached on the model: the decode loop asks at every step)."""
    routers = model.__dict__.get("_mindrl_routers")
    if routers is None:
        routers = sorted((m for m in model.modules() if isinstance(m, TopKRouter)), key=lambda r: r.layer_number)
        model.__dict__["_mindrl_routers"] = routers
    return routers


def record_routes(model: torch.nn.Module, on: bool) -> None:
    """Make every router keep the experts it picks in its next forward (off: route as usual)."""
    for router in routers_of(model):
        router.router_replay.clear_indices()
        if on:
            router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
        else:
            router.router_replay.clear_router_replay_action()


def recorded_routes(model: torch.nn.Module, rows: int) -> torch.Tensor:
    """The experts the last forward of `rows` rows routed each token to, [rows, s, MoE layers of this stage, top-k]
    (the routers see the tokens sequence-major)."""
    picks = [router.router_replay.get_recorded_indices() for router in routers_of(model)]
    stacked = torch.stack(picks, dim=1)  # [s * rows, layers, k]
    return stacked.reshape(-1, rows, *stacked.shape[1:]).transpose(0, 1)


def replay_routes(model: torch.nn.Module, routes: torch.Tensor | None) -> None:
    """Route the next forward's tokens to `routes` [b, s, MoE layers, top-k] (all the model's) instead of the
    routers' own choice — the experts the rollout engine used (rollout routing replay) — or, with None, let the
    routers choose again. Under sequence parallelism each TP rank's routers see their slice of the sequence."""
    routers = routers_of(model)
    if not routers:
        return
    if routes is None:
        for router in routers:
            if router.router_replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()
        return
    config = routers[0].config
    if config.sequence_parallel:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        width = routes.shape[1] // tp
        routes = routes[:, rank * width:(rank + 1) * width]
    for router in routers:
        picks = routes[:, :, moe_layer_index(router)].transpose(0, 1).reshape(-1, routes.shape[-1]).long()
        router.router_replay.clear_indices()
        router.router_replay.set_target_indices(picks)
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
