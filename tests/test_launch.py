"""The local rank launcher: results come back by rank; a failing rank's traceback reaches the caller."""

import os
import socket
import sys

import pytest
import torch.distributed as dist

from mindrl.launch import rendezvous_store, run_ranks


def _rank_info(rank: int, tag: str) -> tuple:
    return rank, dist.get_world_size(), dist.get_backend(), tag, os.environ.get("GLOO_SOCKET_IFNAME")


def _fail_on_one(rank: int) -> int:
    if rank == 1:
        raise ValueError("rank one is broken")
    return rank


def test_results_come_back_in_rank_order():
    assert run_ranks(_rank_info, 3, "x") == [(r, 3, "gloo", "x", "lo") for r in range(3)]  # loopback only


def test_failure_carries_the_rank_and_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed:.*ValueError: rank one is broken"):
        run_ranks(_fail_on_one, 2, timeout_s=60)


def _fail_after_the_other(rank: int) -> None:
    import time

    if rank == 0:
        time.sleep(0.5)
        raise ConnectionError("rank one went away")
    raise ValueError("rank one is broken")


def test_a_failure_that_arrives_soon_after_the_first_is_reported_too():
    """The first report may be a consequence of another rank's failure; both tracebacks reach the caller."""
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed:.*rank one is broken.*"
                                           r"rank 0 of 2 failed:.*ConnectionError: rank one went away"):
        run_ranks(_fail_after_the_other, 2, timeout_s=60)


def test_the_rendezvous_port_stays_bound_until_the_store_is_dropped():
    """Choosing a free port and binding it later lets a parallel launch take it in between."""
    store = rendezvous_store(2, timeout_s=10)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock, pytest.raises(OSError, match="in use"):
        sock.bind(("127.0.0.1", store.port))
    del store


def _leave_state_behind(rank: int, exits: str) -> dict:
    """Everything a rank could leave for a later one: Megatron groups, seeded generators, the environment; and an
    exit handler, which a process ending as its own interpreter would runs (vLLM's shared memory is freed so)."""
    import atexit
    import random

    import numpy as np
    from megatron.core import parallel_state

    from mindrl.config import ParallelConfig
    from mindrl.distributed import init_model_parallel

    init_model_parallel(ParallelConfig(2, 1))  # seeds torch and Megatron's tracker; makes the TP / DP groups
    random.seed(1)
    np.random.seed(1)
    os.environ["MINDRL_LEFT_BY_A_RANK"] = "1"
    atexit.register(lambda: open(os.path.join(exits, f"rank{rank}"), "w").close())
    assert parallel_state.model_parallel_is_initialized()
    return _what_a_rank_finds(rank)


def _what_a_rank_finds(rank: int) -> dict:
    import random

    import numpy as np
    import torch
    from megatron.core import parallel_state

    return {"megatron": parallel_state.model_parallel_is_initialized(),
            "groups": len(dist.distributed_c10d._world.pg_map), "world": dist.get_world_size(),
            "left": os.environ.get("MINDRL_LEFT_BY_A_RANK"), "test": os.environ.get("PYTEST_CURRENT_TEST"),
            "draws": (random.random(), float(np.random.rand()), torch.rand(1).item()), "pid": os.getpid()}


def test_a_rank_starts_with_nothing_an_earlier_launch_left_and_ends_as_its_own_interpreter(monkeypatch, tmp_path):
    """Ranks fork from a server that has imported the heavy libraries; each must still be a fresh process: no
    process group but its own, no Megatron state, its own random draws, the environment of its launch."""
    first = run_ranks(_leave_state_behind, 2, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["rank0", "rank1"]
    assert [r["megatron"] for r in first] == [True, True] and first[0]["groups"] > 1
    # a variable no library reads at import: the running server is kept, and the ranks must still see the new value
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "a later test (call)")
    second = run_ranks(_what_a_rank_finds, 3)
    for found in second:
        assert found["megatron"] is False and found["groups"] == 1 and found["world"] == 3
        assert found["left"] is None and found["test"] == "a later test (call)"
    draws = [r["draws"] for r in first + second]
    for kind in range(3):  # Python, numpy and torch: no two ranks draw alike (seeded ranks of `first` neither)
        assert len({d[kind] for d in draws[2:]}) == 3, draws
        assert not {d[kind] for d in draws[2:]} & {d[kind] for d in draws[:2]}
    assert len({r["pid"] for r in first + second}) == 5


def _say(rank: int) -> None:
    # one write of the whole line: under PYTHONUNBUFFERED print's text and its newline are two writes, which the
    # other rank's line can fall between
    sys.stdout.write(f"rank {rank} says hello\n")
    sys.stdout.flush()


def test_a_rank_writes_where_its_launchers_stdout_points_at_the_launch(tmp_path):
    """A spawned rank inherits its launcher's file descriptors of the moment (a run's log redirects them); a rank
    forked from a server started earlier must write there too, not where the server's pointed."""
    run_ranks(_what_a_rank_finds, 1)  # the server is running before the redirect
    out = tmp_path / "out"
    saved = os.dup(1)
    target = os.open(out, os.O_WRONLY | os.O_CREAT)
    try:
        os.dup2(target, 1)
        run_ranks(_say, 2)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(target)
    assert sorted(out.read_text().splitlines()) == ["rank 0 says hello", "rank 1 says hello"]
