"""The GPU / NPU paths' logic, checked on CPU: which device and dtype each collective is handed, the environment
a rank sets, when the rollout re-syncs and in which order it wakes, syncs and offloads, what offloading copies,
and where ranks are placed. No device has run these; what can be decided without one is decided here."""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from mindrl.launch import run_ranks
from mindrl.rollout import weight_sync
from mindrl.rollout.base import RolloutEngine, RolloutResult
from mindrl.rollout.config import GenerateConfig
from mindrl.workers.colocated import ColocatedRollout
from mindrl.workers.group import ranks_by_node
from mindrl.workers.megatron_worker import ActorWorker
from mindrl.workers.offload import StorageOffloader

#: what HCCL's AllReduce takes on Atlas A2/A3 (no fp64), a subset of NCCL's
HCCL_REDUCE_DTYPES = {torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.bfloat16}


class Handed(Exception):
    """A collective was reached; the tensor it was handed is recorded."""


class DevicePlatform:
    """A platform double whose device is not the host (meta), as a GPU's or NPU's is not."""

    name = "device"
    pin_memory = False

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("meta")

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass


@pytest.fixture
def handed(monkeypatch):
    """Every tensor collective records its tensor's device and dtype, then stops the caller."""
    seen = []

    def record(tensor, *args, **kwargs):
        seen.append((tensor.device, tensor.dtype))
        raise Handed

    for name in ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        monkeypatch.setattr(dist, name, record)
    return seen


def test_the_sync_agrees_on_success_over_a_tensor_on_the_platforms_device(monkeypatch, handed):
    monkeypatch.setattr(weight_sync, "get_platform", DevicePlatform)
    with pytest.raises(Handed):
        weight_sync._agree(lambda: None, None, "bucket 1")
    assert handed == [(torch.device("meta"), torch.float32)]


def test_the_sync_check_reduces_its_probe_gap_on_the_platforms_device(monkeypatch, handed):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(0, obj))
    actor = SimpleNamespace(platform=DevicePlatform(), dp_size=1, model=None,
                            arch=SimpleNamespace(padded_vocab_size=64), compute_log_prob=lambda *a, **k: None)
    engine = SimpleNamespace(shares_actor_weights=False, prompt_log_probs=lambda rows: [[0.0] * 23 for _ in rows])
    rollout = ColocatedRollout.__new__(ColocatedRollout)
    rollout.actor, rollout.engine, rollout.dtype = actor, engine, torch.float32
    with pytest.raises(Handed):
        rollout._check(weight_sync.SyncStats(digests={"w": "0"}))
    assert handed == [(torch.device("meta"), torch.float32)]


def test_update_metrics_are_reduced_in_fp32_on_the_platforms_device(monkeypatch, handed):
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_data_parallel_group", lambda **kwargs: None)
    worker = SimpleNamespace(is_last_stage=True, platform=DevicePlatform(), par=SimpleNamespace(pp=1))
    with pytest.raises(Handed):
        ActorWorker._global_metrics(worker, [{"pg_loss": torch.tensor(0.5)}, {"pg_loss": torch.tensor(0.25)}])
    (device, dtype), = handed
    assert device == torch.device("meta") and dtype in HCCL_REDUCE_DTYPES


def _environment(rank: int) -> dict:
    from mindrl.distributed import init_distributed

    before = {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]) + 1 + rank, 1, is_master=True,
                          wait_for_workers=False)  # a second, one-rank world: as a Ray actor joins, local rank 0
    init_distributed(0, 1, master_port=store.port, local_rank=0, store_is_served=True)
    return {"spawned": before, "joined": {key: os.environ[key] for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}}


