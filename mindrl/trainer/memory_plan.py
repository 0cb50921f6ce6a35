"""What each device of an RL run holds, from the architecture and the config alone, before Ray starts.

A long-response run that does not fit fails an hour in, at the first 20k-token micro-batch, on every rank at once;
the arithmetic that predicts it needs no device. Per device group (the actor with the roles colocated with it, and
each role on devices of its own) and per phase (the updates, the forward passes, the generation), the plan sums:

- weights, gradients (Megatron's fp32 grad buffer) and optimizer state (Adam's moments, and fp32 master weights
  under bf16; the distributed optimizer's data-parallel share), of the pipeline stage that holds the most;
- activations the backward keeps, at the pass's largest micro-batch (the token budget, else micro_batch_size rows
  of the longest prompt and response), times the micro-batches 1F1B keeps in flight on that stage, with the
  configured recompute, counted tensor by tensor as mindrl's layers keep them on that kind of device
  (tests/test_memory_plan.py checks the count against the tensors autograd saves);
- the logits a pass materialises (fp32, vocabulary cut over TP);
- between phases, what `offload_train_*` moves to host memory, and the rollout engine: under
  `gpu_memory_utilization` of each device (weights over infer TP x PP, the rest KV cache).

A device holds what its busiest phase needs; a config whose peak exceeds the device's memory is refused in one
sentence naming the largest term and the key that shrinks it. Device memory comes from `DEVICE_MEMORY_GIB` by
resource kind, `rl_config.device_memory_gib` overriding it; a CPU rank gets its share of this machine's memory.
What the plan cannot see: allocator fragmentation and caching, communication buffers (NCCL / HCCL), fused kernels'
workspaces, a vision tower's weights and activations, a mixture of experts' routing imbalance (it assumes every
expert gets its share of tokens), and on CPU the score matrices of samples short enough for the matmul path
(docs/memory_plan.md).
"""
from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass

from mindrl.config import ConfigError, ModelArch, ParallelConfig
from mindrl.config.lora import LoraConfig
from mindrl.config.recompute import Recompute
from mindrl.models.flops import latent_attention_weights
from mindrl.trainer.grpo_config import TrainerConfig, max_response_length
from mindrl.trainer.megatron import MegatronConfig
from mindrl.trainer.rl import RLConfig

GIB = 2 ** 30
#: one device's memory (GiB) by Ray resource kind: the common parts (Ascend 910B / A3 dies 64 GiB, H100 / A100 80
#: GiB); `rl_config.device_memory_gib` sets another. A CPU rank's is its share of this machine's memory.
DEVICE_MEMORY_GIB = {"NPU": 64.0, "GPU": 80.0}


@dataclass(frozen=True)
class Kernels:
    """What the attention core keeps on a kind of device."""

    #: each key/value group repeated for its query heads (the platform gives scaled_dot_product_attention no groups)
    expanded_kv: bool
    #: a sample behind a shared prompt copy runs the prompt's queries again (CPU: the plain causal case)
    prefix_queries: bool
    #: values narrower than the keys (multi-latent attention) are zero-padded to their width (CPU: the flash kernel
    #: takes one head size), so the core keeps values and output that wide
    padded_values: bool = False


def kernels(kind: str) -> Kernels:
    """The attention core's behaviour on devices of Ray resource `kind`, as the platform's class sets it."""
    from mindrl.platform.cpu import CpuPlatform
    from mindrl.platform.cuda import CudaPlatform
    from mindrl.platform.npu import NpuPlatform

    platform = {"GPU": CudaPlatform, "NPU": NpuPlatform}.get(kind, CpuPlatform)
    cpu = platform is CpuPlatform
    return Kernels(expanded_kv=not platform.sdpa_enable_gqa, prefix_queries=cpu, padded_values=cpu)


@dataclass(frozen=True)
class Term:
    """One thing a device holds, per device, and the key that shrinks it."""

    name: str
    bytes: float
    fix: str


@dataclass(frozen=True)
class Phase:
    name: str
    terms: tuple[Term, ...]

    @property
    def total(self) -> float:
        return sum(term.bytes for term in self.terms)

    def culprit(self, capacity: float) -> tuple[Term, float | None]:
        """The term to shrink first, and the state's total where that decided it: the largest of the weights,
        gradients and optimizer state, which stay whatever the micro-batch, where they alone exceed `capacity`;
        else the largest of all (and None)."""
        state = [t for t in self.terms if t.name.split()[-1] in ("weights", "gradients", "optimizer")]
        total = sum(t.bytes for t in state)
        if total > capacity:
            return max(state, key=lambda term: term.bytes), total
        return max(self.terms, key=lambda term: term.bytes), None


