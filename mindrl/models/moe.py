"""Mixture-of-experts layers: megatron-core's MoELayer (TopKRouter, SequentialMLP experts, the shared
expert) as the local spec builds it, configured for the expert-parallel layout.

The experts are one plain MLP each (SequentialMLP), so their parameters are named and cut like the dense
MLP's (`mlp.experts.local_experts.<i>.linear_fc1/fc2`) on every platform; grouped-GEMM kernels would need
Transformer Engine.
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer import ModuleSpec
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe import moe_utils

from mindrl.config import ParallelConfig

# megatron-core 0.16 tests `te_general_gemm is not None` in the router's linear but binds the name only when
# Transformer Engine imports; without it every router forward raises NameError. None is its own "absent".
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None


def moe_config_kwargs(par: ParallelConfig) -> dict[str, Any]:
    """TransformerConfig keywords of an MoE model under `par`.

    megatron-core refuses to train an MoE layer under TP without sequence parallelism (its tokens are
    routed per sequence shard), so TP > 1 turns it on; sequences must then divide by TP.
    """
    return dict(expert_model_parallel_size=par.ep, expert_tensor_parallel_size=par.tp,
                sequence_parallel=par.tp > 1, moe_grouped_gemm=False)


def mlp_submodules(spec: ModuleSpec) -> list[MLPSubmodules]:
    """The MLP submodules of a layer spec: the dense MLP's, or the experts' and the shared expert's."""
    mlp = spec.submodules.mlp.submodules
    if isinstance(mlp, MLPSubmodules):
        return [mlp]
    return [mlp.experts.submodules, mlp.shared_experts.submodules]
