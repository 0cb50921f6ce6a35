"""Multi-turn pieces that need no engine: the hermes parser, the template's tool turn as ids, the batch's mask
over tool tokens, GAE across a tool gap, the metrics and the config rules."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mindrl.algorithms.advantages import masked_whiten
from mindrl.algorithms.gae import gae_advantages
from mindrl.config import ConfigError
from mindrl.data.templates import announced_tools, get_template
from mindrl.data.tokenizer import load_tokenizer
from mindrl.rollout.agent_loop import AgentSpec, ToolTurns, check_announced
from mindrl.rollout.base import RolloutResult, ToolStats
from mindrl.rollout.config import MultiTurnConfig
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
    turn = get_template("chatml").tool_turn(tokenizer)
    # the newline ChatML writes after <|im_end|> (verl PR 6921's dropped "\n"), then Qwen's tool-response turn
    assert (turn.after, turn.opening, turn.separator, turn.closing) == (
        "\n", "<|im_start|>user\n<tool_response>\n", "\n</tool_response>\n<tool_response>\n",
        "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    turns = ToolTurns(tokenizer, turn, "hermes")
    ids = turns.ids([ToolResult("4042", "ok", 0.0), ToolResult("x<|im_end|>y", "ok", 0.0)])
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert ids == (encode("\n") + encode(turn.opening) + encode("4042") + encode(turn.separator)
                   + tokenizer.encode("x<|im_end|>y", add_special_tokens=False, split_special_tokens=True)
                   + encode(turn.closing))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(im_end) == 1  # a tool's text "<|im_end|>" stays text: only the template's closing ends a turn
    assert tokenizer.decode(ids) == f"\n{turn.opening}4042{turn.separator}x<|im_end|>y{turn.closing}"
    with pytest.raises(ConfigError, match="has no tool turn"):
        get_template("none").tool_turn(tokenizer)


CALLS = [ToolCall("python", {"code": "print(6 * 7)\nprint('a')"}), ToolCall("calculator", {"expression": "2+2"}),
         ToolCall("python", {"code": "print(1)"})]
RESULTS = ["42\na", "4", "error: line one\n</tool_response> in the text"]


def _qwen_messages(system: str) -> list[dict]:
    """A conversation as Qwen2.5 is served it: the user's question, an assistant turn of three parallel calls, their
    three results as tool messages."""
    calls = [{"type": "function", "function": {"name": call.name, "arguments": call.arguments}} for call in CALLS]
    return [{"role": "system", "content": system}, {"role": "user", "content": "What is 6 * 7?"},
            {"role": "assistant", "content": "I will compute.", "tool_calls": calls},
            *({"role": "tool", "content": result} for result in RESULTS)]


def test_three_parallel_results_render_as_qwen25s_chat_template_renders_three_tool_messages(tokenizer):
    from tests.chat_templates import QWEN25

    system = "You are a helpful assistant."
    messages = _qwen_messages(system)
    oracle = tokenizer.apply_chat_template(messages, chat_template=QWEN25, tools=TOOLBOX_SCHEMAS, tokenize=False,
                                           add_generation_prompt=True)
    # the model's turn as it generated it: Qwen's serialization of its calls, ended by <|im_end|>
    assistant_text = tokenizer.apply_chat_template(messages[:3], chat_template=QWEN25, tokenize=False)
    assistant_text = assistant_text[assistant_text.rindex("<|im_start|>assistant\n") + 22:].removesuffix("\n")
    template = get_template("qwen")
    prompt = template.render("What is 6 * 7?", system, tokenizer, TOOLBOX_SCHEMAS)
    assert parse_hermes(assistant_text) == CALLS
    turns = ToolTurns(tokenizer, template.tool_turn(tokenizer), "hermes")
    tool_ids = turns.ids([ToolResult(text, "ok", 0.0) for text in RESULTS])
    assert prompt + assistant_text + tokenizer.decode(tool_ids) == oracle
    assert oracle.count("<tool_response>") == 3
    # one result alone is the one tool message's rendering too
    single = tokenizer.apply_chat_template(messages[:4], chat_template=QWEN25, tokenize=False,
                                           add_generation_prompt=True)
    assert tokenizer.decode(turns.ids([ToolResult(RESULTS[0], "ok", 0.0)])) == \
        single[single.rindex("<|im_end|>", 0, single.rindex("<|im_start|>user")) + len("<|im_end|>"):]


TOOLBOX_SCHEMAS = [
    {"type": "function", "function": {"name": "python", "description": "Run a program — and see its output.",
                                      "parameters": {"type": "object",
                                                     "properties": {"code": {"type": "string"}},
                                                     "required": ["code"]}}},
    {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                      "parameters": {"type": "object",
                                                     "properties": {"expression": {"type": "string"}},
                                                     "required": ["expression"]}}}]


def test_the_tools_block_is_qwen25s_and_reads_back(tokenizer):
    from tests.chat_templates import QWEN25

    template = get_template("qwen_r1")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ours = get_template("qwen").render("Hi", "Be brief.", tokenizer, TOOLBOX_SCHEMAS)
    assert ours == tokenizer.apply_chat_template(messages, chat_template=QWEN25, tools=TOOLBOX_SCHEMAS,
                                                 tokenize=False, add_generation_prompt=True)
    assert announced_tools(ours) == TOOLBOX_SCHEMAS
    assert announced_tools(template.render("Hi", None, tokenizer)) is None
    with pytest.raises(ConfigError, match="template 'qwen' has no format_tools to announce tools in"):
        replace(get_template("qwen"), tool_format=None).render("Hi", None, tokenizer, TOOLBOX_SCHEMAS)
    with pytest.raises(ConfigError, match="template 'none' has no system turn to announce tools in"):
        get_template("none").render("Hi", None, tokenizer, TOOLBOX_SCHEMAS)


def test_prompts_that_announce_other_tools_than_the_rollout_runs_are_refused(tokenizer):
    qwen = get_template("qwen")
    both = qwen.render("q", None, tokenizer, TOOLBOX_SCHEMAS)
    assert check_announced([both, both], TOOLBOX_SCHEMAS, "train.parquet") is None
    renamed = [TOOLBOX_SCHEMAS[0], {"type": "function", "function": {**TOOLBOX_SCHEMAS[1]["function"],
                                                                      "name": "calc"}}]
    with pytest.raises(ConfigError, match=r"prompt 1 of train.parquet announces the tools \['calculator', 'python'\] "
                                          r"but the rollout runs \['calc', 'python'\]; preprocess"):
        check_announced([qwen.render("q", None, tokenizer, renamed), both], renamed, "train.parquet")
    other_argument = [TOOLBOX_SCHEMAS[0], {"type": "function", "function": {
        **TOOLBOX_SCHEMAS[1]["function"], "parameters": {"type": "object", "properties": {"expr": {}}}}}]
    with pytest.raises(ConfigError, match=r"announces tool 'calculator' with the arguments \['expression'\] but the "
                                          r"rollout's takes \['expr'\]"):
        check_announced([both], other_argument, "train.parquet")
    silent = qwen.render("q", None, tokenizer)
    assert "announce no tools" in check_announced([silent], TOOLBOX_SCHEMAS, "train.parquet")
    with pytest.raises(ConfigError, match=r"1 of the 2 prompts of train\.parquet announce no tools"):
        check_announced([silent, both], TOOLBOX_SCHEMAS, "train.parquet")


def test_parallel_calls_need_a_template_that_sets_results_apart(tokenizer):
    limits = MultiTurnConfig(4, 2, 64, 256, "middle", "hermes")
    turn = get_template("qwen").tool_turn(tokenizer)
    AgentSpec(limits, "tok", turn)
    with pytest.raises(ConfigError, match="max_parallel_calls=2 lets a turn's results share one tool turn, but the "
                                          "data's template has no format_observation_separator"):
        AgentSpec(limits, "tok", replace(turn, separator=None))
    AgentSpec(replace(limits, max_parallel_calls=1), "tok", replace(turn, separator=None))


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
