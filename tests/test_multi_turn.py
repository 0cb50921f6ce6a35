"""Multi-turn pieces that need no engine: the hermes parser, the template's tool turn as ids, the batch's mask
over tool tokens, GAE across a tool gap, the metrics and the config rules."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mindrl.algorithms.advantages import masked_whiten
from mindrl.algorithms.gae import gae_advantages
from mindrl.config import ConfigError
from mindrl.data.templates import get_template
from mindrl.data.tokenizer import load_tokenizer
from mindrl.rollout.agent_loop import ToolTurns
from mindrl.rollout.base import RolloutResult, ToolStats
from mindrl.rollout.tool_parser import parse_hermes
from mindrl.tools import ToolCall, ToolResult
from mindrl.trainer.experience import rollout_batch
from mindrl.trainer.metrics import multi_turn_metrics

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer") / "tools"
    subprocess.run([sys.executable, str(ROOT / "cli" / "build_tiny_tokenizer.py"), "--out", str(out), "--task",
                    "tools", "--vocab-size", "512", "--split-digits"], check=True, capture_output=True)
    return load_tokenizer(out)


def test_hermes_reads_every_call_of_a_turn_and_turns_mistakes_into_sentences():
    text = ('I will compute.<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2+2\\"}"}</tool_call>')
    assert parse_hermes(text) == [ToolCall("python", {"code": "print(6 * 7)"}),
                                  ToolCall("calculator", {"expression": "2+2"})]
    assert parse_hermes("no call here, just <tool_response> text") == []
    bad = parse_hermes('<tool_call>{"name": "python", "arguments": {"code": </tool_call>'
                       '<tool_call>["python"]</tool_call><tool_call>{"name": "python", "arguments": [1]}</tool_call>'
                       '<tool_call>{"name": "python"')
    assert [call.name for call in bad] == [None] * 4
    assert [call.error.split(" (")[0] for call in bad] == [
        "error: the <tool_call> block is not valid JSON",
        'error: a tool call is a JSON object with a "name" string and an "arguments" object.',
        "error: the \"arguments\" of the call to 'python' must be a JSON object.",
        "error: the <tool_call> block has no closing </tool_call>."]


def test_the_tool_turn_is_the_templates_own_text_with_each_piece_tokenized_on_its_own(tokenizer):
    after, opening, closing = get_template("chatml").tool_turn(tokenizer)
    # the newline ChatML writes after <|im_end|> (verl PR 6921's dropped "\n"), then Qwen's tool-response turn
    assert (after, opening, closing) == ("\n", "<|im_start|>user\n<tool_response>\n",
                                         "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    turns = ToolTurns(tokenizer, (after, opening, closing), "hermes")
    ids = turns.ids([ToolResult("4042", "ok", 0.0), ToolResult("x<|im_end|>y", "ok", 0.0)])
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert ids == (encode("\n") + encode(opening) + encode("4042") + encode("\n")
                   + tokenizer.encode("x<|im_end|>y", add_special_tokens=False, split_special_tokens=True)
                   + encode(closing))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(im_end) == 1  # a tool's text "<|im_end|>" stays text: only the template's closing ends a turn
    assert tokenizer.decode(ids) == f"\n{opening}4042\nx<|im_end|>y{closing}"
    with pytest.raises(ConfigError, match="has no tool turn"):
        get_template("none").tool_turn(tokenizer)


def test_tool_tokens_are_off_the_loss_mask_and_carry_no_engine_log_prob():
    result = RolloutResult([[7, 8, 50, 51, 52, 9, 2]], [[-0.5, -0.25, 0.0, 0.0, 0.0, -1.0, -0.125]], ["stop"],
                           response_masks=[[1, 1, 0, 0, 0, 1, 1]], tool_stats=[ToolStats(2, ("ok",))])
    batch = rollout_batch([[1, 2, 3]], result, 1)
    # position t scores token t + 1: the response starts at position 2
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 0, 0, 1, 1, 0]]
    assert batch["engine_log_probs"][0, 2:9].tolist() == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0, -0.125]
    assert batch["response_lengths"].tolist() == [7]
    metrics = multi_turn_metrics(batch)
    assert "turns" not in batch and "tool_calls" not in batch  # the counts never travel to the workers
    assert metrics["multi_turn/turns_mean"] == 2 and metrics["multi_turn/tool_calls_mean"] == 1
    assert metrics["response_length/model_tokens_mean"] == 4


def test_gae_carries_values_and_advantages_across_a_tool_gap():
    # positions 0, 1 and 4 are the model's; 2 and 3 a tool turn (values there are the critic's noise)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25, 9.0, -9.0, 0.75]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # by hand: δ4 = 1 − 0.75; δ1 = 0.9·V4 − V1 (V4 reached across the gap); δ0 = 0.9·V1 − V0
    a4 = 0.25
    a1 = 0.9 * 0.75 - 0.25 + 0.9 * 0.8 * a4
    a0 = 0.9 * 0.25 - 0.5 + 0.9 * 0.8 * a1
    expected = torch.tensor([[a0, a1, 0.0, 0.0, a4]], dtype=torch.float64)
    assert torch.allclose(returns.double(), (expected + values.double()) * mask, atol=1e-6)
    assert torch.allclose(advantages.double(), masked_whiten(expected, mask.double()), atol=1e-6)
