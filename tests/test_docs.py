"""Every config key a user can set is documented, and the decided meanings are the ones the docs give."""

import dataclasses
import re
from pathlib import Path

import pytest

from mindrl.config.profiler import ProfilerConfig
from mindrl.config.reward import RewardConfig
from mindrl.data.preprocess import PreprocessConfig
from mindrl.rollout.config import GenerateConfig, SamplingConfig
from mindrl.trainer.dpo_config import DPOSection
from mindrl.trainer.megatron import MegatronConfig
from mindrl.trainer.rl import RLConfig
from mindrl.trainer.sft_config import SFTSection

DOCS = Path(__file__).resolve().parents[1] / "docs"
#: fields that are resolved values, not keys
NOT_KEYS = {"arch", "reward", "resources"}


def _rows(text: str) -> dict[str, str]:
    """Each documented key → its table row (a row's first cell may name several keys)."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            for key in re.findall(r"`([a-z_0-9]+)`", first):
                rows.setdefault(key, line)
    return rows


ROWS = {name: row for page in sorted(DOCS.glob("*.md")) for name, row in _rows(page.read_text()).items()}


@pytest.mark.parametrize("section", [MegatronConfig, RLConfig, RewardConfig, GenerateConfig, SamplingConfig,
                                     SFTSection, DPOSection, PreprocessConfig, ProfilerConfig])
def test_every_key_of_every_section_has_its_row_in_the_docs(section):
    missing = [f.name for f in dataclasses.fields(section) if f.init and f.name not in NOT_KEYS and f.name not in ROWS]
    assert not missing, f"{section.__name__} keys without a row in docs/*.md: {missing}"


def test_the_decided_meanings_are_the_documented_ones():
    config = _rows((DOCS / "config.md").read_text())
    assert "a bound on the prompts" in config["seq_length"]  # MindSpeed-RL's meaning, kept
    assert "`auto`" in config["bf16"]
    assert "no web port" in config["include_dashboard"]
    rollout = _rows((DOCS / "rollout.md").read_text())
    assert "`auto` follows the actor's training precision" in rollout["dtype"]
    assert "the tiny config's 20 steps take" in rollout["enforce_eager"]  # the measured choice of the CPU configs
