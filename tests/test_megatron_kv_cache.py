"""Decode attention over the Megatron engine's shared-prompt KV cache against plain attention over each
row's whole sequence (its prompt's real tokens, then its own response), computed in float64."""

import pytest
import torch

from mindrl.rollout.megatron_kv_cache import DecodeWriter, KVCache, PrefillWriter

PROMPTS, SAMPLES, KV_HEADS, PER_GROUP, DIM, RESPONSE_SLOTS = 3, 4, 2, 3, 8, 6
LENGTHS = [6, 2, 4]  # left-padded to the longest
WIDTH = max(LENGTHS)
SCALE = DIM ** -0.5
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


class _Rows:
    """The cache under test beside every row's keys and values, kept apart as plain lists."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.gen = torch.Generator().manual_seed(0)
        self.dtype = dtype
        valid = torch.arange(WIDTH) >= WIDTH - torch.tensor(LENGTHS).unsqueeze(1)
        self.cache = KVCache(1, valid, SAMPLES, KV_HEADS, RESPONSE_SLOTS, DIM, dtype)
        # padding slots hold keys and values like any other (as a prefill computes them); the bias hides them
        keys, values = self._draw(PROMPTS, WIDTH), self._draw(PROMPTS, WIDTH)
        mask = (torch.ones(WIDTH, WIDTH, dtype=torch.bool).tril() & valid.unsqueeze(1)) | torch.eye(WIDTH, dtype=bool)
        query = self._draw(PROMPTS, WIDTH, KV_HEADS * PER_GROUP)
        PrefillWriter(self.cache, 0, mask.unsqueeze(1)).attend(0, query, keys, values, SCALE)
        grid = torch.arange(PROMPTS * SAMPLES) // SAMPLES
        self.keys = [keys[p][:, valid[p]] for p in grid]  # per row: [kv_heads, tokens, dim]
        self.values = [values[p][:, valid[p]] for p in grid]
        self.live = list(range(PROMPTS * SAMPLES))  # grid places of the cache's rows, in order

    def _draw(self, rows: int, length: int, heads: int = KV_HEADS) -> torch.Tensor:
        return torch.randn(rows, heads, length, DIM, generator=self.gen).to(self.dtype)

    def step(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of the live rows: the cache's attention and the float64 reference."""
        rows = len(self.live)
        query, key, value = self._draw(rows, 1, KV_HEADS * PER_GROUP), self._draw(rows, 1), self._draw(rows, 1)
        out = DecodeWriter(self.cache, slot).attend(0, query, key, value, SCALE)
        expected = []
        for i, place in enumerate(self.live):
            self.keys[place] = torch.cat([self.keys[place], key[i]], dim=1)
            self.values[place] = torch.cat([self.values[place], value[i]], dim=1)
            k = self.keys[place].double().repeat_interleave(PER_GROUP, dim=0)
            v = self.values[place].double().repeat_interleave(PER_GROUP, dim=0)
            expected.append(((query[i].double() @ k.transpose(1, 2)) * SCALE).softmax(-1) @ v)
        return out.double(), torch.stack(expected)

    def keep(self, positions: list[int], slots: int) -> None:
        self.cache.keep(torch.tensor(positions), slots)
        self.live = [self.live[i] for i in positions]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_attention_over_each_whole_sequence(dtype):
    rows = _Rows(dtype)
    for slot in range(RESPONSE_SLOTS):
        out, expected = rows.step(slot)
        assert out.shape == (PROMPTS * SAMPLES, KV_HEADS * PER_GROUP, 1, DIM)
        assert (out - expected).abs().max().item() < TOLERANCE[dtype], slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_that_leave_change_nothing_for_the_others(dtype):
    rows = _Rows(dtype)
    rows.step(0)
    rows.step(1)
    # a whole prompt's samples leave, and single samples of the others
    rows.keep([0, 2, 3, 8, 11], slots=2)
    for slot in (2, 3):
        out, expected = rows.step(slot)
        assert out.shape[0] == 5
        assert (out - expected).abs().max().item() < TOLERANCE[dtype], slot
    rows.keep([4], slots=4)  # the last sample of the last prompt alone
    out, expected = rows.step(4)
    assert (out - expected).abs().max().item() < TOLERANCE[dtype]