@dataclass(frozen=True)
class GroupPlan:
    """One group of devices: `ranks` devices of `kind`, each of `capacity` bytes, through its phases."""

    group: str
    kind: str
    ranks: int
    capacity: float
    phases: tuple[Phase, ...]
    #: host memory each rank needs for what it offloads between phases
    offloaded: float = 0.0
    #: the rollout engine's KV cache per device (tokens it holds), where it runs here
    kv_cache: tuple[float, int] | None = None

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda phase: phase.total)

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.capacity


# --- the arithmetic: one model on one rank ------------------------------------------------------------------------


def layer_params(arch: ModelArch, tp: int, ep: int) -> tuple[float, float]:
    """(dense, expert) parameters of one transformer layer on one rank."""
    h, q, kv = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.query_groups * arch.head_dim
    if arch.multi_latent_attention:  # the latents' norms are replicated
        attention = latent_attention_weights(arch) / tp + 2 * h + (arch.q_lora_rank or 0) + arch.kv_lora_rank
    else:
        attention = (h * (q + 2 * kv) + (q + 2 * kv) * arch.add_qkv_bias + q * h) / tp + 2 * h
        attention += 2 * arch.head_dim * arch.qk_layernorm
    if not arch.is_moe:
        return attention + (3 if arch.swiglu else 2) * h * arch.ffn_hidden_size / tp, 0.0
    shared = 3 * h * (arch.moe_shared_expert_intermediate_size or 0) / tp + h * arch.moe_shared_expert_gate
    experts = arch.num_experts * 3 * h * arch.expert_ffn_hidden_size / (ep * tp)
    bias = arch.num_experts if arch.moe_router_enable_expert_bias else 0  # a frozen parameter, counted as weights
    router = h * arch.num_experts + bias
    return attention + router + shared, experts


def stage_params(arch: ModelArch, par: ParallelConfig, stage: int) -> tuple[float, float]:
    """(dense, expert) parameters one rank of pipeline stage `stage` holds: its layers, the embedding on the first
    stage, the final norm and the output layer (or score head) on the last (a tied LM head is a second copy of the
    embedding there when PP > 1)."""
    first, layers = par.first_layer_of_stages(arch)[stage], par.layers_per_stage(arch)[stage]
    per_layer = [layer_params(arch.layer_arch(i), par.tp, par.ep) for i in range(first, first + layers)]
    dense, expert = sum(d for d, _ in per_layer), sum(e for _, e in per_layer)
    vocab = arch.vocab_size_for(par.tp) * arch.hidden_size / par.tp
    if stage == 0:
        dense += vocab
    if stage == par.pp - 1:
        dense += arch.hidden_size
        if arch.has_score_head:
            dense += arch.hidden_size * arch.num_labels
        elif arch.has_output_layer or par.pp > 1:
            dense += vocab
    return dense, expert


