"""Partial rollout on the Megatron-native engine: one response generated in three segments under three versions of
the weights (mindrl/trainer/schedule.py's rounds), each token's version and engine log-prob checked against the actor
recomputing the whole response under each version's weights."""

import pytest
import torch

from mindrl.ckpt_convert import hf_to_mcore
from mindrl.launch import run_ranks
from mindrl.rollout.config import SamplingConfig
from mindrl.trainer.experience import rollout_batch
from mindrl.trainer.schedule import Schedule, batch_of

PROMPT = [5, 17, 99, 3, 42, 7, 8]
MAX_TOKENS, SPLIT, N = 12, 3, 2


def _three_versions(rank: int, checkpoint: str) -> dict:
    from mindrl.rollout.megatron_engine import MegatronEngine
    from tests.test_rollout_megatron import TEMPERATURE, _actor

    actor = _actor(checkpoint)
    engine = MegatronEngine(actor.model, actor.arch, actor.par, [], max_model_len=64)
    schedule = Schedule(N, 1, MAX_TOKENS, max_staleness=2, max_split=SPLIT)
    schedule.admit([(0, PROMPT)])
    weights, generator = [], torch.Generator().manual_seed(3)
    for version in range(SPLIT):
        weights.append([p.detach().clone() for p in actor.model.parameters()])
        requests = schedule.requests()
        sampling = SamplingConfig(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=100 + version)
        result = engine.generate([r.ids for r in requests], sampling, max_tokens=[r.max_tokens for r in requests])
        schedule.add(requests, result, version)
        with torch.no_grad():  # the next version: every weight moved, as an update would
            for p in actor.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
    (group,) = schedule.take(SPLIT - 1)
    prompts, result, versions = batch_of([group])
    batch = rollout_batch(prompts, result, N)
    rescored = []
    for version_weights in weights:
        with torch.no_grad():
            for p, w in zip(actor.model.parameters(), version_weights, strict=True):
                p.copy_(w)
        rescored.append(actor.compute_log_prob(batch)["log_probs"])
    return {"versions": versions, "engine": batch["engine_log_probs"], "mask": batch["loss_mask"],
            "rescored": rescored, "start": len(PROMPT) - 1, "segments": [s.segments for s in group.samples]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from tests.hf_models import build_hf_model, save_hf_model

    folder = tmp_path_factory.mktemp("partial")
    hf = save_hf_model(build_hf_model("qwen2", seed=0), folder / "hf")
    checkpoint = str(hf_to_mcore(hf, folder / "mcore", "qwen2", 1, 1, params_dtype=torch.float32, progress=False))
    return run_ranks(_three_versions, 1, checkpoint)[0]


def test_each_segment_s_tokens_carry_their_version_and_its_log_probs(run):
    assert run["segments"] == [SPLIT] * N
    for row, versions in enumerate(run["versions"]):
        assert versions == [v for v in range(SPLIT) for _ in range(MAX_TOKENS // SPLIT)]
        for position, version in enumerate(versions):
            column = run["start"] + position
            engine = run["engine"][row, column]
            # the log-prob the engine gave equals the actor's under the weights of the token's own version
            assert abs(engine - run["rescored"][version][row, column]) <= 1e-4
            others = [abs(engine - run["rescored"][v][row, column]) for v in range(SPLIT) if v != version]
            assert max(others) > 1e-3  # and not another version's: the segment really ran under its own weights
