"""The Megatron-native rollout engine on the device: its greedy tokens against HF `generate`, and the log-probs it
reports for its own samples against the actor's pass over them (tests/test_rollout_megatron.py's checks)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

#: the engine's log-probs of its samples against the actor's (fp32), as the CPU tests hold them
LOG_PROB_TOLERANCE = 1e-5


def run(device: str) -> dict:
    from mindrl.ckpt_convert import hf_to_mcore
    from mindrl.launch import run_ranks
    from tests.hf_models import build_hf_model, save_hf_model
    from tests.test_rollout_megatron import NEW_TOKENS, PROMPTS, _actor_log_probs, _hf_greedy, _in_turn

    hf = build_hf_model("qwen2", seed=0)
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = hf_to_mcore(save_hf_model(hf, Path(folder) / "hf"), Path(folder) / "mg", "qwen2",
                                 params_dtype=torch.float32, progress=False)
        result = run_ranks(_in_turn, 1, [(str(checkpoint), {}, False)], device=device)[0][0]
    expected = [response for response in _hf_greedy(hf, PROMPTS, NEW_TOKENS) for _ in range(2)]
    actor, sampled = _actor_log_probs([result]), result["sampled"]
    diffs = []
    for i, (response, log_probs) in enumerate(zip(sampled.responses, sampled.log_probs, strict=True)):
        start = len(PROMPTS[i // 2]) - 1
        diffs.append((torch.tensor(log_probs) - actor[i, start:start + len(response)]).abs().max().item())
    greedy = result["greedy"].responses == expected
    worst = max(diffs)
    return {"greedy_equals_hf": greedy, "log_prob_max_diff": worst, "limit": LOG_PROB_TOLERANCE,
            "passed": greedy and worst <= LOG_PROB_TOLERANCE}
