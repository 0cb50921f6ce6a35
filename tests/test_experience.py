"""Rollouts packed into the rows the workers score: shifted mask, engine log-probs in the token's column."""

import pytest
import torch

from mindrl.rollout.base import RolloutResult
from mindrl.trainer.experience import rollout_batch


def test_rows_masks_and_engine_log_probs_line_up_with_the_shifted_tokens():
    result = RolloutResult([[7, 8], [9], [4, 5, 6], [2]], [[-0.5, -1.0], [-2.0], [-0.1, -0.2, -0.3], [-4.0]],
                           ["length", "stop", "length", "stop"])
    batch = rollout_batch([[1, 2, 3], [5]], result, n=2, pad_id=99)
    assert batch["tokens"].tolist() == [[1, 2, 3, 7, 8], [1, 2, 3, 9, 99], [5, 4, 5, 6, 99], [5, 2, 99, 99, 99]]
    # position t scores token t + 1: the mask starts at the last prompt token and stops before the last token
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
    expected = torch.tensor([[0, 0, -0.5, -1.0, 0], [0, 0, -2.0, 0, 0], [-0.1, -0.2, -0.3, 0, 0], [-4.0, 0, 0, 0, 0]])
    assert torch.equal(batch["engine_log_probs"], expected)
    assert batch["prompt_lengths"].tolist() == [3, 3, 1, 1]
    assert batch["response_lengths"].tolist() == [2, 1, 3, 1]
    assert batch["tokens"].dtype == torch.long and batch["loss_mask"].dtype == torch.float32


def test_a_wrong_n_is_one_sentence():
    result = RolloutResult([[7], [8], [9]], [[-1.0], [-1.0], [-1.0]], ["stop"] * 3)
    with pytest.raises(ValueError, match="3 responses do not make 2 samples for each of 2 prompts"):
        rollout_batch([[1], [2]], result, n=2)
