"""The local rank launcher: results come back by rank; a failing rank's traceback reaches the caller."""

import os
import socket

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


def test_the_rendezvous_port_stays_bound_until_the_store_is_dropped():
    """Choosing a free port and binding it later lets a parallel launch take it in between."""
    store = rendezvous_store(2, timeout_s=10)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock, pytest.raises(OSError, match="in use"):
        sock.bind(("127.0.0.1", store.port))
    del store
