"""Evaluate a checkpoint on a prompt parquet: generate, score with the verifier registry, pass@k.

The generation path is the trainer's own: the Megatron actor loads the checkpoint (an HF
model is converted first, exactly), the rollout engine gets its weights by the same sync
as in training, and greedy decoding uses the trainer's validation settings — so the
figures of a run's validation and of this evaluation come from one code path.

A sample is *correct* when the accuracy verifier gives it 1.0 (its full mark), chosen as the
trainer's `accuracy` metric chooses it (trainer/metrics.py), so the two agree. pass@k is the
unbiased estimator of Chen et al. (2021) over the n samples of each prompt,
1 − C(n − c, k) / C(n, k), averaged over the prompts of each data_source.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mindrl.config import ConfigError
from mindrl.rollout.config import GenerateConfig, SamplingConfig
from mindrl.trainer.metrics import ACCURACY_VERIFIERS

#: HF config model_type → the converter's --model-type-hf
_HF_FAMILIES = {"qwen2": "qwen2", "llama": "llama3", "qwen3": "qwen3"}


@dataclass(frozen=True)
class EvalConfig:
    #: a Megatron checkpoint root (converted, SFT or GRPO) or an HF model folder
    load: str
    #: a prompt parquet (cli/preprocess_data.py output) or its folder (then its test.parquet)
    data: str
    tokenizer: str
    n_samples: int = 1
    #: 0 is greedy (top-k 1), as the trainer's validation
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int = 0
    verifiers: list[str] = field(default_factory=lambda: ["acc", "format"])
    weights: list[float] = field(default_factory=lambda: [1.0, 0.1])
    #: the k of pass@k reported beside pass@1 (each at most n_samples)
    ks: list[int] = field(default_factory=list)
    backend: str = "vllm"
    dtype: str = "float32"
    max_num_seqs: int = 64
    max_model_len: int = 1024
    cpu_kv_cache_mb: int = 256
    #: where the generations and their scores go (parquet); None: not written
    output: str | None = None
    #: the template the prompts were rendered with, for its stop words; None: the one the data records
    prompt_type: str | None = None
    #: the templates file prompt_type is looked up in (None: configs/model/templates.json)
    prompt_type_path: str | None = None
    #: answers may call tools between turns (the trainer's agent loop, rl_config's multi-turn keys)
    multi_turn: bool = False
    tool_config: str | None = None
    max_tool_calls: int = 8
    #: None: what max_model_len leaves after the longest prompt
    max_total_response_length: int | None = None

    def __post_init__(self) -> None:
        if self.n_samples < 1:
            raise ConfigError(f"--n-samples must be at least 1, got {self.n_samples}.")
        if self.temperature == 0 and self.n_samples > 1:
            raise ConfigError(f"greedy decoding (--temperature 0) gives the same answer {self.n_samples} times; "
                              f"set --temperature > 0 for n samples per prompt.")
        bad = [k for k in self.ks if not 1 <= k <= self.n_samples]
        if bad:
            raise ConfigError(f"pass@k needs 1 <= k <= n_samples={self.n_samples}, got k={bad}; lower k or raise "
                              f"--n-samples.")
        if self.judge is None:
            raise ConfigError(f"--verifiers {' '.join(self.verifiers)} has no accuracy verifier to decide which "
                              f"samples are correct; add one of {', '.join(ACCURACY_VERIFIERS)}.")
        if self.max_tokens >= self.max_model_len:
            raise ConfigError(f"--max-tokens {self.max_tokens} leaves no room for a prompt in --max-model-len "
                              f"{self.max_model_len}; raise --max-model-len.")

    @property
    def judge(self) -> str | None:
        return next((name for name in ACCURACY_VERIFIERS if name in self.verifiers), None)

    def sampling(self) -> SamplingConfig:
        if self.temperature == 0:
            return SamplingConfig(max_tokens=self.max_tokens, top_k=1, logprobs=0, seed=self.seed)
        return SamplingConfig(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              logprobs=0, seed=self.seed)

    def generate_config(self) -> GenerateConfig:
        return GenerateConfig(backend=self.backend, dtype=self.dtype, max_num_seqs=self.max_num_seqs,
                              max_model_len=self.max_model_len, max_num_batched_tokens=max(self.max_model_len, 4096),
                              cpu_kv_cache_mb=self.cpu_kv_cache_mb, sampling_config=self.sampling())


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def megatron_checkpoint(load: str, workdir: Path) -> str:
    """`load` itself when it is a Megatron checkpoint; an HF folder converted (TP=1, PP=1, fp32) into `workdir`."""
    from mindrl.checkpoint import megatron as mg

    root = Path(load)
    if (root / mg.TRACKER).is_file():
        return str(root)
    config = root / "config.json"
    if not config.is_file():
        raise ConfigError(f"--load {load} is neither a Megatron checkpoint (no {mg.TRACKER}) nor an HF model "
                          f"(no config.json); point it at one.")
    model_type = json.loads(config.read_text()).get("model_type")
    if model_type not in _HF_FAMILIES:
        raise ConfigError(f"--load {load} is an HF {model_type!r} model; mindrl evaluates "
                          f"{', '.join(_HF_FAMILIES)} models.")
    import torch

    from mindrl.ckpt_convert import hf_to_mcore

    return str(hf_to_mcore(root, workdir / "mg", _HF_FAMILIES[model_type], params_dtype=torch.float32,
                           progress=False))


def _generate_rank(rank: int, checkpoint: str, cfg: EvalConfig, prompts: list[list[int]],
                   eos_token_ids: tuple[int, ...], images: list | None = None, agent: Any = None) -> Any:
    from mindrl.checkpoint import files
    from mindrl.checkpoint import megatron as mg
    from mindrl.workers.colocated import ColocatedRollout
    from mindrl.workers.megatron_worker import ActorConfig, ActorWorker

    args = files.load_args(checkpoint)
    gen = cfg.generate_config()
    actor = ActorWorker(mg.arch_of(args, checkpoint), mg.parallel_of(args), ActorConfig(seed=cfg.seed), checkpoint)
    rollout = ColocatedRollout.build(actor, gen, eos_token_ids, agent=agent)
    try:
        result, _ = rollout.generate(prompts, cfg.n_samples, gen.sampling_config, images)
    finally:
        rollout.close()
    return result if rank == 0 else None


def evaluate(cfg: EvalConfig) -> dict[str, Any]:
    """Generate, score and summarise; writes the generations to `cfg.output` if set. Returns the summary."""
    from mindrl.checkpoint import megatron as mg
    from mindrl.config.reward import RewardConfig
    from mindrl.data.stops import response_text, run_stop_words, stop_token_ids, trajectory_text
    from mindrl.data.tokenizer import load_tokenizer
    from mindrl.launch import run_ranks
    from mindrl.rewards.scorer import RewardScorer
    from mindrl.trainer.prompts import images_of, read_prompts, split_path

    reward = RewardConfig(verifier_function=list(cfg.verifiers), verifier_weight=list(cfg.weights))
    prompts = read_prompts(split_path(cfg.data, "test"))
    tokenizer = load_tokenizer(cfg.tokenizer)
    stop_ids = stop_token_ids(tokenizer, run_stop_words(split_path(cfg.data, "test"), cfg.prompt_type,
                                                         cfg.prompt_type_path))
    longest = max(len(p.ids) for p in prompts)
    if longest + cfg.max_tokens > cfg.max_model_len:
        raise ConfigError(f"the longest prompt ({longest} tokens) plus --max-tokens {cfg.max_tokens} exceeds "
                          f"--max-model-len {cfg.max_model_len}; raise it.")
    agent = _agent(cfg, longest, tokenizer) if cfg.multi_turn else None
    with tempfile.TemporaryDirectory(prefix="mindrl-eval-") as workdir:
        checkpoint = megatron_checkpoint(cfg.load, Path(workdir))
        par = mg.parallel_of(mg.load_args(checkpoint))
        result = run_ranks(_generate_rank, par.tp * par.pp, checkpoint, cfg, [p.ids for p in prompts],
                           stop_ids, images_of(prompts), agent)[0]
    n = cfg.n_samples
    text = trajectory_text if agent else response_text
    texts = [text(tokenizer, r, stop_ids) for r in result.responses]
    labels = [p.label for p in prompts for _ in range(n)]
    calls = [s.calls for s in result.tool_stats] if result.tool_stats else [0] * len(texts)
    turns = [s.turns for s in result.tool_stats] if result.tool_stats else [1] * len(texts)
    with RewardScorer(reward) as scorer:
        scored = scorer.score(texts, labels, [len(r) for r in result.responses],
                              tool_calls=[s.ok_calls for s in result.tool_stats] if result.tool_stats else None)
    correct = [s == 1.0 for s in scored.scores[cfg.judge]]
    rows = [{"index": i // n, "sample": i % n, "data_source": prompts[i // n].data_source, "answer": labels[i],
             "response": texts[i], "response_length": len(result.responses[i]),
             "finish_reason": result.finish_reasons[i], "score": scored.rewards[i], "correct": correct[i],
             "tool_calls": calls[i], "turns": turns[i], "used_tool": float(calls[i] > 0),
             **{f"score/{name}": values[i] for name, values in scored.scores.items()}} for i in range(len(texts))]
    summary = summarise(rows, n, cfg.ks)
    summary.update(load=cfg.load, data=str(split_path(cfg.data, "test")), n_samples=n,
                   temperature=cfg.temperature, max_tokens=cfg.max_tokens)
    if cfg.output:
        write_generations(rows, cfg.output)
        summary["output"] = cfg.output
    return summary


def _agent(cfg: EvalConfig, longest: int, tokenizer: Any) -> Any:
    """The trainer's agent loop, with the tool turn of the template the prompts were rendered with."""
    from mindrl.console import say
    from mindrl.data.stops import run_template
    from mindrl.rollout.agent_loop import AgentSpec, check_data_announces, check_tools
    from mindrl.rollout.config import MultiTurnConfig
    from mindrl.trainer.prompts import split_path

    total = cfg.max_total_response_length or cfg.max_model_len - longest
    multi_turn = MultiTurnConfig(cfg.max_tool_calls, 4, total, 1024, "middle", "hermes", cfg.tool_config)
    if longest + total > cfg.max_model_len:
        raise ConfigError(f"the longest prompt ({longest} tokens) plus --max-total-response-length {total} exceeds "
                          f"--max-model-len {cfg.max_model_len}; raise it.")
    warning = check_tools(multi_turn)
    if warning:
        say(f"warning: {warning}")
    test_path = split_path(cfg.data, "test")
    template = run_template(test_path, cfg.prompt_type, cfg.prompt_type_path)
    if template is None:
        raise ConfigError(f"--multi-turn needs the chat template's tool turn, but {cfg.data} records no template; "
                          f"pass --prompt-type (e.g. qwen).")
    spec = AgentSpec(multi_turn, cfg.tokenizer, template.tool_turn(tokenizer))
    notice = check_data_announces(test_path, multi_turn)
    if notice:
        say(f"warning: {notice}")
    return spec


