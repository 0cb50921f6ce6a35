"""A multi-turn rollout step beside a single-turn one on the same actor: generation and update throughput, the
seconds spent in tools, and the update's FLOP/s beside a plain fp32 matmul's on the same core.

    python bench/multi_turn.py [--model small_qwen] [--prompts 8] [--n 4] [--max-tokens 48] [--calls 2]

One CPU rank (fp32), random weights, the vLLM engine. Random weights never write a <tool_call>, so the multi-turn
run registers a parser that asks the sandboxed python tool to print a number in every turn (up to `--calls`
calls): each call is a real bubblewrap sandbox start. The single-turn run generates one turn of `--max-tokens`;
the multi-turn run up to `--calls` + 1 such turns within the same response budget as its trajectories. Both
then take one update on their batch. Printed as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.lora import matmul_rate
from mindrl.launch import run_ranks

ROOT = Path(__file__).resolve().parents[1]
#: ids random weights reach often, so model turns end by stopping rather than at max_tokens
STOPS = tuple(range(100, 130))


def _python_every_turn(text: str) -> list:
    from mindrl.tools import ToolCall

    return [ToolCall("python", {"code": f"print({len(text)} * 7)"})]


def _step(rank: int, model: str, tokenizer: str, prompts: int, n: int, max_tokens: int, calls: int) -> dict:
    from mindrl.config import ParallelConfig, load_model_arch
    from mindrl.data.templates import get_template
    from mindrl.data.tokenizer import load_tokenizer
    from mindrl.models import sharding
    from mindrl.rollout import tool_parser
    from mindrl.rollout.agent_loop import AgentSpec
    from mindrl.rollout.config import GenerateConfig, MultiTurnConfig, SamplingConfig
    from mindrl.rollout.engines import make_engine
    from mindrl.trainer.experience import rollout_batch
    from mindrl.workers.colocated import ColocatedRollout
    from mindrl.workers.megatron_worker import ActorConfig, ActorWorker

    tool_parser.PARSERS["python_every_turn"] = _python_every_turn
    arch = load_model_arch(model)
    rows = prompts * n
    actor = ActorWorker(arch, ParallelConfig(1, 1), ActorConfig(lr=1e-5, mini_batch_size=rows, micro_batch_size=8),
                        weights=sharding.random_full_state_dict(arch, seed=1, std=0.05))
    total = max_tokens * (calls + 1) + 64 * calls
    gen = GenerateConfig(backend="vllm", dtype="float32", max_model_len=total + 32, cpu_kv_cache_mb=256,
                         max_num_seqs=rows, max_num_batched_tokens=4096, enforce_eager=True,
                         sampling_config=SamplingConfig(max_tokens=max_tokens, temperature=1.0, seed=3))
    ids = [[(17 * p + 3 * i) % 400 + 1 for i in range(16)] for p in range(prompts)]
    tok = load_tokenizer(tokenizer)
    agent = AgentSpec(MultiTurnConfig(calls, 1, total, 64, "middle", "python_every_turn"), tokenizer,
                      get_template("chatml").tool_turn(tok))
    out = {}
    for name, spec in (("single_turn", None), ("multi_turn", agent)):
        engine = make_engine(actor.model, arch, actor.par, gen, STOPS, seed=0)
        rollout = ColocatedRollout(actor, engine, gen, agent=spec)
        rollout.generate(ids[:1], n=1)  # the first call's one-off costs (sync, warm-up) stay out of the figures
        start = time.perf_counter()
        result, metrics = rollout.generate(ids, n=n)
        rollout_s = time.perf_counter() - start
        if rollout.agent is not None:
            rollout.agent.tools.close()
        engine.close()
        batch = rollout_batch(ids, result, n)
        gen_rows = torch.Generator().manual_seed(0)
        batch["advantages"] = torch.randn(rows, 1, generator=gen_rows) * batch["loss_mask"]
        start = time.perf_counter()
        actor.update(batch)
        update_s = time.perf_counter() - start
        tokens = int(batch["prompt_lengths"].sum() + batch["response_lengths"].sum())
        model_tokens = int(batch["loss_mask"].sum())
        stats = result.tool_stats or []
        out[name] = {"rollout_s": round(rollout_s, 3), "update_s": round(update_s, 3),
                     "response_tokens": int(batch["response_lengths"].sum()), "model_tokens": model_tokens,
                     "rollout_tokens_per_s": round(model_tokens / rollout_s, 1),
                     "update_tokens_per_s": round(tokens / update_s, 1),
                     "update_gflops": round(6 * sum(p.numel() for p in actor.model.parameters()) * tokens
                                            / update_s / 1e9, 2),
                     "tool_s": round(metrics.get("rollout/tool_seconds", 0.0), 3),
                     "tool_calls": sum(s.calls for s in stats), "turns_mean": (sum(s.turns for s in stats)
                                                                               / len(stats) if stats else 1.0)}
    return out


def main() -> None:
    import subprocess
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small_qwen")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--calls", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mindrl-bench-") as tmp:
        tokenizer = str(Path(tmp) / "tools_tokenizer")
        subprocess.run([sys.executable, str(ROOT / "cli" / "build_tiny_tokenizer.py"), "--out", tokenizer,
                        "--task", "tools", "--vocab-size", "512", "--split-digits"], check=True, capture_output=True)
        result = run_ranks(_step, 1, args.model, tokenizer, args.prompts, args.n, args.max_tokens, args.calls)[0]
    matmul = run_ranks(matmul_rate, 1)[0]
    out = {"bench": "multi_turn", "model": args.model, "rows": args.prompts * args.n, "max_tokens": args.max_tokens,
           "max_tool_calls": args.calls, "matmul_gflops": round(matmul / 1e9, 1), **result}
    for name in ("single_turn", "multi_turn"):
        out[name]["update_share_of_matmul"] = round(out[name]["update_gflops"] / out["matmul_gflops"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
