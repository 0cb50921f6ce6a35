"""The agent loop over both engines at TP=2, PP=2: the ids trained are exactly the ids each engine generated plus
the tool turns' ids, the engine's log-probs of the model's tokens equal the actor's with tool tokens in between,
every rank of an engine gets the same tool results, and tool tokens take no gradient in the update.

Random weights never write a <tool_call>, so the ranks register a parser that asks the calculator three things in
every turn (its expressions are the turn's text length times three factors, so each sample's tool turn differs);
everything else is the real loop, engines, tokenizer, template and tool. Each tool turn must be what Qwen2.5's own
chat template renders for three tool messages."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mindrl.launch import run_ranks

pytestmark = pytest.mark.job  # vLLM engines and four ranks

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[3, 17, 250, 9], [44, 2, 81], [5, 6, 7, 8, 9, 10], [90, 1, 77]]
#: ids random weights reach often (about 1 in 9 tokens), so model turns end by stopping, not by their length
STOPS = tuple(range(100, 160))
MAX_TOKENS, TOTAL = 40, 128
#: the calls of a turn, run in parallel and answered in one tool turn
FACTORS = (7, 11, 13)


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("agent_loop") / "tools_tokenizer"
    subprocess.run([sys.executable, str(ROOT / "cli" / "build_tiny_tokenizer.py"), "--out", str(out), "--task",
                    "tools", "--vocab-size", "512", "--split-digits"], check=True, capture_output=True)
    return str(out)


def _calculator_every_turn(text: str) -> list:
    """Three parallel calls a turn, each answer differing by turn and by call."""
    from mindrl.tools import ToolCall

    return [ToolCall("calculator", {"expression": f"{len(text)} * {k}"}) for k in FACTORS]


def _tool_turn_text(answers: list[int]) -> str:
    """What follows the model's turn: ChatML's newline, then the three results as Qwen2.5's own chat template renders
    three tool messages (tests/chat_templates.py), up to the model's next turn."""
    from jinja2 import Environment

    from tests.chat_templates import QWEN25

    messages = [{"role": "system", "content": "s"}] + [{"role": "tool", "content": str(a)} for a in answers]
    # transformers' chat-template environment: block tags swallow their newline
    template = Environment(trim_blocks=True, lstrip_blocks=True).from_string(QWEN25)
    rendered = template.render(messages=messages, add_generation_prompt=True)
    return "\n" + rendered.removeprefix("<|im_start|>system\ns<|im_end|>\n")


def _segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal mask values."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def _replay(prompt: list[int], response: list[int], mask: list[int], calls: list[dict], decode) -> list[str]:
    """Walk a trajectory turn by turn against what the engine was fed and gave: each model turn must be an output
    the engine produced for exactly the ids so far, each tool turn the calculator's answer in the template's turn."""
    problems, so_far, turn, last = [], [], 0, []
    for value, start, end in _segments(mask):
        piece = response[start:end]
        if value == 1:
            call = calls[turn]
            fed = [p for p in call["prompts"] for _ in range(call["n"])]
            outputs = [out for ids, out in zip(fed, call["responses"], strict=True) if ids == prompt + so_far]
            if piece not in outputs:
                problems.append(f"turn {turn}: {piece} is no output of the engine for the ids so far")
            turn, last = turn + 1, piece
        else:
            expected = _tool_turn_text([len(decode(last)) * k for k in FACTORS])
            if decode(piece) != expected:
                problems.append(f"tool turn {turn}: {decode(piece)!r} is not {expected!r}")
        so_far += piece
    return problems