def summarise(rows: list[dict], n: int, ks: list[int]) -> dict[str, Any]:
    """pass@1, pass@k and the means of the score, each verifier's score and the response length, overall
    and per data_source (each prompt weighs the same: every prompt has n samples)."""
    by_prompt: dict[int, list[dict]] = defaultdict(list)
    for row in rows:
        by_prompt[row["index"]].append(row)
    groups: dict[str, list[list[dict]]] = defaultdict(list)
    for samples in by_prompt.values():
        groups[samples[0]["data_source"]].append(samples)
    groups["all"] = list(by_prompt.values())

    def figures(prompts: list[list[dict]]) -> dict[str, float]:
        out = {"prompts": len(prompts)}
        for k in sorted({1, *ks}):
            out[f"pass@{k}"] = sum(pass_at_k(n, sum(s["correct"] for s in p), k) for p in prompts) / len(prompts)
        samples = [s for p in prompts for s in p]
        for key in ("score", "response_length", "turns", "used_tool",
                    *(k for k in samples[0] if k.startswith("score/"))):
            out[f"{key}_mean"] = sum(s[key] for s in samples) / len(samples)
        return out

    return {"by_source": {source: figures(prompts) for source, prompts in sorted(groups.items())}}


def write_generations(rows: list[dict], path: str | Path) -> None:
    """The generations with their scores as one parquet, written atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mindrl.checkpoint.atomic import atomic_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        pq.write_table(pa.Table.from_pylist(rows), tmp)