def model_state(arch: ModelArch, par: ParallelConfig, stage: int, ranks: int, bf16: bool, trains: bool,
                distributed_optimizer: bool = True, lora: LoraConfig | None = None) -> dict[str, float]:
    """Bytes one rank of `stage` holds for its weights and, if it trains, the fp32 grad buffer and Adam's two
    moments (with fp32 master weights under bf16), the distributed optimizer's data-parallel share of them (the
    experts' over their own data-parallel ranks). Under LoRA only the adapters train, in their weights' dtype."""
    dense, expert = stage_params(arch, par, stage)
    weights = (dense + expert) * (2 if bf16 else 4)
    if not trains:
        return {"weights": weights}
    if lora is not None and lora.enabled:
        dense = lora_params(arch, lora.target_modules, lora.r, par.tp, par.ep, par.layers_per_stage(arch)[stage])
        expert = 0.0
        weights += dense * (2 if bf16 else 4)  # adapters take their weight's dtype
    dp = max(ranks // (par.tp * par.pp), 1)  # the distributed optimizer shards over the DP and CP ranks together
    expert_dp = max(ranks // (par.pp * par.ep * par.tp), 1)
    share = dense / dp + expert / expert_dp if distributed_optimizer else dense + expert
    return {"weights": weights, "gradients": (dense + expert) * 4, "optimizer": share * (12 if bf16 else 8)}


def lora_params(arch: ModelArch, targets: tuple[str, ...], r: int, tp: int, ep: int, layers: int) -> float:
    """Adapter parameters (A and B of every targeted projection) of `layers` layers on one rank; a mixture of
    experts' MLP projections are its local experts'."""
    h, q, kv = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.query_groups * arch.head_dim
    ffn = arch.expert_ffn_hidden_size if arch.is_moe else arch.ffn_hidden_size
    copies = {"linear_fc1": arch.num_experts // ep, "linear_fc2": arch.num_experts // ep} if arch.is_moe else {}
    column = {"linear_qkv": (h, q + 2 * kv), "linear_fc1": (h, ffn * (2 if arch.swiglu else 1))}
    row = {"linear_proj": (q, h), "linear_fc2": (ffn, h)}
    per_layer = sum(r * (i + o / tp) * copies.get(name, 1) for name, (i, o) in column.items() if name in targets) + \
        sum(r * (i / tp + o) * copies.get(name, 1) for name, (i, o) in row.items() if name in targets)
    return per_layer * layers


def attention_core_elements(arch: ModelArch, tp: int, kernels: Kernels, selective: bool = False) -> float:
    """Elements the attention core keeps per query row: query, keys, values (each group's repeated for its heads
    where the platform's kernel does not take groups; as wide as the keys where it pads them), output and
    log-sum-exp; none under selective recompute, which runs it again in the backward."""
    d, heads, groups = arch.head_dim, arch.num_attention_heads, arch.query_groups
    v = max(d, arch.value_head_dim) if kernels.padded_values else arch.value_head_dim
    kv_heads = heads if kernels.expanded_kv else groups
    return 0.0 if selective else (heads * (d + v) + kv_heads * (d + v) + heads) / tp


def _recomputed_core_inputs(arch: ModelArch, tp: int) -> float:
    """Per token, what selective recompute keeps to run the attention core again: the rotated queries and keys,
    and the values."""
    return (arch.num_attention_heads * arch.head_dim + arch.query_groups * (arch.head_dim + arch.value_head_dim)) / tp


def layer_activation_elements(arch: ModelArch, tp: int, sequence_parallel: bool, kernels: Kernels,
                              selective: bool = False) -> float:
    """Elements one layer keeps for its backward, per token of a micro-batch, on one rank.

    The norms' inputs (cut over TP under sequence parallelism), the projections' inputs, the rotary tables, the
    attention core's (attention_core_elements; under selective recompute its inputs), the SwiGLU's input and
    product; an expert layer's router tables and, per routed token, its expert's input and
    SwiGLU. (The QK norms' inputs are views of the QKV projection's output, which they keep whole.)
    """
    h, d, heads, groups = arch.hidden_size, arch.head_dim, arch.num_attention_heads, arch.query_groups
    cut = tp if sequence_parallel else 1
    kept = h * 4 / cut + heads * d / tp + 4 * arch.rotary_dim * (arch.position_embedding_type != "learned_absolute")
    kept += attention_core_elements(arch, tp, kernels, selective)
    kept += _recomputed_core_inputs(arch, tp) * selective
    if arch.multi_latent_attention:  # each latent's norm input and up projection's input: whole on every TP rank,
        # or its share of the sequence under sequence parallelism (the up projection gathers it again)
        kept += 2 * ((arch.q_lora_rank or 0) + arch.kv_lora_rank) / cut
    elif arch.qk_layernorm:
        kept += (3 * (heads + groups) * d + heads + groups) / tp
    if not arch.is_moe:
        return kept + (3 if arch.swiglu else 2) * arch.ffn_hidden_size / tp
    shared = arch.moe_shared_expert_intermediate_size or 0
    routed = arch.moe_router_topk * (h + 4 * arch.expert_ffn_hidden_size / tp + 1)
    return kept + 3 * arch.num_experts + routed + 2 * arch.moe_router_topk + (3 * shared / tp + h) * bool(shared)


def activation_bytes(arch: ModelArch, par: ParallelConfig, stage: int, tokens: float, in_flight: int,
                     recompute: Recompute, act_bytes: int, kernels: Kernels, prefix_rows: float = 0.0) -> float:
    """What one rank of `stage` keeps for the backward while `in_flight` micro-batches of `tokens` tokens wait for
    theirs (1F1B keeps PP - stage of them on a stage), plus the one layer (group) a recompute rebuilds at a time.
    `prefix_rows`: the attention rows a micro-batch adds for the samples behind a prompt copy they share (each
    attends over the prompt's keys and values, and on CPU runs the prompt's queries again)."""
    layers = par.layers_per_stage(arch)[stage]
    sp = par.sequence_parallel_for(arch)
    kv_heads = arch.num_attention_heads if kernels.expanded_kv else arch.query_groups
    per_prefix_row = attention_core_elements(arch, par.tp, kernels) if kernels.prefix_queries else \
        2 * kv_heads * arch.head_dim / par.tp

    # ring attention keeps its merged output and log-sum-exp in fp32 (counted above in the activations' dtype)
    ring = (arch.num_attention_heads * arch.head_dim + arch.num_attention_heads) / par.tp * (4 / act_bytes - 1) \
        if par.cp > 1 and par.cp_algo == "ring" else 0.0

    def per_layer(selective: bool) -> float:
        return ((_largest_layer(arch, par.tp, sp, kernels, selective) + ring * (not selective)) * tokens
                + per_prefix_row * prefix_rows * (not selective)) * act_bytes

    full = per_layer(False)
    layer_input = arch.hidden_size / (par.tp if sp else 1) * act_bytes * tokens
    if recompute.granularity == "selective":
        return layers * per_layer(True) * in_flight + full - per_layer(True)
    if recompute.granularity == "full":
        n = min(recompute.num_layers or 1, layers)
        if recompute.method == "block":  # the first n layers keep their input, one of them is rebuilt at a time
            return (n * layer_input + (layers - n) * full) * in_flight + (full if n else 0.0)
        return math.ceil(layers / n) * layer_input * in_flight + n * full
    return layers * full * in_flight


def logits_bytes(arch: ModelArch, tp: int, tokens: float, backward: bool) -> float:
    """The LM head's output over the micro-batch in fp32 (vocabulary cut over TP) and the log-softmax the loss
    keeps; in an update, also their gradients (4 copies in all, as measured); a score head's are a few per token."""
    outputs = arch.num_labels if arch.has_score_head else arch.vocab_size_for(tp) / tp
    return tokens * outputs * 4 * (4 if backward else 2)


def forward_bytes(arch: ModelArch, par: ParallelConfig, tokens: float, act_bytes: int, kernels: Kernels) -> float:
    """A pass without backward over a micro-batch of `tokens`: one layer's tensors at a time, and the logits."""
    sp = par.sequence_parallel_for(arch)
    layer = _largest_layer(arch, par.tp, sp, kernels) * act_bytes
    return tokens * layer + logits_bytes(arch, par.tp, tokens, False)


def _largest_layer(arch: ModelArch, tp: int, sequence_parallel: bool, kernels: Kernels,
                   selective: bool = False) -> float:
    """layer_activation_elements of the larger kind of `arch`'s layers (an MoE model's dense first layers may keep
    more than its expert layers: DeepSeek-V3's dense MLP is 18432 wide): a bound every layer of a stage keeps within."""
    return max(layer_activation_elements(kind, tp, sequence_parallel, kernels, selective)
               for kind in {arch.layer_arch(0), arch})


# --- the plan of a run ---------------------------------------------------------------------------------------------


def device_memory(kind: str, ranks_here: int, override_gib: float | None) -> float:
    """One device's bytes: the key's, the table's, or (CPU) this machine's memory over the ranks it runs."""
    if override_gib is not None:
        return override_gib * GIB
    if kind in DEVICE_MEMORY_GIB:
        return DEVICE_MEMORY_GIB[kind] * GIB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(ranks_here, 1)


@dataclass(frozen=True)
class _Model:
    """One Megatron role on its ranks: what its weights, gradients and optimizer state cost per device."""

    section: str
    cfg: MegatronConfig
    ranks: int
    bf16: bool
    trains: bool

    @property
    def label(self) -> str:
        """The role's name in the plan and in its *_resource key."""
        return {"ref_config": "reference"}.get(self.section, self.section.removesuffix("_config"))

    @property
    def par(self) -> ParallelConfig:
        return self.cfg.parallel

    @property
    def arch(self) -> ModelArch:
        return self.cfg.arch

    def stage(self) -> int:
        """The pipeline stage whose state is largest (its activations weigh in separately)."""
        return max(range(self.par.pp), key=lambda s: sum(stage_params(self.arch, self.par, s)))

    def state(self, stage: int) -> dict[str, float]:
        return model_state(self.arch, self.par, stage, self.ranks, self.bf16, self.trains,
                           self.cfg.use_distributed_optimizer, self.cfg.lora)


def _bf16(cfg: MegatronConfig, kind: str) -> bool:
    """bf16: auto counts as bf16 on accelerators (where it is the fast path) and fp32 on CPU, mindrl's default."""
    return cfg.bf16 is True or (cfg.bf16 == "auto" and kind != "CPU")


def _state_fix(model: _Model, term: str) -> str:
    """The key that shrinks a model's weights, gradients or optimizer state on each device."""
    section = model.section
    par = f"{section}.tensor_model_parallel_size / pipeline_model_parallel_size"
    if not model.trains:
        return f"rl_config.{model.label}_resource (devices of its own) or {par}"
    if term == "optimizer":
        if not model.cfg.use_distributed_optimizer:
            return f"{section}.use_distributed_optimizer: true"
        return f"more devices in rl_config.{model.label}_resource (the distributed optimizer shards it over " \
               f"data-parallel ranks) or {par}"
    return par if term == "weights" else f"{par} (or LoRA: {section}.lora_target_modules)"


def _batch_fix(rl: RLConfig, role: str, rows_key: str) -> str:
    """The key that shrinks a pass's micro-batch: its token budget, else its rows."""
    if rl.use_dynamic_bsz:
        return f"rl_config.{role}_max_packing_token_size"
    return f"{rows_key} (or rl_config.use_dynamic_bsz with a token budget)"


def plan(cfg: TrainerConfig) -> list[GroupPlan]:
    """Every device group's plan; `check(plan(cfg))` refuses what does not fit."""
    rl, gen = cfg.rl_config, cfg.generate_config
    prompt, response = rl.max_prompt_length, max_response_length(rl, gen)
    shares_prompt = _shares_prompt(cfg)
    ranks_here = cfg.devices_held()
    out = []
    for group, resource in cfg.device_groups():
        kind, ranks = resource.kind, resource.count
        capacity = device_memory(kind, ranks_here, rl.device_memory_gib)
        if group == "rollout":
            engine, kv = _engine(cfg, capacity, kind)
            out.append(GroupPlan(group, kind, ranks, capacity, (Phase("generation", engine),), kv_cache=kv))
            continue
        out.append(_training_group(cfg, group, kind, ranks, capacity, prompt, response, shares_prompt))
    return out


def _shares_prompt(cfg: TrainerConfig) -> bool:
    """Whether a prompt's samples sit behind one copy of it in a micro-batch: always in the padding-free passes
    (unless prompt_packing is off, or rows carry replayed routes); in padded rows only where prompt_packing is on
    and the model has neither sequence parallelism nor a vision tower (under `auto` a pass decides by its FLOPs,
    which the plan cannot know: counted unshared)."""
    rl, actor = cfg.rl_config, cfg.actor_config
    if rl.n_samples_per_prompt < 2 or rl.packing_mode == "off" or cfg.generate_config.rollout_routing_replay:
        return False
    if rl.use_remove_padding:
        return True
    return rl.packing_mode == "on" and not actor.parallel.sequence_parallel_for(actor.arch) and \
        actor.arch.vision is None


def _micro_batch(rows: int, budget: int | None, max_rows: int | None, prompt: int, response: int,
                 shares_prompt: bool, n_samples: int) -> tuple[int, int]:
    """A pass's largest micro-batch of the longest prompt and response: its tokens, and the attention rows its
    samples behind a shared prompt copy add (activation_bytes). `rows` rows, a prompt's samples behind one copy of
    it where `shares_prompt` (a micro-batch that does not line up with the prompts' groups holds a part of one more);
    under a token budget, the budget (a longer sample goes alone) or `max_rows` rows, whichever is less."""
    def tokens(r: int, copies: int) -> int:
        return copies * prompt + r * response if shares_prompt else r * (prompt + response)

    def worst(r: int) -> int:  # micro-batches start every r rows; the prompts' groups every n_samples
        return tokens(r, max((k * r + r - 1) // n_samples - k * r // n_samples + 1 for k in range(n_samples)))

    if not budget:
        total = worst(rows)
    else:
        rows = 1  # the most rows the budget holds: a prompt's samples together, one copy among them
        while (max_rows is None or rows < max_rows) and tokens(rows + 1, -(-(rows + 1) // n_samples)) <= budget:
            rows += 1
        total = max(budget, prompt + response) if max_rows is None else min(max(budget, prompt + response),
                                                                             worst(max_rows))
    sharing = rows if shares_prompt and -(-rows // n_samples) < rows else 0
    return total, sharing * prompt


def _training_group(cfg: TrainerConfig, group: str, kind: str, ranks: int, capacity: float, prompt: int,
                    response: int, shares_prompt: bool) -> GroupPlan:
    rl, gen = cfg.rl_config, cfg.generate_config
    names = group.split("+")
    core = kernels(kind)
    models: list[_Model] = []
    for name in names:
        if name == "actor":
            models.append(_Model("actor_config", cfg.actor_config, ranks, _bf16(cfg.actor_config, kind), True))
        elif name == "reference" and not cfg.actor_config.lora.enabled:
            models.append(_Model("ref_config", cfg.ref_config, ranks, _bf16(cfg.ref_config, kind), False))
        elif name == "reward":
            models.append(_Model("reward_config", cfg.reward_config, ranks, _bf16(cfg.reward_config, kind), False))
        elif name == "critic":
            models.append(_Model("critic_config", cfg.critic_config, ranks, _bf16(cfg.critic_config, kind), True))
    if "actor" in names and rl.uses_reference and rl.use_integrated_worker and not cfg.actor_config.lora.enabled:
        models.append(_Model("ref_config", cfg.ref_config, ranks, _bf16(cfg.ref_config, kind), False))
    if "actor" in names and cfg.critic_config is not None and not cfg.critic_on_own_devices:
        models.append(_Model("critic_config", cfg.critic_config, ranks, _bf16(cfg.critic_config, kind), True))
    resident: list[Term] = []
    offloadable: dict[str, float] = {}
    offload_keys = {"weights": "offload_train_param", "gradients": "offload_train_grad",
                    "optimizer": "offload_train_optimizer"}
    swapped: dict[str, str] = {}  # swap_optimizer: a model's optimizer state is on the device for its step only
    for model in models:
        for name, value in model.state(model.stage()).items():
            if name == "optimizer" and model.cfg.swap_optimizer:
                swapped[model.label] = _state_fix(model, name)
                continue
            resident.append(Term(f"{model.label} {name}", value, _state_fix(model, name)))
            offloadable[f"{model.label} {name}"] = value if getattr(gen, offload_keys[name]) else 0.0
    phases = []
    for model in (m for m in models if m.trains):
        role = "update" if model.label == "actor" else "critic"
        batching = rl.batching(role)
        tokens, extra = _micro_batch(model.cfg.micro_batch_size, batching.max_tokens, batching.max_rows, prompt,
                                     response, shares_prompt, rl.n_samples_per_prompt)
        tokens, extra = _cp_share(tokens, model.par.cp), extra / model.par.cp
        dp = max(ranks // model.par.model_ranks, 1)
        mini = (rl.mini_batch_size if role == "update" else rl.critic_mini_batch_size or rl.mini_batch_size)
        rows_per_micro = 1 if batching.max_tokens else model.cfg.micro_batch_size
        micro_batches = max(mini * rl.n_samples_per_prompt // dp // rows_per_micro, 1)
        worst = max(range(model.par.pp), key=lambda s: _stage_peak(model, s, tokens, micro_batches, core, extra))
        state = {f"{model.label} {k}": v for k, v in model.state(worst).items()}
        terms = [Term(t.name, state.get(t.name, t.bytes), t.fix) for t in resident]
        act = activation_bytes(model.arch, model.par, worst, tokens, min(model.par.pp - worst, micro_batches),
                               model.cfg.recompute, 2 if model.bf16 else 4, core, extra)
        fix = _batch_fix(rl, role, f"{model.section}.micro_batch_size")
        terms.append(Term(f"{model.label} activations ({_tokens_text(tokens, model.par.cp)})", act,
                          fix if model.cfg.recompute_granularity else f"{model.section}.recompute_granularity: full"))
        if worst == model.par.pp - 1:
            terms.append(Term(f"{model.label} logits", logits_bytes(model.arch, model.par.tp, tokens, True), fix))
        phases.append(Phase(f"{model.label} update", tuple(terms)))
        if model.label in swapped:  # on the stage holding the most state, as the resident terms are counted
            step = Term(f"{model.label} optimizer", model.state(model.stage())["optimizer"], swapped[model.label])
            phases.append(Phase(f"{model.label} optimizer step", (*resident, step)))
    forward = _forward_phase(cfg, models, resident, prompt, response, shares_prompt, core)
    if forward is not None:
        phases.append(forward)
    engine_kv = None
    offloaded = sum(offloadable.values())
    if "actor" in names and "rollout" not in {g for g, _ in cfg.device_groups()}:
        engine, engine_kv = _engine(cfg, capacity, kind)
        if kind == "CPU":  # vLLM cannot sleep there: its weights and KV cache stay while the actor trains
            phases = [Phase(p.name, (*p.terms, *engine)) for p in phases]
        kept = [t for t in resident if not offloadable.get(t.name)]
        phases.append(Phase("generation", (*kept, *engine)))
    return GroupPlan(group, kind, ranks, capacity, tuple(phases), offloaded, engine_kv)


def _cp_share(tokens: int, cp: int) -> int:
    """A CP rank's share of a micro-batch's tokens (each sample cut in 2 × CP chunks, the shares padded alike)."""
    return -(-tokens // cp)


def _tokens_text(tokens: int, cp: int) -> str:
    return f"{tokens} tokens a micro-batch" + (f" on each of {cp} CP ranks" if cp > 1 else "")


def _stage_peak(model: _Model, stage: int, tokens: int, micro_batches: int, core: Kernels, extra: int) -> float:
    act = activation_bytes(model.arch, model.par, stage, tokens, min(model.par.pp - stage, micro_batches),
                           model.cfg.recompute, 2 if model.bf16 else 4, core, extra)
    logits = logits_bytes(model.arch, model.par.tp, tokens, True) if stage == model.par.pp - 1 else 0.0
    return sum(model.state(stage).values()) + act + logits


def _forward_phase(cfg: TrainerConfig, models: list[_Model], resident: list[Term], prompt: int, response: int,
                   shares_prompt: bool, core: Kernels) -> Phase | None:
    """The log-prob, value and reward passes: no backward, so one layer's tensors at a time and the logits."""
    rl = cfg.rl_config
    worst: Term | None = None
    for model in models:
        role = {"reference": "ref"}.get(model.label, model.label)
        rows_key = f"rl_config.{role}_forward_micro_batch_size" if role in ("actor", "ref") else \
            f"{model.section}.micro_batch_size"
        rows = {"actor": rl.actor_forward_micro_batch_size, "ref": rl.ref_forward_micro_batch_size}.get(role) or \
            model.cfg.micro_batch_size
        batching = rl.batching(role)
        tokens, _ = _micro_batch(rows, batching.max_tokens, batching.max_rows, prompt, response, shares_prompt,
                                 rl.n_samples_per_prompt)
        tokens = _cp_share(tokens, model.par.cp)
        need = forward_bytes(model.arch, model.par, tokens, 2 if model.bf16 else 4, core)
        if worst is None or need > worst.bytes:
            worst = Term(f"{model.label} forward ({_tokens_text(tokens, model.par.cp)})", need,
                         _batch_fix(rl, role, rows_key))
    if worst is None:
        return None
    return Phase("forward passes", (*resident, worst))


def _kv_bytes_per_token(arch: ModelArch, tp: int, pp: int, bytes_per: int, latent: bool = False) -> float:
    """One token's keys and values on one rank: its stage's layers, its share of the KV heads (a whole head where
    TP outnumbers them: each rank holds a copy). `latent`: vLLM's multi-latent attention caches each token's latent
    and rotated key instead, whole on every TP rank."""
    layers = math.ceil(arch.num_layers / pp)
    if latent and arch.multi_latent_attention:
        return layers * (arch.kv_lora_rank + arch.qk_pos_emb_head_dim) * bytes_per
    return layers * max(arch.query_groups // tp, 1) * (arch.head_dim + arch.value_head_dim) * bytes_per


def _engine(cfg: TrainerConfig, capacity: float, kind: str) -> tuple[tuple[Term, ...], tuple[float, int]]:
    """The rollout engine on one device, and its KV cache (bytes, tokens). vLLM: under gpu_memory_utilization its
    weights (over infer TP x PP), its profiling forward over max_num_batched_tokens and the rest KV cache; on CPU
    its weights and cpu_kv_cache_mb. The Megatron-native engine generates with the actor's own weights: its KV
    cache for max_num_seqs rows of max_model_len."""
    gen, actor = cfg.generate_config, cfg.actor_config
    arch = actor.arch
    bytes_per = 4 if gen.dtype == "float32" or (gen.dtype == "auto" and not _bf16(actor, kind)) else 2
    backend = gen.backend if gen.backend != "auto" else \
        ("vllm" if importlib.util.find_spec("vllm") is not None else "megatron")
    if backend == "megatron":
        par = actor.parallel
        kv = gen.max_num_seqs * gen.max_model_len * _kv_bytes_per_token(arch, par.tp, par.pp, bytes_per)
        key = "generate_config.max_num_seqs / max_model_len"
        return (Term("engine KV cache", kv, key),), (kv, gen.max_num_seqs * gen.max_model_len)
    tp, pp = gen.infer_tensor_parallel_size, gen.infer_pipeline_parallel_size
    weights = sum(stage_params(arch, ParallelConfig(1, 1), 0)) * bytes_per / (tp * pp)
    per_token = _kv_bytes_per_token(arch, tp, pp, bytes_per, latent=True)
    weights_term = Term("engine weights", weights, "generate_config.infer_tensor_parallel_size")
    if kind == "CPU":
        kv = gen.cpu_kv_cache_mb * 2 ** 20
        kv_term = Term("engine KV cache", kv, "generate_config.cpu_kv_cache_mb")
        return (weights_term, kv_term), (kv, int(kv // per_token))
    # vLLM's profiling forward over max_num_batched_tokens: hidden states and one layer's MLP at a time; the
    # sampler's fp32 logits (and their softmax) for max_num_seqs rows
    inner = arch.expert_ffn_hidden_size * arch.moe_router_topk if arch.is_moe else arch.ffn_hidden_size
    profile = gen.max_num_batched_tokens * (2 * arch.hidden_size + 3 * inner / tp) * bytes_per + \
        gen.max_num_seqs * arch.vocab_size_for(1) * 4 * 2
    kv = max(gen.gpu_memory_utilization * capacity - weights - profile, 0.0)
    return (weights_term, Term("engine profiling pass", profile, "generate_config.max_num_batched_tokens"),
            Term("engine KV cache", kv, "generate_config.gpu_memory_utilization")), (kv, int(kv // per_token))


# --- refusing and printing -----------------------------------------------------------------------------------------


def check(plans: list[GroupPlan], cfg: TrainerConfig) -> None:
    """Refuse, in one sentence, a group whose busiest phase exceeds its devices, or a vLLM engine with no room for
    one sequence's KV cache."""
    gen = cfg.generate_config
    for p in plans:
        if not p.fits:
            phase = p.peak
            big, state = phase.culprit(p.capacity)
            where = f"the {p.group} devices ({p.kind}, {gib(p.capacity)} GiB each; rl_config.device_memory_gib " \
                    f"sets another) would need {gib(phase.total)} GiB in the {phase.name}"
            largest = f"{big.name} at {gib(big.bytes)} GiB: shrink it with {big.fix}."
            if state is None:
                raise ConfigError(f"{where}, of which the largest term is {largest}")
            raise ConfigError(f"{where}; its weights, gradients and optimizer state alone need {gib(state)} GiB, "
                              f"the largest {largest}")
        if p.kv_cache is not None and p.kind != "CPU" and p.kv_cache[1] < gen.max_model_len:
            raise ConfigError(
                f"the rollout engine on the {p.group} devices would have {gib(p.kv_cache[0])} GiB of KV cache, "
                f"{p.kv_cache[1]} tokens, fewer than one sequence of max_model_len={gen.max_model_len}: raise "
                f"generate_config.gpu_memory_utilization or generate_config.infer_tensor_parallel_size.")


def report(cfg: TrainerConfig) -> tuple[str, str | None]:
    """The plan as text, and the sentence refusing it (None where every group fits)."""
    plans = plan(cfg)
    try:
        check(plans, cfg)
    except ConfigError as err:
        return describe(plans), str(err)
    return describe(plans), None


def gib(value: float) -> float:
    return round(value / GIB, 2)


def size(value: float) -> str:
    """Bytes as the plan prints them: GiB, or MiB below one GiB (the tiny CPU models)."""
    return f"{gib(value)} GiB" if value >= GIB else f"{round(value / 2 ** 20, 1)} MiB"


def describe(plans: list[GroupPlan]) -> str:
    """The plan as the terminal shows it: per group, each phase's terms per device."""
    lines = ["memory plan, per device (docs/memory_plan.md):"]
    for p in plans:
        lines.append(f"  {p.group}: {p.ranks} x {p.kind} of {size(p.capacity)}; peak {size(p.peak.total)} "
                     f"in the {p.peak.name}" + ("" if p.fits else " -- does not fit"))
        for phase in p.phases:
            terms = ", ".join(f"{t.name} {size(t.bytes)}" for t in phase.terms if t.bytes)
            lines.append(f"    {phase.name}: {size(phase.total)} = {terms}")
        if p.offloaded:
            lines.append(f"    offloaded to host memory between phases: {size(p.offloaded)} per rank")
        if p.kv_cache is not None:
            lines.append(f"    engine KV cache: {size(p.kv_cache[0])}, {p.kv_cache[1]} tokens")
    return "\n".join(lines)
