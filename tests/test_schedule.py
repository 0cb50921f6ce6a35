"""The asynchronous schedule's rules (mindrl/trainer/schedule.py) over random generation and training times: no
trained token older than max_staleness versions, no group trained twice, every admitted group trained or dropped."""

import random

import pytest

from mindrl.rollout.base import LENGTH, STOP, RolloutResult, ToolStats
from mindrl.trainer.schedule import Schedule, batch_of, buffered_rows, saved_shape


def _round(schedule: Schedule, engine_version: int, rng: random.Random, stop_share: float = 0.3):
    """What an engine would answer: each request's tokens (token = engine version, so the test can tell), a stop
    with probability `stop_share` before its budget."""
    requests = schedule.requests()
    responses, reasons = [], []
    for r in requests:
        stop = rng.random() < stop_share
        length = rng.randint(1, r.max_tokens) if stop else r.max_tokens
        responses.append([engine_version] * length)
        reasons.append(STOP if stop else LENGTH)
    result = RolloutResult(responses, [[-0.5] * len(t) for t in responses], reasons)
    return requests, result


def _simulate(seed: int, max_staleness: int, max_split: int, steps: int = 12, groups: int = 3, n: int = 2):
    """An event loop like the streaming driver's: the rollout runs rounds back to back (each taking a random time),
    the trainer trains whenever a batch is ready (a random time), and each update's weights reach the engine at the
    end of the round in flight (a partial rollout's abort point)."""
    rng = random.Random(seed)
    schedule = Schedule(n, groups, max_tokens=12, max_staleness=max_staleness, max_split=max_split)
    rows = iter(range(10_000))
    version = engine_version = 0
    clock, round_end, train_end = 0.0, None, None
    trained, batch, pending_push = [], None, False
    while len(trained) < steps:
        if round_end is None:
            if pending_push:
                engine_version, pending_push = version, False
            room = schedule.room(version)
            schedule.admit((row, [1, 2, row]) for row in (next(rows) for _ in range(room)))
            requests, result = _round(schedule, engine_version, rng)
            round_end = clock + rng.expovariate(1.0) if requests else None
        if train_end is None and batch is None:
            batch = schedule.take(version)
            if batch is not None:
                train_end = clock + rng.expovariate(1.0)
        events = [t for t in (round_end, train_end) if t is not None]
        assert events, "the schedule deadlocked: no round to run and no batch to train"
        clock = min(events)
        if round_end == clock:
            schedule.add(requests, result, engine_version)
            round_end = None
        if train_end == clock:
            _, results, versions = batch_of(batch)
            trained.append((version, [g.index for g in batch], versions, results))
            version, batch, train_end, pending_push = version + 1, None, None, True
    return schedule, trained


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("max_staleness,max_split", [(0, 1), (1, 1), (2, 3), (2, 1), (4, 4)])
def test_no_trained_token_is_older_than_the_bound(seed, max_staleness, max_split):
    schedule, trained = _simulate(seed, max_staleness, max_split)
    seen = set()
    for version, indices, versions, result in trained:
        assert not seen & set(indices), "a group was trained twice"
        seen |= set(indices)
        for tokens, token_versions, response in zip(versions, versions, result.responses, strict=True):
            assert len(tokens) == len(response) and tokens == response  # each token kept its own version
            assert all(version - v <= max_staleness for v in token_versions), (version, token_versions)
            assert token_versions == sorted(token_versions)
        assert all(len(r) <= 12 for r in result.responses)
        assert all(reason in (STOP, LENGTH) for reason in result.finish_reasons)
    # every admitted group is trained or still in flight: in admission order nothing waits past the bound
    assert schedule.dropped == 0 and schedule.admitted == len(seen) + len(schedule.groups)


