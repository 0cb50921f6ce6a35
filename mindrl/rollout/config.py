"""`generate_config` and its `sampling_config` (MindSpeed-RL's names), validated before any engine starts.

Unknown keys are errors in both (MindSpeed-RL also refuses unknown sampling keys). Keys
MindSpeed-RL has only for Ascend graph modes, MoE or multimodal rollouts are refused by
name rather than ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mindrl.config.errors import ConfigError
from mindrl.config.keys import Keys, normalise
from mindrl.config.values import check_types

if TYPE_CHECKING:
    from mindrl.config import ModelArch, ParallelConfig
    from mindrl.platform.base import Platform

BACKENDS = ("auto", "vllm", "megatron")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# generate_config keys of MindSpeed-RL that ask for something mindrl's rollout does not do.
_UNSUPPORTED = {
    "ascend_scheduler_config_enabled": "the Ascend scheduler config",
    "num_scheduler_steps": "multi-step scheduling",
    "eplb_token_collects": "expert load balancing statistics",
    "eplb_token_save_path": "expert load balancing statistics",
    "limit_mm_image_per_prompt": "multimodal rollouts",
    "limit_mm_video_per_prompt": "multimodal rollouts",
}
# generate_config keys of MindSpeed-RL that choose how vLLM-Ascend computes, not what: Ascend's TorchAir graph mode
# and EPLB's placement of the experts over the engine's ranks (the same experts compute the same numbers anywhere).
_KERNEL_CHOICES = ("torchair_graph", "expert_map_path")
# Accepted for MindSpeed-RL files, with no effect (documented in docs/rollout.md).
_NO_EFFECT = frozenset({"data_parallel_size", "tokenizer_name_or_path", "trust_remote_code"})


@dataclass(frozen=True)
class SamplingConfig:
    """vLLM SamplingParams keys; `n` comes from rl_config.n_samples_per_prompt, not from here."""

    #: top log-probs per token besides the sampled one (the sampled token's own log-prob is always returned)
    logprobs: int = 1
    max_tokens: int = 128
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    temperature: float = 1.0
    detokenize: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        check_types("generate_config.sampling_config", self)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"sampling_config.max_tokens must be a positive integer, got {self.max_tokens!r}.")
        if not isinstance(self.logprobs, int) or self.logprobs < 0:
            raise ConfigError(f"sampling_config.logprobs must be an integer >= 0, got {self.logprobs!r}.")
        if not self.temperature > 0:
            raise ConfigError(f"sampling_config.temperature must be positive (greedy decoding is top_k: 1), "
                              f"got {self.temperature!r}.")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling_config.top_p must be in (0, 1], got {self.top_p!r}.")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ConfigError(f"sampling_config.top_k must be -1 (off) or a positive integer, got {self.top_k!r}.")
        if not 0 <= self.min_p < 1:
            raise ConfigError(f"sampling_config.min_p must be in [0, 1), got {self.min_p!r}.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ConfigError(f"sampling_config.seed must be an integer or null, got {self.seed!r}.")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], keys: Keys | None = None) -> SamplingConfig:
        """`keys` decides whether a key problem raises (the default) or is collected."""
        return cls(**(keys or Keys()).split("generate_config.sampling_config", values, _field_names(cls)))


@dataclass(frozen=True)
class GenerateConfig:
    """The rollout engine: which backend, its parallel layout and memory, and how weights reach it."""

    backend: str = "auto"
    infer_tensor_parallel_size: int = 1
    infer_pipeline_parallel_size: int = 1
    #: vLLM's expert parallelism: each MoE layer gives every rank of an engine a share of the experts instead of
    #: a TP cut of every expert; the share spans the engine's infer_tensor_parallel_size ranks
    enable_expert_parallel: bool = False
    #: MindSpeed-RL's name for the width of that split: with enable_expert_parallel, infer_tensor_parallel_size or
    #: a multiple of it, which widens each engine to that many ranks (`widened_from`)
    infer_expert_parallel_size: int = 1
    #: the engine's weights; auto: the actor's training precision (bfloat16 where it trains in bf16, else float32)
    dtype: str = "auto"
    max_num_seqs: int = 256
    max_model_len: int = 2048
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.5
    #: KV-cache bytes on CPU (vLLM-CPU sizes its cache by bytes, not by a device fraction)
    cpu_kv_cache_mb: int = 256
    enforce_eager: bool = True
    #: GRPO's n samples share their prompt: its whole KV blocks are prefilled once instead of n times
    enable_prefix_caching: bool = True
    offload_train_optimizer: bool = False
    offload_train_grad: bool = False
    offload_train_param: bool = False
    #: weights cross to the engine in buckets of at most this many MB (a larger tensor still goes, alone)
    weight_sync_bucket_mb: int = 512
    #: after every sync, compare a checksum of every tensor the engine holds with the actor's
    check_weight_sync: bool = False
    #: a mixture of experts: the engine records the experts each token was routed to and the actor's log-prob
    #: and update passes route the same way (rollout routing replay, R3); Megatron-native engine only
    rollout_routing_replay: bool = False
    #: a vision-language model: the most images one prompt may hold (vLLM's limit_mm_per_prompt for images)
    limit_mm_per_prompt: int = 1
    sampling_config: SamplingConfig = field(default_factory=SamplingConfig)
    #: the infer_tensor_parallel_size the file gave where a wider expert split widened the engine, else None
    widened_from: int | None = field(default=None, init=False, compare=False)

    def __post_init__(self) -> None:
        check_types("generate_config", self)
        if self.backend not in BACKENDS:
            raise ConfigError(f"generate_config.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}.")
        if self.dtype not in DTYPES:
            raise ConfigError(f"generate_config.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}.")
        for key in ("infer_tensor_parallel_size", "infer_pipeline_parallel_size", "infer_expert_parallel_size",
                    "max_num_seqs", "max_model_len",
                    "max_num_batched_tokens", "cpu_kv_cache_mb", "weight_sync_bucket_mb", "limit_mm_per_prompt"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"generate_config.{key} must be a positive integer, got {value!r}.")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"generate_config.max_num_batched_tokens={self.max_num_batched_tokens} is below "
                              f"max_num_seqs={self.max_num_seqs}, but each sequence in a step takes at least one token "
                              f"of it (vLLM refuses this); raise max_num_batched_tokens or lower max_num_seqs.")
        if self.infer_pipeline_parallel_size != 1:
            raise ConfigError("generate_config.infer_pipeline_parallel_size must be 1: rollout engines shard by "
                              "tensor parallelism only (as in MindSpeed-RL); raise infer_tensor_parallel_size.")
        self._check_expert_split()
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"generate_config.gpu_memory_utilization must be in (0, 1], got "
                              f"{self.gpu_memory_utilization!r}.")
        if self.sampling_config.max_tokens >= self.max_model_len:
            raise ConfigError(f"sampling_config.max_tokens={self.sampling_config.max_tokens} leaves no room for a "
                              f"prompt in max_model_len={self.max_model_len}; raise max_model_len.")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], keys: Keys | None = None) -> GenerateConfig:
        """`keys` decides whether a key problem raises (the default) or is collected."""
        keys = keys or Keys()
        values = normalise(values)
        for key, feature in _UNSUPPORTED.items():
            value = values.pop(key, None)
            if not _is_off(value):
                keys.problem("generate_config", f"generate_config.{key}={value!r} asks for {feature}, which "
                                                f"mindrl's rollout does not do; remove it.", key)
        for key in _KERNEL_CHOICES:
            value = values.pop(key, None)
            if not _is_off(value):
                keys.problem("generate_config", f"generate_config.{key}={value!r} picks a fused kernel or memory "
                                                f"layout, which vLLM chooses itself here; remove it.", key,
                             droppable=True)
        for key in _NO_EFFECT:
            values.pop(key, None)
        sampling = values.pop("sampling_config", None)
        kwargs = keys.split("generate_config", values, _field_names(cls))
        if sampling is not None:
            if not isinstance(sampling, Mapping):
                raise ConfigError(f"generate_config.sampling_config must be a mapping of keys, got {sampling!r}.")
            kwargs["sampling_config"] = SamplingConfig.from_dict(sampling, keys)
        return cls(**kwargs)

    def _check_expert_split(self) -> None:
        """MindSpeed-RL's wider split (infer_expert_parallel_size = k × infer_tensor_parallel_size) is vLLM's
        data-parallel attention: k engines, each holding all of attention, share their experts. mindrl's engines
        split experts over their own TP ranks, so the engine is widened to the expert split: every rank holds the
        same share of the experts of the same model, attention is cut where it was copied (less memory, one
        all-reduce more per layer; sums in another order). widening_notice says so. `widened_from` is the file's
        value for that sentence; a copy made by dataclasses.replace has none, its TP being the widened one."""
        ep, tp = self.infer_expert_parallel_size, self.infer_tensor_parallel_size
        if ep > 1 and not self.enable_expert_parallel:
            raise ConfigError(f"generate_config.infer_expert_parallel_size={ep} splits experts over vLLM's ranks, "
                              f"which vLLM does only with enable_expert_parallel: true; set it too (or the size "
                              f"back to 1).")
        if self.enable_expert_parallel and ep % tp:
            raise ConfigError(f"vLLM splits a mixture of experts over the ranks of one engine, so "
                              f"generate_config.infer_expert_parallel_size must equal infer_tensor_parallel_size="
                              f"{tp} or a multiple of it (which widens the engine to that many ranks), got {ep}.")
        if self.enable_expert_parallel and ep > tp:
            object.__setattr__(self, "widened_from", tp)
            object.__setattr__(self, "infer_tensor_parallel_size", ep)

    def check_engine_layout(self, arch: ModelArch, world_size: int) -> None:
        """vLLM's rules for an engine of infer_tensor_parallel_size ranks over `world_size` devices: whole query heads
        on each rank; key-value heads cut, or each copied to TP / groups ranks where TP exceeds them (as vLLM does);
        the MLPs cut evenly (the experts' only where they are not split whole); the devices filled with whole
        engines. A widened engine's width is named by the key that set it."""
        tp = self.infer_tensor_parallel_size
        where = ("generate_config.infer_tensor_parallel_size" if self.widened_from is None
                 else "generate_config.infer_expert_parallel_size (the widened engine's TP)")
        if arch.num_attention_heads % tp:
            raise ConfigError(f"{where}={tp} does not divide num_attention_heads={arch.num_attention_heads} of model "
                              f"{arch.name}; choose a TP that divides it.")
        groups = arch.query_groups
        if groups % tp and tp % groups:
            raise ConfigError(f"{where}={tp} neither divides num_query_groups={groups} (key-value heads) of model "
                              f"{arch.name} nor is a multiple of it (each head then goes to TP / {groups} ranks); "
                              f"choose one that is.")
        widths = {"ffn_hidden_size": arch.ffn_hidden_size,
                  "moe_shared_expert_intermediate_size": arch.moe_shared_expert_intermediate_size}
        if arch.is_moe and not self.enable_expert_parallel:
            widths["moe_ffn_hidden_size"] = arch.expert_ffn_hidden_size
        for key, width in widths.items():
            if width and width % tp:
                raise ConfigError(f"{where}={tp} does not divide {key}={width} of model {arch.name}; choose a TP "
                                  f"that divides it.")
        if world_size % tp:
            raise ConfigError(f"{where}={tp} does not divide the actor's {world_size} devices, which the engines "
                              f"share; use a multiple of {tp} devices or another TP.")

    def widening_notice(self) -> list[str]:
        """The sentence saying that the engine was widened to the expert split (none where it was not)."""
        if self.widened_from is None:
            return []
        ep = self.infer_expert_parallel_size
        return [f"generate_config.infer_expert_parallel_size={ep} over infer_tensor_parallel_size="
                f"{self.widened_from} asks for vLLM's data-parallel attention; mindrl's engines split experts over "
                f"their own ranks, so each engine spans {ep} ranks at tensor parallel {ep}: the same share of the "
                f"experts per rank and the same model, with attention cut {ep} ways instead of copied "
                f"(docs/rollout.md)."]

    def check_vllm_on(self, arch: ModelArch, platform: Platform | type[Platform]) -> None:
        """What vLLM cannot do: rotate YaRN positions past original context × factor (its table ends there); on
        some platforms (CPU) compute multi-latent attention as the model does, split a seeded prompt's prefill over
        steps, so one step must hold a whole sequence, or run a share of the experts (vLLM-CPU's grouped-GEMM
        kernel runs every expert on every rank: with a share it crashes); and the expert split needs experts to
        split."""
        from mindrl.models.rope import yarn_positions  # torch: loaded when an engine is checked, not with the config

        reach = yarn_positions(arch)
        if reach is not None and self.max_model_len > reach:
            raise ConfigError(f"generate_config.max_model_len={self.max_model_len} runs past the {reach} positions "
                              f"model {arch.name}'s YaRN scaling reaches (its original context times "
                              f"rope_scaling_factor), where vLLM's rotary table ends; lower it.")
        if arch.multi_latent_attention and not platform.vllm_runs_mla:
            raise ConfigError(f"vLLM's multi-latent attention on {platform.name} scores other log-probs than model "
                              f"{arch.name} (up to 1.3 apart from HF's DeepseekV3 in fp32), so its rollouts cannot "
                              f"train it; set generate_config.backend: megatron there.")
        if not platform.vllm_chunks_seeded_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(f"on {platform.name} vLLM cannot split a seeded prompt's prefill over steps, so "
                              f"generate_config.max_num_batched_tokens={self.max_num_batched_tokens} must be at "
                              f"least max_model_len={self.max_model_len}; raise it.")
        if not self.enable_expert_parallel:
            return
        if not arch.is_moe:
            raise ConfigError(f"generate_config.enable_expert_parallel splits the experts of a mixture of experts, "
                              f"but model {arch.name} has none; turn it off.")
        if arch.num_experts % self.infer_expert_parallel_size:
            raise ConfigError(f"generate_config.infer_expert_parallel_size={self.infer_expert_parallel_size} does "
                              f"not divide num_experts={arch.num_experts}; choose a divisor.")
        if not platform.vllm_splits_experts:
            raise ConfigError(f"vLLM's MoE kernel on {platform.name} cannot run a share of the experts, so "
                              f"generate_config.enable_expert_parallel must be false there (vLLM then cuts every "
                              f"expert by infer_tensor_parallel_size instead).")

    def engine_dtype(self, actor_bf16: bool) -> GenerateConfig:
        """This config with `dtype: auto` resolved to the actor's precision (an explicit dtype is kept)."""
        if self.dtype != "auto":
            return self
        return dataclasses.replace(self, dtype="bfloat16" if actor_bf16 else "float32")

    def offloads_anything(self) -> bool:
        return self.offload_train_param or self.offload_train_grad or self.offload_train_optimizer


TRUNCATE_SIDES = ("left", "right", "middle")


@dataclass(frozen=True)
class MultiTurnConfig:
    """The agent loop's limits (rl_config's multi-turn keys, MindSpeed-RL's names; docs/multi_turn.md)."""

    #: a trajectory stops asking for tools after this many calls (its next call ends it)
    max_tool_calls: int
    #: calls run from one model turn; the rest of that turn's calls get a tool response saying so
    max_parallel_calls: int
    #: tokens of the whole response, model and tool turns together
    max_total_response_length: int
    #: characters of one tool result the model sees; 0: the whole result
    max_tool_response_length: int
    #: which part of an over-long result goes: left keeps the head, right the tail, middle half of each
    tool_response_truncate_side: str
    tool_parser_format: str
    #: the tools (configs/tools/*.yaml); None: the built-in python and calculator tools
    tool_config_path: str | None = None

    def __post_init__(self) -> None:
        for key in ("max_tool_calls", "max_parallel_calls", "max_total_response_length"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"rl_config.{key} must be a positive integer with multi_turn_enable, got "
                                  f"{value!r}.")
        if isinstance(self.max_tool_response_length, bool) or not isinstance(self.max_tool_response_length, int) \
                or self.max_tool_response_length < 0:
            raise ConfigError(f"rl_config.max_tool_response_length must be an integer >= 0 (0: no cut), got "
                              f"{self.max_tool_response_length!r}.")
        if self.tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ConfigError(f"rl_config.tool_response_truncate_side must be one of {', '.join(TRUNCATE_SIDES)}, "
                              f"got {self.tool_response_truncate_side!r}.")


def _is_off(value: Any) -> bool:
    """MindSpeed-RL files carry these keys at their defaults: null, false, 0 / 1 sizes, "./" paths.
    `true == 1` in Python, so booleans are told apart from sizes here."""
    if isinstance(value, bool):
        return not value
    return value is None or value == "./" or (isinstance(value, int) and value in (0, 1))


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def check_megatron_rollout(arch: ModelArch, par: ParallelConfig, record_routes: bool = False) -> None:
    """The layouts this engine decodes. A sequence-parallel model (an MoE one under TP) decodes in plain TP
    (megatron_engine.plain_tensor_parallel); recording its routes there is not built."""
    if record_routes and not arch.is_moe:
        raise ConfigError(f"generate_config.rollout_routing_replay replays the experts a mixture of experts routed "
                          f"to, but model {arch.name} has none; turn it off.")
    if record_routes and par.tp > 1:
        raise ConfigError(f"generate_config.rollout_routing_replay records routes at tensor_model_parallel_size 1; "
                          f"run the actor at TP 1 (not {par.tp}) or turn it off.")
    if record_routes and par.pp > 1:
        raise ConfigError(f"generate_config.rollout_routing_replay records routes on one pipeline stage; run the "
                          f"actor at pipeline_model_parallel_size 1 (not {par.pp}) or turn it off.")


VLLM_ROUTES = ("generate_config.rollout_routing_replay needs the experts each sampled token was routed to, which "
               "vLLM returns only from its GPU model runner and mindrl does not read from it yet; use backend "
               "megatron for routing replay, or turn it off.")


def sampling_for_step(sampling: SamplingConfig, step: int, attempt: int = 0) -> SamplingConfig:
    """Each rollout round samples with its own seeds (a fixed seed would repeat the same draws every
    step), derived from the configured one so that a resumed run draws what an uninterrupted one did."""
    if sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed + 1_000_003 * step + 7_919 * attempt)
