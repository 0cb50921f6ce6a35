"""Tensor / pipeline parallel layout of one Megatron role, and its validation.

Every rule here is checked before a process group starts: a layout Megatron would
reject (or, worse, accept and shard wrongly) costs one sentence, not a cluster start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from mindrl.config.errors import ConfigError
from mindrl.config.model import ModelArch

#: MindSpeed-RL's context-parallel algorithm names → mindrl's
CP_ALGORITHMS = {"ulysses_cp_algo": "ulysses", "megatron_cp_algo": "ring"}


@dataclass(frozen=True)
class ParallelConfig:
    """Key names follow Megatron / MindSpeed-RL (`num_layer_list: "10,14"` for uneven PP)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layer_list: tuple[int, ...] | None = None
    #: ranks a mixture-of-experts layer's experts are spread over (each holds num_experts / EP of them)
    expert_model_parallel_size: int = 1
    #: the tensor-parallel cut of each expert; null: tensor_model_parallel_size, megatron-core's default and
    #: the only one mindrl builds (MindSpeed-LLM's and Megatron-LM's expert checkpoints are cut so)
    expert_tensor_parallel_size: int | None = None
    #: Megatron's sequence parallelism: with TP > 1 the activations outside the tensor-parallel matmuls (norms,
    #: residual adds) are cut along the sequence over the TP ranks. null: on exactly for a mixture of experts at
    #: TP > 1 (megatron-core trains MoE layers under TP only so); at TP = 1 it is off whatever it says, as in
    #: Megatron. See `sequence_parallel_for`.
    sequence_parallel: bool | None = None
    #: ranks each sequence is cut over (mindrl/models/context_parallel.py); they hold the same weights
    context_parallel_size: int = 1
    #: how the context-parallel ranks attend to each other's tokens: ulysses_cp_algo (all-to-all to head shards) or
    #: megatron_cp_algo (keys and values round a ring)
    context_parallel_algo: str = "ulysses_cp_algo"

    def __post_init__(self) -> None:
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                    "context_parallel_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{key} must be a positive integer, got {value!r}.")
        if self.sequence_parallel is not None and not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"sequence_parallel must be true or false, got {self.sequence_parallel!r}.")
        if self.context_parallel_algo not in CP_ALGORITHMS:
            raise ConfigError(f"context_parallel_algo must be one of {', '.join(CP_ALGORITHMS)}, got "
                              f"{self.context_parallel_algo!r}.")
        if isinstance(self.num_layer_list, str):
            object.__setattr__(self, "num_layer_list", parse_layer_list(self.num_layer_list))

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def cp_algo(self) -> str:
        """ulysses or ring."""
        return CP_ALGORITHMS[self.context_parallel_algo]

    @property
    def model_ranks(self) -> int:
        """Ranks of one data-parallel replica: TP × PP × CP (each holds its rows; experts spread over replicas)."""
        return self.tp * self.pp * self.cp

    @property
    def ranks_per_replica(self) -> int:
        """Ranks that hold one whole copy of the model: TP×PP, times EP (experts are cut across the data- and
        context-parallel ranks of a TP×PP model, so a model of EP=e needs e of those)."""
        return self.tp * self.pp * self.ep

    def sequence_parallel_for(self, arch: ModelArch) -> bool:
        """Whether `arch`'s model runs sequence-parallel under this layout (the TransformerConfig's value)."""
        if self.tp == 1:
            return False
        return arch.is_moe if self.sequence_parallel is None else self.sequence_parallel

    def layers_per_stage(self, arch: ModelArch) -> list[int]:
        """Decoder layers on each pipeline stage (validated)."""
        validate_parallel(arch, self)
        if self.num_layer_list:
            return list(self.num_layer_list)
        return [arch.num_layers // self.pp] * self.pp

    def first_layer_of_stages(self, arch: ModelArch) -> list[int]:
        """Global index of the first decoder layer of each stage."""
        counts = self.layers_per_stage(arch)
        return [sum(counts[:i]) for i in range(len(counts))]


def parse_layer_list(text: str | tuple[int, ...] | list[int] | int, key: str = "num_layer_list") -> tuple[int, ...]:
    """`"10,14"` (MindSpeed-RL's string form, also a YAML list) → (10, 14)."""
    items = text.split(",") if isinstance(text, str) else [text] if isinstance(text, int) else list(text)
    try:
        return tuple(int(str(item).strip()) for item in items)
    except ValueError:
        raise ConfigError(f"{key} must be comma-separated integers such as '10,14', got {text!r}.") from None


def without_noop_layers(noop_layers: str | list[int] | int, num_layers: int, pp: int) -> tuple[int, tuple[int, ...]]:
    """MindSpeed-LLM's no-op layers (identity layers padding num_layers to a multiple of the pipeline stages) as
    the real layer count and the layers of each stage (num_layer_list). A stage's no-op layers must be its last
    ones: MindSpeed-LLM's checkpoints then number a stage's layers as a stage of that many layers
    does, so they load."""
    noops = sorted(set(parse_layer_list(noop_layers, "noop_layers")))
    if num_layers % pp:
        raise ConfigError(f"noop_layers pads num_layers to fill the pipeline stages, but num_layers={num_layers} is "
                          f"not a multiple of pipeline_model_parallel_size={pp}; count the no-op layers in "
                          f"num_layers.")
    per = num_layers // pp
    counts = [per] * pp
    for layer in noops:
        if not 0 <= layer < num_layers:
            raise ConfigError(f"noop_layers names layer {layer}, but the model has layers 0 to {num_layers - 1}; "
                              f"fix the index.")
        counts[layer // per] -= 1
    for layer in noops:
        stage = layer // per
        if layer < (stage + 1) * per - (per - counts[stage]):
            raise ConfigError(f"noop_layers puts layer {layer} inside pipeline stage {stage} (layers {stage * per} "
                              f"to {(stage + 1) * per - 1}); mindrl reads no-op layers as a stage with fewer layers, "
                              f"which keeps a checkpoint's layer numbers only where they are the stage's last; "
                              f"move it to the end of its stage.")
    if min(counts) < 1:
        raise ConfigError(f"noop_layers leaves pipeline stage {counts.index(min(counts))} without a real layer; "
                          f"every stage needs at least one.")
    return num_layers - len(noops), tuple(counts)


def validate_parallel(arch: ModelArch, par: ParallelConfig, world_size: int | None = None) -> None:
    """Raise ConfigError for the first layout mistake, naming what to change."""
    tp, pp = par.tp, par.pp
    if arch.num_attention_heads % tp:
        raise ConfigError(
            f"tensor_model_parallel_size={tp} does not divide num_attention_heads="
            f"{arch.num_attention_heads} of model {arch.name}; choose a TP that divides it.")
    if arch.query_groups % tp:
        raise ConfigError(
            f"tensor_model_parallel_size={tp} does not divide num_query_groups={arch.query_groups} "
            f"(key-value heads) of model {arch.name}; choose a TP that divides {arch.query_groups}.")
    if arch.ffn_hidden_size % tp:
        raise ConfigError(
            f"tensor_model_parallel_size={tp} does not divide ffn_hidden_size={arch.ffn_hidden_size} "
            f"of model {arch.name}; choose a TP that divides it.")
    if par.num_layer_list:
        counts = par.num_layer_list
        if len(counts) != pp:
            raise ConfigError(f"num_layer_list {','.join(map(str, counts))} has {len(counts)} entries "
                              f"but pipeline_model_parallel_size={pp}; give one layer count per stage.")
        if min(counts) < 1:
            raise ConfigError(f"num_layer_list {','.join(map(str, counts))} has an empty stage; "
                              f"every pipeline stage needs at least one layer.")
        if sum(counts) != arch.num_layers:
            raise ConfigError(f"num_layer_list {','.join(map(str, counts))} sums to {sum(counts)} but "
                              f"model {arch.name} has num_layers={arch.num_layers}; make them add up.")
    elif arch.num_layers % pp:
        raise ConfigError(
            f"num_layers={arch.num_layers} of model {arch.name} is not divisible by "
            f"pipeline_model_parallel_size={pp}; choose a PP that divides it or set num_layer_list.")
    _validate_latents(arch, par)
    validate_context_parallel(arch, par)
    if world_size is not None and world_size % par.model_ranks:
        sizes = f"{tp}×{pp}" + (f"×{par.cp}" if par.cp > 1 else "")
        names = "tensor_model_parallel_size × pipeline_model_parallel_size" + \
            (" × context_parallel_size" if par.cp > 1 else "")
        raise ConfigError(f"world size {world_size} is not divisible by {names} = {sizes}; use a device count that "
                          f"is a multiple of {par.model_ranks}.")
    validate_expert_parallel(arch, par, world_size)


def _validate_latents(arch: ModelArch, par: ParallelConfig) -> None:
    """Multi-latent attention's down projections are cut over TP by their outputs (the latents' widths)."""
    if not arch.multi_latent_attention or par.tp == 1:
        return
    for what, width in (("q_lora_rank", arch.q_lora_rank or 0),
                        ("kv_lora_rank + qk_pos_emb_head_dim", arch.kv_lora_rank + arch.qk_pos_emb_head_dim)):
        if width % par.tp:
            raise ConfigError(f"tensor_model_parallel_size={par.tp} does not divide model {arch.name}'s {what} = "
                              f"{width}, whose projection TP cuts by rows; choose a TP size that divides it.")


def validate_context_parallel(arch: ModelArch, par: ParallelConfig) -> None:
    """What a context-parallel split needs of the model: Ulysses gives each CP rank whole heads and key-value
    groups of its TP rank's share."""
    if par.cp == 1:
        return
    if arch.vision is not None:
        raise ConfigError(f"context_parallel_size={par.cp} cuts padding-free packed text sequences, but model "
                          f"{arch.name} is a vision-language model (its multimodal positions are per padded row); "
                          f"set context_parallel_size 1.")
    if par.cp_algo == "ulysses":
        for what, count in (("num_attention_heads", arch.num_attention_heads),
                            ("num_query_groups", arch.query_groups)):
            if count % (par.tp * par.cp):
                raise ConfigError(f"context_parallel_algo ulysses_cp_algo gives each of the TP × CP = {par.tp}×"
                                  f"{par.cp} ranks whole heads, but model {arch.name} has {what}={count}; use "
                                  f"megatron_cp_algo (ring attention, no head condition) or a TP × CP that divides "
                                  f"{count}.")


def validate_sequence_parallel(arch: ModelArch, par: ParallelConfig) -> None:
    """The models a Megatron worker cannot run (or cannot run without) sequence parallelism under TP. Not part of
    validate_parallel: a converter's or vLLM's layout never runs sequence-parallel."""
    if par.tp == 1:
        return
    if arch.is_moe and par.sequence_parallel is False:
        raise ConfigError(f"sequence_parallel is false, but model {arch.name} is a mixture of experts at "
                          f"tensor_model_parallel_size={par.tp}, which megatron-core trains only sequence-parallel; "
                          f"set sequence_parallel true (or leave it unset), or tensor_model_parallel_size 1.")
    if not par.sequence_parallel_for(arch):
        return
    if arch.normalization != "RMSNorm" and arch.is_moe:
        raise ConfigError(f"model {arch.name} is a mixture of experts with {arch.normalization}: at "
                          f"tensor_model_parallel_size={par.tp} it must run sequence-parallel, which torch's "
                          f"{arch.normalization} module does not in megatron-core; use tensor_model_parallel_size 1.")
    if arch.normalization != "RMSNorm":
        raise ConfigError(f"sequence_parallel needs RMSNorm, but model {arch.name} uses {arch.normalization} (torch's "
                          f"module, which megatron-core does not run sequence-parallel); set sequence_parallel false.")
    if arch.vision is not None:
        raise ConfigError(f"sequence_parallel is not built for vision-language models (model {arch.name}: its image "
                          f"features are placed in the whole sequence's embeddings); set it false.")


def validate_expert_parallel(arch: ModelArch, par: ParallelConfig, world_size: int | None = None) -> None:
    """The expert-parallel rules: EP and expert TP must fit the experts, the dispatcher and the ranks."""
    ep, tp = par.ep, par.tp
    if not arch.is_moe:
        if ep > 1:
            raise ConfigError(f"expert_model_parallel_size={ep} needs a mixture-of-experts model, but model "
                              f"{arch.name} has no num_experts; set expert_model_parallel_size to 1.")
        return
    if par.expert_tensor_parallel_size not in (None, tp):
        raise ConfigError(f"expert_tensor_parallel_size={par.expert_tensor_parallel_size} differs from "
                          f"tensor_model_parallel_size={tp}; mindrl cuts experts as it cuts the dense layers, so "
                          f"leave it unset or set it to {tp}.")
    if arch.num_experts % ep:
        raise ConfigError(f"expert_model_parallel_size={ep} does not divide num_experts={arch.num_experts} of "
                          f"model {arch.name}; choose an EP that divides it.")
    for key, width in (("moe_ffn_hidden_size", arch.expert_ffn_hidden_size),
                       ("moe_shared_expert_intermediate_size", arch.moe_shared_expert_intermediate_size)):
        if width and width % tp:
            raise ConfigError(f"tensor_model_parallel_size={tp} does not divide {key}={width} of model "
                              f"{arch.name}; choose a TP that divides it.")
    if world_size is not None and world_size % par.ranks_per_replica:
        raise ConfigError(
            f"world size {world_size} is not divisible by tensor × pipeline × expert parallel size = "
            f"{tp}×{par.pp}×{ep}; use a device count that is a multiple of {par.ranks_per_replica}.")