def test_every_rank_names_its_rank_world_and_local_rank_as_vllms_external_launcher_reads_them():
    results = run_ranks(_environment, 2)
    for rank, result in enumerate(results):
        assert result["spawned"] == {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
        assert result["joined"] == {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}


class ForgetfulEngine(RolloutEngine):
    """An engine that, like vLLM after a level-2 sleep, loses its weights when it releases its memory."""

    name = "forgetful"

    def __init__(self, calls: list) -> None:
        self.calls, self.weights = calls, False

    @property
    def holds_weights(self) -> bool:
        return self.weights

    def generate(self, prompts, sampling, n=1):
        assert self.weights, "generated from weights the engine no longer holds"
        return RolloutResult([[1]] * len(prompts) * n, [[0.0]] * len(prompts) * n, ["stop"] * len(prompts) * n)

    def load_weights(self, weights):
        pass

    def resume_weights(self):
        self.calls.append("wake weights")

    def resume_memory(self):
        self.calls.append("wake cache")

    def release_memory(self):
        self.calls.append("release")
        self.weights = False


class Worker:
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls, self.updates, self.dp_rank, self.dp_size = name, calls, 0, 0, 1

    def offload(self, params=True, grads=True, optimizer=True):
        parts = [part for part, on in (("params", params), ("grads", grads), ("optimizer", optimizer)) if on]
        self.calls.append(f"offload {self.name} {'+'.join(parts)}")

    def onload(self):
        self.calls.append(f"onload {self.name}")


def _rollout(calls: list) -> ColocatedRollout:
    cfg = GenerateConfig(dtype="bfloat16", offload_train_param=True, offload_train_grad=True,
                         offload_train_optimizer=True)
    rollout = ColocatedRollout.__new__(ColocatedRollout)
    rollout.actor, rollout.cfg, rollout.synced_update = Worker("actor", calls), cfg, None
    rollout.engine, rollout.agent = ForgetfulEngine(calls), None
    rollout.beside = [Worker("reference", calls), Worker("critic", calls)]

    def sync():
        calls.append("sync")
        rollout.engine.weights, rollout.synced_update = True, rollout.actor.updates
        return {}

    rollout.sync = sync
    rollout._generate_share = lambda prompts, n, sampling, images, max_tokens=None: (
        calls.append("generate"), (rollout.engine.generate(prompts, sampling, n), {}))[1]
    return rollout


def test_weights_are_woken_and_synced_before_the_training_state_goes_and_the_cache_comes():
    calls = []
    _rollout(calls).generate([[1, 2]], n=2)
    assert calls == ["offload actor grads+optimizer", "offload reference grads+optimizer",
                     "offload critic grads+optimizer", "wake weights", "sync", "offload actor params",
                     "offload reference params", "offload critic params", "wake cache", "generate", "release",
                     "onload actor", "onload reference", "onload critic"]


def test_a_second_generation_without_an_update_syncs_again_once_the_engine_dropped_its_weights():
    calls = []
    rollout = _rollout(calls)
    rollout.generate([[1, 2]])
    calls.clear()
    rollout.generate([[1, 2]])  # a DAPO round, or the rollout after a validation: no update since
    assert calls.count("sync") == 1 and calls.index("sync") < calls.index("generate")


def _storages(sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(size, generator=gen) for name, size in sizes.items()}


def test_offload_copies_no_gradient_reuses_its_host_buffers_and_restores_state_bit_for_bit():
    from mindrl.platform import get_platform

    state = _storages({"param": 1000, "grad": 500, "moment": 1000})
    original = {name: tensor.clone() for name, tensor in state.items()}
    offloader = StorageOffloader(get_platform("cpu"))
    buffers = []
    for _ in range(3):
        offloader.offload([state["param"], state["moment"]])
        offloader.offload([state["grad"]], discard=True)
        assert all(t.untyped_storage().nbytes() == 0 for t in state.values())  # the memory is gone
        buffers.append([id(buffer) for buffer in offloader._host.values()])
        offloader.onload()
    assert offloader.copied_bytes == 3 * 2 * 1000 * 4  # the parameter and the moment, never the gradient
    assert buffers[0] == buffers[1] == buffers[2] and len(buffers[0]) == 2  # allocated once, kept
    assert torch.equal(state["param"], original["param"]) and torch.equal(state["moment"], original["moment"])
    assert torch.equal(state["grad"], torch.zeros(500))  # discarded: the next update zeroes it anyway


def test_a_frozen_models_weights_are_copied_to_the_host_once():
    from mindrl.platform import get_platform

    weights = _storages({"reference": 1000})["reference"]
    original = weights.clone()
    offloader = StorageOffloader(get_platform("cpu"))
    for _ in range(3):
        offloader.offload([weights], frozen=True)
        offloader.onload()
    assert offloader.copied_bytes == 1000 * 4 and torch.equal(weights, original)


@pytest.mark.parametrize("bundles, expected", [
    ({0: "a", 1: "b", 2: "a", 3: "b"}, [0, 2, 1, 3]),  # PACK interleaved two nodes' bundles
    ({0: "b", 1: "b", 2: "a", 3: "a", 4: "a", 5: "a"}, [0, 1, 2, 3, 4, 5]),
    ({3: "a", 1: "b", 0: "a", 2: "b"}, [0, 3, 1, 2]),
])
def test_a_nodes_bundles_take_consecutive_ranks(bundles, expected):
    order = ranks_by_node(bundles)
    assert order == expected and sorted(order) == sorted(bundles)
    nodes = [bundles[index] for index in order]
    assert all(len({nodes[i] for i in range(start, start + 2)}) == 1 for start in range(0, len(nodes), 2))


_DEVICE_RANKS = """
import json
import os
import sys

import ray

from mindrl import console
from mindrl.config.resources import RoleResource
from mindrl.workers.group import WorkerGroup


class Rank:
    def __init__(self, rank, world_size, device):
        pass

    def seen(self):
        return os.environ.get("OMP_NUM_THREADS"), os.environ.get(console.RUN_LOG_ENV)

    def close(self):
        pass


# the driver's runtime environment as mindrl.trainer.cluster.connect sets it, on a node of 8 CPUs and 2 GPUs
ray.init(address="local", num_cpus=8, num_gpus=2, include_dashboard=False, log_to_driver=False,
         runtime_env={"env_vars": {console.RUN_LOG_ENV: sys.argv[1]}})
group = WorkerGroup("actor", Rank, RoleResource(sys.argv[2], 2))
print(json.dumps(group.call("seen")))
group.kill()
ray.shutdown()
"""


@pytest.mark.job
@pytest.mark.parametrize("kind, threads", [("GPU", "4"), ("CPU", "1")])
def test_a_device_rank_gets_its_share_of_the_nodes_cores_and_keeps_the_runs_environment(tmp_path, kind, threads):
    """Ray gives an actor that claims no CPU OMP_NUM_THREADS=1; a device rank gets the node's CPUs over its devices
    (8 / 2), beside the run's own variables; a CPU rank keeps the one core it claims."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RAY_ADDRESS")}
    done = subprocess.run([sys.executable, "-c", _DEVICE_RANKS, str(tmp_path / "run.log"), kind], capture_output=True,
                          text=True, timeout=300, env={**env, "RAY_AUTH_MODE": "disabled"},
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[threads, str(tmp_path / "run.log")]] * 2


def test_the_engine_starts_with_the_state_the_rollouts_offload_already_off(monkeypatch):
    from mindrl.workers import colocated

    calls = []
    actor, reference = Worker("actor", calls), Worker("reference", calls)
    actor.model = SimpleNamespace(config=SimpleNamespace(params_dtype=torch.bfloat16))
    actor.arch = actor.par = None
    actor.cfg = SimpleNamespace(seed=0)
    monkeypatch.setattr(colocated, "resolve_backend", lambda cfg: "vllm")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(colocated, "make_engine", lambda *args: calls.append("start engine") or ForgetfulEngine(calls))
    cfg = GenerateConfig(offload_train_param=True, offload_train_grad=True, offload_train_optimizer=True)
    rollout = ColocatedRollout.build(actor, cfg, [], beside=[reference])
    assert calls == ["offload actor params+grads+optimizer", "offload reference params+grads+optimizer",
                     "start engine", "onload actor", "onload reference"]
    assert rollout.cfg.dtype == "bfloat16"  # auto: the actor's precision


@pytest.mark.parametrize("version, accepted", [("0.32.0", True), ("0.32.1+cu130", True), ("0.33.0", False),
                                               ("0.23.0", False)])
def test_a_vllm_release_other_than_the_weight_loaders_is_one_sentence_before_the_engine_starts(version, accepted):
    from mindrl.config import ConfigError
    from mindrl.rollout.vllm_engine import check_vllm_release

    if accepted:
        check_vllm_release(version)
        return
    with pytest.raises(ConfigError, match=rf"needs vLLM 0\.32\.x but this machine has vLLM {version}; install"):
        check_vllm_release(version)


def test_the_gpu_extra_pins_the_vllm_release_the_weight_loader_needs():
    import re
    from pathlib import Path

    from mindrl.rollout.vllm_engine import VLLM_RELEASE

    setup = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    gpu = re.search(r'"gpu": \[([^\]]*)\]', setup).group(1)
    assert f'"vllm=={VLLM_RELEASE}0"' in gpu