def test_partial_rollout_spans_versions():
    """Split in 3, a sample whose engine moves on every round takes versions 0, 1, 2 in chunks of 4."""
    schedule = Schedule(1, 1, max_tokens=12, max_staleness=2, max_split=3)
    schedule.admit([(0, [5, 6])])
    for engine_version in range(3):
        (request,) = schedule.requests()
        assert request.max_tokens == 4 and request.ids == [5, 6] + [0] * 4 * engine_version
        schedule.add([request], RolloutResult([[0] * 4], [[-1.0] * 4], [LENGTH]), engine_version)
    (group,) = [g for g in schedule.groups.values() if g.done]
    assert group.samples[0].versions == [0] * 4 + [1] * 4 + [2] * 4
    assert group.samples[0].finish == LENGTH and group.samples[0].segments == 3


def test_batches_leave_in_the_order_of_admission():
    """A younger group that finished first waits for the older one: it may not take its place."""
    schedule = Schedule(1, 1, max_tokens=4, max_staleness=1, max_split=2)
    schedule.admit([(0, [1]), (1, [2])])
    requests = schedule.requests()
    schedule.add(requests, RolloutResult([[1, 1], [1]], [[-1.0] * 2, [-1.0]], [LENGTH, STOP]), 0)
    assert [g.index for g in schedule.groups.values() if g.done] == [1] and schedule.take(0) is None
    schedule.add(schedule.requests(), RolloutResult([[1]], [[-1.0]], [STOP]), 0)
    assert [g.index for g in schedule.take(0)] == [0] and [g.index for g in schedule.take(1)] == [1]


def test_stale_groups_are_dropped_and_admission_follows_the_bound():
    schedule = Schedule(2, 2, max_tokens=4, max_staleness=1)
    assert schedule.room(0) == 4  # (0 + 1 + 1) batches of 2 groups
    schedule.admit([(r, [r + 1]) for r in range(4)])
    assert schedule.room(0) == 0 and schedule.room(1) == 2
    requests = schedule.requests()
    schedule.add(requests, RolloutResult([[1]] * 8, [[-1.0]] * 8, [STOP] * 8), 0)
    assert [g.index for g in schedule.take(1)] == [0, 1]
    assert schedule.take(2) is None and schedule.dropped == 2  # groups 2, 3: version 0 is 2 behind
    assert schedule.room(2) == (2 + 1 + 1) * 2 + 2 - 4  # dropped groups give their room back


def test_state_round_trip_keeps_every_token():
    schedule = Schedule(2, 1, max_tokens=8, max_staleness=2, max_split=2)
    schedule.admit([(7, [1, 2])])
    requests = schedule.requests()
    schedule.add(requests, RolloutResult([[4, 5], [6, 7]], [[-0.1, -0.2], [-0.3, -0.4]], [LENGTH, STOP]), 3)
    again = Schedule(2, 1, max_tokens=8, max_staleness=2, max_split=2)
    again.load_state_dict(schedule.state_dict())
    assert again.state_dict() == schedule.state_dict()
    assert again.requests() == schedule.requests()


def test_a_segment_adds_its_tool_turns_and_a_dropped_groups_segment_counts_as_dropped():
    schedule = Schedule(1, 1, max_tokens=8, max_staleness=0, max_split=2)
    schedule.admit([(0, [1]), (1, [2])])
    requests = schedule.requests()
    stats = [ToolStats(2, ("ok",)), ToolStats(1, ())]
    schedule.add(requests, RolloutResult([[1] * 4, [1] * 4], [[-1.0] * 4] * 2, [LENGTH] * 2, tool_stats=stats), 0)
    requests = schedule.requests()
    schedule.drop_stale(1)  # both groups' oldest token is a version behind: dropped, their segments in flight
    assert schedule.dropped_tokens == 8
    schedule.add(requests, RolloutResult([[2] * 3, [2] * 2], [[-1.0] * 3, [-1.0] * 2], [STOP] * 2), 1)
    assert schedule.dropped_tokens == 8 + 5  # the in-flight segments went with their groups
    again = Schedule(1, 1, max_tokens=8, max_staleness=1, max_split=2)
    again.admit([(0, [1])])
    requests = again.requests()
    again.add(requests, RolloutResult([[1] * 4], [[-1.0] * 4], [LENGTH], tool_stats=[ToolStats(2, ("ok",))]), 0)
    again.add(again.requests(), RolloutResult([[1]], [[-1.0]], [STOP], tool_stats=[ToolStats(1, ("error",))]), 0)
    assert again.groups[0].samples[0].tool_stats == ToolStats(3, ("ok", "error"))


