"""Device selection and the CPU backend's megatron-core patches (each patch has a test)."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from mindrl.platform import detect, get_platform


@pytest.fixture(scope="module")
def cpu():
    return get_platform("cpu")


def test_auto_detection_finds_cpu_here():
    assert detect() == ("cuda" if torch.cuda.is_available() else "cpu")


def test_cpu_platform_facts(cpu):
    assert (cpu.name, cpu.dist_backend, cpu.ray_resource) == ("cpu", "gloo", None)
    assert cpu.device(3) == torch.device("cpu")
    assert cpu.transformer_config_overrides() == {"use_cpu_initialization": True}


def test_env_variable_overrides_and_unknown_device_is_one_sentence(monkeypatch):
    monkeypatch.setenv("MINDRL_DEVICE", "cpu")
    assert get_platform().name == "cpu"
    monkeypatch.setenv("MINDRL_DEVICE", "tpu")
    with pytest.raises(ValueError, match="unknown device 'tpu'; set device / MINDRL_DEVICE to one of"):
        get_platform()


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed")
def test_npu_without_torch_npu_says_what_to_install():
    with pytest.raises(RuntimeError, match=r"needs torch_npu, which is not installed; install .*\[npu\]"):
        get_platform("npu")


def test_npu_setup_redirects_cuda_calls_as_mindspeed_does(tmp_path):
    """torch_npu cannot run here, so a stand-in package records what the NPU backend imports:
    `import torch_npu` alone leaves megatron-core's torch.cuda calls pointing at CUDA."""
    stub = tmp_path / "torch_npu"
    (stub / "contrib").mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "contrib" / "__init__.py").write_text("")
    (stub / "contrib" / "transfer_to_npu.py").write_text("")
    code = ("import sys, torch; from mindrl.platform.npu import NpuPlatform; NpuPlatform().setup(); "
            "print('torch_npu.contrib.transfer_to_npu' in sys.modules, torch.Tensor.type.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.stdout.split() == ["True", "mindrl.platform.npu"]


def test_npu_setup_points_megatrons_rng_tracker_at_the_npu_generator(tmp_path):
    """megatron's tracker sets the device generator through torch.cuda's private _lazy_call, which
    transfer_to_npu does not redirect: after setup its state functions are the NPU's own."""
    stub = tmp_path / "torch_npu"
    (stub / "contrib").mkdir(parents=True)
    (stub / "__init__.py").write_text(
        "import types, torch\nCALLS = []\n"
        "torch.npu = types.SimpleNamespace(get_rng_state=lambda: CALLS.append('get') or torch.zeros(3),\n"
        "                                  set_rng_state=lambda state: CALLS.append(('set', state.tolist())))\n")
    (stub / "contrib" / "__init__.py").write_text("")
    (stub / "contrib" / "transfer_to_npu.py").write_text("")
    code = ("import torch, torch_npu; from mindrl.platform.npu import NpuPlatform; NpuPlatform().setup(); "
            "from megatron.core.tensor_parallel import random as r; "
            "r._set_cuda_rng_state(r._get_cuda_rng_state(graph_safe=True) + 7); print(torch_npu.CALLS)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.stdout.strip() == "['get', ('set', [7.0, 7.0, 7.0])]"


def test_npu_tensor_type_names_read_as_cuda_for_megatron():
    from mindrl.platform.npu import cuda_type_name

    assert cuda_type_name("torch.npu.BFloat16Tensor") == "torch.cuda.BFloat16Tensor"
    assert cuda_type_name("torch.FloatTensor") == "torch.FloatTensor"
    assert cuda_type_name(torch.float32) is torch.float32


@pytest.mark.npu
def test_npu_runs_megatron_cuda_calls_on_the_npu():
    platform = get_platform("npu")
    assert torch.zeros(1, device="cuda").device.type == "npu"
    assert torch.ones(2, device=platform.device()).type() == "torch.cuda.FloatTensor"
    torch.cuda.synchronize()


def _npu_train(rank: int):
    from mindrl.config import ParallelConfig, load_model_arch
    from mindrl.models.parity import train_replicas

    return train_replicas(rank, load_model_arch("tiny_qwen"), ParallelConfig(1, 1), steps=3)


@pytest.mark.npu
def test_npu_distributed_optimizer_trains():
    from mindrl.launch import run_ranks

    result = run_ranks(_npu_train, 1, device="npu")[0]
    assert result.optimizers == {"DistributedOptimizer"} and result.losses[-1] < result.losses[0]


def test_no_module_outside_platform_names_a_device_kind():
    import re
    from pathlib import Path

    import mindrl

    device_code = re.compile(r"torch\.(cuda|npu)\b|torch_npu|[\"'](cuda|npu)[\"':]")
    root = Path(mindrl.__file__).parent
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.parent.name != "platform" and device_code.search(p.read_text())]
    assert offenders == []
    assert device_code.search('x = torch.zeros(1, device="cuda")')


def test_patch_current_device_is_the_host(cpu):
    assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.ones(2).to(device=torch.cuda.current_device()).device.type == "cpu"


def test_patch_device_mode_maps_cuda_tensors_to_cpu(cpu):
    assert torch.zeros(3, device="cuda").device.type == "cpu"
    assert torch.empty(2, device=torch.device("cuda", 0)).device.type == "cpu"
    x = torch.arange(4.0)
    assert x.cuda() is x
    assert x.to("cuda").device.type == "cpu"
    assert x.type() == "torch.cuda.FloatTensor"
    assert x.to(torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert x.long().type() == "torch.LongTensor"


def test_rollout_calls_run_without_the_device_mode_and_get_it_back(cpu):
    """Rollout engines run outside the CUDA→CPU mapping (its hook on every torch call costs rollout time); the
    Megatron code after them must find the mapping again, also when the engine's call raised."""
    from torch.overrides import _get_current_function_mode

    from mindrl.platform.cpu_patches import CudaToCpuMode

    assert isinstance(_get_current_function_mode(), CudaToCpuMode)
    with pytest.raises(RuntimeError, match="engine failed"), cpu.rollout_calls():
        assert _get_current_function_mode() is None
        raise RuntimeError("engine failed")
    assert torch.zeros(1, device="cuda").device.type == "cpu"


def test_patch_device_mode_is_entered_in_new_threads(cpu):
    import threading

    seen = []

    def worker():
        get_platform("cpu")
        seen.append(torch.zeros(1, device="cuda").device.type)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == ["cpu"]


def test_patch_sync_primitives_are_cpu_twins(cpu):
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    sum(range(10000))
    end.record()
    end.synchronize()
    assert end.elapsed_time(start) <= 0 <= start.elapsed_time(end)
    stream = torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.Stream())
    with torch.cuda.stream(stream):
        pass


def test_patch_rng_tracker_forks_the_host_generator(cpu):
    """Megatron's model-parallel RNG fork must give a reproducible stream of its own and
    leave the default stream where it was."""
    from megatron.core.tensor_parallel import random as mp_random

    mp_random.initialize_rng_tracker(force_reset=True)
    tracker = mp_random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(7)
    with tracker.fork():
        a = torch.rand(3)
    after_fork = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(after_fork, torch.rand(3))  # default stream untouched by the fork
    torch.manual_seed(123)
    assert torch.equal(a, torch.rand(3))  # the fork drew from the tracker's own seed
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the forked stream advanced


def test_patches_are_not_applied_without_the_cpu_platform():
    code = ("import torch, mindrl.platform as p; import megatron.core; "
            "print(torch.cuda.current_device.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "torch.cuda"


def test_warning_filters_hide_only_the_notices_they_are_for():
    """mindrl silences megatron-core's fallback notices; the same words from elsewhere, and torch's
    non-leaf .grad warning for the user's own code, must still reach the user."""
    code = """
import warnings, torch
import mindrl
from mindrl.platform import get_platform
get_platform("cpu")
with warnings.catch_warnings(record=True) as seen:
    import mindrl.models.gpt  # megatron-core's layer specs announce the apex fallback on import
    from mindrl.models.optimizer import wrap_for_training
megatron_notices = [str(w.message) for w in seen if not issubclass(w.category, DeprecationWarning)]
with warnings.catch_warnings(record=True) as seen:
    warnings.warn("Apex is not installed. Falling back to Torch Norm")
    (torch.ones(2, requires_grad=True) * 2).grad
print(megatron_notices)
print(sorted(str(w.message)[:30] for w in seen))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    notices, shown = out.stdout.strip().splitlines()
    assert notices == "[]"
    assert shown == "['Apex is not installed. Falling', 'The .grad attribute of a Tenso']"