def _multi_turn(rank: int, backend: str, tokenizer_path: str) -> dict:
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
    from tests.grads import reduced_grads

    tool_parser.PARSERS["calculator_every_turn"] = _calculator_every_turn
    arch = load_model_arch("tiny_qwen")
    actor = ActorWorker(arch, ParallelConfig(2, 2), ActorConfig(lr=1e-3, temperature=1.0, mini_batch_size=8,
                                                                micro_batch_size=2),
                        weights=sharding.random_full_state_dict(arch, seed=3, std=0.1))
    gen = GenerateConfig(backend=backend, dtype="float32", max_model_len=160, cpu_kv_cache_mb=16, max_num_seqs=64,
                         max_num_batched_tokens=1024, infer_tensor_parallel_size=2 if backend == "vllm" else 1,
                         sampling_config=SamplingConfig(max_tokens=MAX_TOKENS, temperature=1.0, seed=5))
    engine = make_engine(actor.model, arch, actor.par, gen, STOPS, seed=0)
    calls: list[dict] = []
    generate = engine.generate

    def recorded(prompts, sampling, n=1, images=None, max_tokens=None):
        out = generate(prompts, sampling, n, images, max_tokens)
        calls.append({"prompts": [list(p) for p in prompts], "n": n, "responses": out.responses})
        return out

    engine.generate = recorded
    tokenizer = load_tokenizer(tokenizer_path)
    limits = MultiTurnConfig(max_tool_calls=6, max_parallel_calls=3, max_total_response_length=TOTAL,
                             max_tool_response_length=64, tool_response_truncate_side="middle",
                             tool_parser_format="calculator_every_turn")
    rollout = ColocatedRollout(actor, engine, gen,
                               agent=AgentSpec(limits, tokenizer_path, get_template("chatml").tool_turn(tokenizer)))
    try:
        result, metrics = rollout.generate(PROMPTS, n=2)
    finally:
        rollout.agent.tools.close()
        engine.close()
    batch = rollout_batch(PROMPTS, result, 2)
    scored = actor.compute_log_prob({"tokens": batch["tokens"]})
    rows = actor.local_rows(batch["tokens"].shape[0])
    diff = None
    if scored is not None:
        diff = ((scored["log_probs"] - batch["engine_log_probs"][rows]) * batch["loss_mask"][rows]).abs().max().item()
    # this rank's engine generated its share of the samples: replay those against what it was fed
    mine = {tuple(p) for call in calls[:1] for p in call["prompts"]}
    problems = [problem for row, response in enumerate(result.responses) if tuple(PROMPTS[row // 2]) in mine
                for problem in _replay(PROMPTS[row // 2], response, result.response_masks[row], calls,
                                       tokenizer.decode)]
    out = {"result": result, "diff": diff, "problems": problems, "tool_seconds": metrics["rollout/tool_seconds"],
           "replayed": len(mine)}
    if backend == "megatron":
        out["grads"] = _tool_token_gradients(actor, batch, reduced_grads)
    return out


def _tool_token_gradients(actor, batch: dict, reduced_grads) -> dict:
    """The update's gradient with the batch as it is, with nonsense advantages and old log-probs on the tool
    tokens, and both again with the tool tokens put on the loss mask (so the nonsense could count)."""
    mask = batch["loss_mask"]
    inside = torch.zeros_like(mask)
    for row in range(mask.shape[0]):
        start, length = int(batch["prompt_lengths"][row]) - 1, int(batch["response_lengths"][row])
        inside[row, start:start + length] = 1
    tool = (inside == 1) & (mask == 0)
    generator = torch.Generator().manual_seed(0)
    advantages = torch.randn(mask.shape[0], 1, generator=generator) * mask
    old = batch["engine_log_probs"]
    noise = {"advantages": advantages.masked_fill(tool, 50.0), "old_log_probs": old.masked_fill(tool, -7.0)}
    grads = {}
    for name, loss_mask in (("masked", mask), ("unmasked", inside)):
        for variant, values in (("clean", {"advantages": advantages * inside, "old_log_probs": old}), ("noisy", noise)):
            step = {"tokens": batch["tokens"], "loss_mask": loss_mask, **values}
            actor._backward(step, torch.arange(*actor.local_rows(mask.shape[0]).indices(mask.shape[0])),
                            actor._policy_loss, False)
            grads[name, variant] = reduced_grads(actor)
    same = all(torch.equal(a, b) for a, b in zip(grads["masked", "clean"].values(),
                                                 grads["masked", "noisy"].values(), strict=True))
    moved = max((a - b).abs().max().item() for a, b in zip(grads["unmasked", "clean"].values(),
                                                         grads["unmasked", "noisy"].values(), strict=True))
    return {"tool_tokens": int(tool.sum()), "masked_equal": same, "unmasked_moved": moved}


@pytest.fixture(scope="module", params=["vllm", "megatron"])
def multi_turn(request, tokenizer_path) -> tuple[str, list[dict]]:
    if request.param == "vllm":
        pytest.importorskip("vllm")
    return request.param, run_ranks(_multi_turn, 4, request.param, tokenizer_path)


def test_the_ids_trained_are_the_ids_generated_plus_the_tool_turns(multi_turn):
    _, ranks = multi_turn
    result = ranks[0]["result"]
    assert all(r["result"].responses == result.responses for r in ranks)  # one result on every rank
    assert all(r["result"].response_masks == result.response_masks for r in ranks)
    assert [r["problems"] for r in ranks] == [[]] * 4
    assert sum(r["replayed"] for r in ranks) >= len(PROMPTS)  # every prompt replayed on some rank
    stats = result.tool_stats
    assert max(s.turns for s in stats) >= 3 and sum(s.calls for s in stats) >= 12  # really multi-turn
    # every turn made its three calls (the last one's unanswered: no room left, or past max_tool_calls)
    assert all(s.calls % 3 == 0 and s.turns - 1 <= s.calls // 3 <= s.turns for s in stats)
    assert all(set(s.statuses) == {"ok"} for s in stats if s.calls)
    assert all(len(r) <= TOTAL for r in result.responses)
    assert all(0 in mask and mask[-1] == 1 for mask, s in zip(result.response_masks, stats, strict=True)
               if s.calls)  # tool turns inside, the model's turn last


def test_the_engine_scores_the_models_tokens_as_the_actor_with_tool_tokens_between(multi_turn):
    backend, ranks = multi_turn
    diffs = [r["diff"] for r in ranks if r["diff"] is not None]
    assert len(diffs) == 2 and max(diffs) <= 1e-4, (backend, diffs)


def test_tool_tokens_take_no_gradient_in_the_update(multi_turn):
    backend, ranks = multi_turn
    if backend != "megatron":
        pytest.skip("the update is the actor's, whichever engine generated: measured once")
    grads = [r["grads"] for r in ranks]
    assert grads[0]["tool_tokens"] > 20
    assert all(g["masked_equal"] for g in grads)  # bit-identical: nothing on a tool token reaches the gradient
    assert min(g["unmasked_moved"] for g in grads) > 1e-3  # the same nonsense on the mask moves it