def test_the_saved_shape_is_read_back_or_worked_out_from_the_counts():
    schedule = Schedule(4, 3, max_tokens=8, max_staleness=2)
    schedule.admit([(r, [r]) for r in range(9)])  # three batches admitted
    for _ in range(3):  # one batch trained
        schedule.groups.pop(min(schedule.groups))
    state = schedule.state_dict()
    assert saved_shape(state, 1) == (4, 3)
    old = {k: v for k, v in state.items() if k not in ("n", "batch_groups")}  # a checkpoint of the last release
    assert saved_shape(old, 1) == (4, 3)
    assert buffered_rows(state) == list(range(3, 9))


class _Engine:
    """Answers a round at once, each request a random number of tokens (token = the version that made it): what
    the driver's bookkeeping sees of an engine, without one."""

    def __init__(self, seed: int, max_tokens: int) -> None:
        self.rng, self.max_tokens, self.version = random.Random(seed), max_tokens, 0

    def answer(self, prompts, caps) -> RolloutResult:
        responses, reasons = [], []
        for cap in caps or [self.max_tokens] * len(prompts):
            stop = self.rng.random() < 0.4
            length = self.rng.randint(1, cap) if stop else cap
            responses.append([self.version] * length)
            reasons.append(STOP if stop else LENGTH)
        return RolloutResult(responses, [[-0.5] * len(r) for r in responses], reasons)

    # the actor's worker group, for colocated rounds
    def call(self, method, prompts, n, sampling, images=None, caps=None, phase=None):
        return [(self.answer(prompts, caps), {})]

    # a rollout role, for the engines on devices of their own
    def generate_async(self, prompts, n, sampling, images=None, caps=None):
        return self.answer(prompts, caps), {"rollout/weight_version": self.version}

    def wait(self, pending):
        return pending

    def push(self, version):
        self.version = version
        return {}


class _Loader:
    def __init__(self, batch: int) -> None:
        self.prompts = [type("Prompt", (), {"ids": [1, row], "images": None})() for row in range(1000)]
        self.batch, self.position = batch, 0

    def next_rows(self):
        self.position += self.batch
        return list(range(self.position - self.batch, self.position))


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("mode,max_staleness,max_split", [("sync", 0, 3), ("sync", 1, 2), ("sync", 2, 4),
                                                          ("sync", 3, 4), ("one_step_off_policy", 1, 1),
                                                          ("one_step_off_policy", 1, 3)])
def test_the_driver_finishes_partial_responses_instead_of_dropping_them(seed, mode, max_staleness, max_split):
    """mindrl/trainer/async_rollout.py's step over random response lengths: a response at the bound gets a round
    with its whole budget before the batch is taken, so no group is ever dropped, and none trains past the bound
    (synchronous partial rollout at bound 0: every segment of a batch under the weights it trains at)."""
    from mindrl.rollout.config import SamplingConfig
    from mindrl.trainer.async_rollout import ScheduledRollout
    from mindrl.trainer.metrics import StepTimer

    engine = _Engine(seed, 12)
    role = engine if mode != "sync" else None
    driver = ScheduledRollout(_Loader(3), 2, 3, SamplingConfig(max_tokens=12, seed=1), mode, max_staleness, max_split,
                              engine, role)
    driver.start(0)
    trained = set()
    for version in range(25):
        groups = driver.batch(version, StepTimer())
        _, _, versions = batch_of(groups)
        assert all(version - v <= max_staleness for row in versions for v in row)
        assert not trained & {g.index for g in groups}
        trained |= {g.index for g in groups}
        driver.after_update(version + 1)
    assert driver.schedule.dropped == 0
