"""Rollout speed of every backend, and the weight sync, against the machine's own limits.

    python bench/rollout.py [--prompts 16] [--samples 8] [--new-tokens 128] [--threads 2]

For the tiny model and the small one (configs/model/small_qwen.yaml: hidden 512, 8 layers,
8 heads / 4 KV heads, ffn 1408, vocab 2048, tied: 24.7M parameters), in fp32 and bf16: new tokens
per second and achieved GFLOP/s of vLLM (eager, the default, and with `enforce_eager: false`), the
Megatron-native engine and HF transformers' `generate` (prompts × samples × new tokens at
temperature 1, end-of-sequence ignored), beside a plain matmul's GFLOP/s on the same cores measured
in the same run; and the weight sync's seconds and GB/s, split into gather / convert / load,
against a plain memcpy of the same bytes and against the engine's own in-place reload of the same
HF tensors. Every measurement runs in a fresh process. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from mindrl.config import ModelArch, ParallelConfig, load_model_arch
from mindrl.launch import run_ranks
from mindrl.models.flops import forward_flops

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PROMPT_LEN = 32


def arch_named(name: str) -> ModelArch:
    return load_model_arch(f"{name}_qwen")


def flops_per_request(arch: ModelArch, prompt: int, new: int) -> float:
    """Matmul FLOPs of one request: prefill of `prompt` tokens and `new` decode steps, each token through
    the weights and attending causally to the tokens before it."""
    tokens = prompt + new
    return forward_flops(arch, tokens, sum(range(1, tokens + 1)))


def _prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (args.prompts, PROMPT_LEN), generator=gen).tolist()


def _matmul(rank: int, dtype: str, threads: int) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 512).to(DTYPES[dtype]), torch.randn(512, 1408).to(DTYPES[dtype])
    for _ in range(3):
        a @ b
    best = min(_timed(lambda: [a @ b for _ in range(10)]) for _ in range(3))
    return 10 * 2.0 * 2048 * 512 * 1408 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _actor(model: str, dtype: str):
    from mindrl.models import sharding
    from mindrl.workers.megatron_worker import ActorConfig, ActorWorker

    arch = arch_named(model)
    return ActorWorker(arch, ParallelConfig(1, 1), ActorConfig(mini_batch_size=8, micro_batch_size=2),
                       weights=sharding.random_full_state_dict(arch, seed=1, std=0.05), params_dtype=DTYPES[dtype])


def _generate(rank: int, backend: str, model: str, dtype: str, args: argparse.Namespace) -> dict:
    from mindrl.rollout.config import GenerateConfig, SamplingConfig

    torch.set_num_threads(args.threads)
    actor = _actor(model, dtype)
    prompts = _prompts(args, actor.arch.padded_vocab_size)
    sampling = SamplingConfig(max_tokens=args.new_tokens, temperature=1.0, seed=0)
    cfg = GenerateConfig(dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
                         max_model_len=PROMPT_LEN + args.new_tokens + 1,
                         cpu_kv_cache_mb=512, max_num_seqs=args.prompts * args.samples,
                         max_num_batched_tokens=args.prompts * args.samples * PROMPT_LEN, sampling_config=sampling)
    out: dict = {}
    engine = None
    if backend == "hf":
        generate = _hf_generate(actor, prompts, args)
    else:
        engine, generate, out = _engine_generate(backend, actor, cfg, prompts, args)
    generate(warmup=True)
    seconds = min(_timed(generate) for _ in range(2))
    if engine is not None:
        engine.close()
    new_tokens = args.prompts * args.samples * args.new_tokens
    out.update(seconds=seconds, tokens_per_s=new_tokens / seconds,
               gflops=args.prompts * args.samples * flops_per_request(actor.arch, PROMPT_LEN, args.new_tokens)
               / seconds / 1e9)
    return out


def _engine_generate(backend: str, actor, cfg, prompts: list[list[int]], args: argparse.Namespace):
    from mindrl.rollout.engines import make_engine
    from mindrl.rollout.weight_sync import hf_tensors, sync_weights

    compiled = backend == "vllm-compiled"  # vLLM's torch.compile path: slower start, faster steps
    cfg = dataclasses.replace(cfg, backend="vllm" if compiled else backend, enforce_eager=not compiled)
    start = time.perf_counter()
    engine = make_engine(actor.model, actor.arch, actor.par, cfg, [], actor.cfg.seed)
    out: dict = {"start_s": time.perf_counter() - start}
    dtype = DTYPES["fp32" if cfg.dtype == "float32" else "bf16"]
    if compiled:
        sync_weights(engine, actor.model, actor.arch, actor.par, dtype, 512 << 20)
    elif backend == "vllm":
        stats = min((sync_weights(engine, actor.model, actor.arch, actor.par, dtype, 512 << 20) for _ in range(3)),
                    key=lambda s: s.gather_s + s.convert_s + s.load_s)
        tensors = list(hf_tensors(actor.model, actor.arch, actor.par, dtype))
        memcpy = min(_timed(lambda: [torch.empty_like(t).copy_(t) for _, t in tensors]) for _ in range(3))
        reload = min(_timed(lambda: _engine_reload(engine, tensors)) for _ in range(3))
        total = stats.gather_s + stats.convert_s + stats.load_s
        out.update(sync_s=total, sync_gather_s=stats.gather_s, sync_convert_s=stats.convert_s,
                   sync_load_s=stats.load_s, sync_gb=stats.bytes / 1e9, sync_gb_per_s=stats.bytes / 1e9 / total,
                   memcpy_s=memcpy, engine_reload_s=reload, sync_vs_reload=total / reload,
                   sync_vs_memcpy=total / memcpy)
    sampling = cfg.sampling_config

    def generate(warmup: bool = False) -> None:
        engine.generate(prompts[:2] if warmup else prompts, sampling, 1 if warmup else args.samples)

    return engine, generate, out


def _engine_reload(engine, tensors: list) -> None:
    engine.load_weights(tensors)
    engine.finish_weight_update()


def _hf_generate(actor, prompts: list[list[int]], args: argparse.Namespace):
    import transformers

    from mindrl.models import hf_mapping as hfm
    from mindrl.rollout.weight_sync import hf_tensors

    dtype = next(actor.model.parameters()).dtype
    config = hfm.hf_config_from_arch(actor.arch, "qwen2", dtype)
    hf_config = transformers.Qwen2Config(**{k: v for k, v in config.items()
                                            if k not in ("architectures", "model_type")})
    model = transformers.Qwen2ForCausalLM(hf_config).to(dtype).eval()
    state = dict(hf_tensors(actor.model, actor.arch, actor.par, dtype))
    if actor.arch.tied_embeddings:
        state[hfm.OUTPUT[0]] = state[hfm.EMBEDDING[0]]
    model.load_state_dict(state)
    input_ids = torch.tensor(prompts)

    def generate(warmup: bool = False) -> None:
        with torch.no_grad():
            model.generate(input_ids[:2] if warmup else input_ids, do_sample=True, temperature=1.0, top_k=0,
                           max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                           num_return_sequences=1 if warmup else args.samples, pad_token_id=0)

    return generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--backends", default="vllm,vllm-compiled,megatron,hf")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    result: dict = {"bench": "rollout", "prompts": args.prompts, "samples": args.samples,
                    "new_tokens": args.new_tokens, "prompt_tokens": PROMPT_LEN, "threads": args.threads,
                    "matmul_gflops": {d: round(run_ranks(_matmul, 1, d, args.threads)[0], 1) for d in DTYPES}}
    for model in args.models.split(","):
        for dtype in DTYPES:
            for backend in args.backends.split(","):
                measured = run_ranks(_generate, 1, backend, model, dtype, args, timeout_s=1800)[0]
                measured["share_of_matmul"] = measured["gflops"] / result["matmul_gflops"][dtype]
                result[f"{model}/{dtype}/{backend}"] = {k: round(v, 4) for k, v in measured.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
