"""`bf16: auto | true | false`: bf16 where the device runs it faster, fp32 elsewhere, and the run says which and why.

ONEDNN_MAX_CPU_ISA=AVX2 makes any CPU's oneDNN behave as on an AVX2-only one (no native bf16 kernels: its bf16
matmul falls ~50× below fp32), so both kinds of CPU are exercised on whichever machine runs the tests.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from mindrl.launch import run_ranks
from mindrl.platform.precision import Bf16Speed, choose
from tests import jobs

FAST = Bf16Speed(True, "bf16 matmul 400 vs fp32 100 GFLOP/s on this CPU, 4×", 4.0)
SLOW = Bf16Speed(False, "bf16 matmul 2.4 vs fp32 100 GFLOP/s on this CPU, 0.024×, no native bf16 kernels", 0.024)
AVX2 = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1"}


def test_auto_takes_bf16_where_it_is_fast_and_fp32_elsewhere_saying_why():
    fast, slow = choose("auto", FAST, "actor_config"), choose("auto", SLOW, "actor_config")
    assert (fast.bf16, fast.params_dtype, fast.slow_bf16) == (True, "bf16", False)
    assert fast.line == f"precision: bf16 (actor_config.bf16: auto; {FAST.evidence})"
    assert (slow.bf16, slow.params_dtype, slow.slow_bf16) == (False, "fp32", False)
    assert slow.line == f"precision: fp32 (actor_config.bf16: auto; {SLOW.evidence})"


def test_true_is_obeyed_and_warns_once_where_bf16_is_slow():
    slow = choose(True, SLOW, "megatron_training")
    assert slow.bf16 and slow.slow_bf16 and "\n" not in slow.line
    assert slow.line.startswith("warning: megatron_training.bf16 is true but bf16 is slow here (")
    assert SLOW.evidence in slow.line and "set bf16: auto or false" in slow.line
    fast = choose(True, FAST)
    assert fast.bf16 and not fast.slow_bf16 and not fast.line.startswith("warning")


def test_false_and_a_resumed_run_need_no_measurement():
    assert choose(False, None).params_dtype == "fp32"
    kept = choose("auto", None, "actor_config", resumed_bf16=True)
    assert kept.bf16 and kept.line == ("precision: bf16 (actor_config.bf16: auto; the checkpoint it resumes was "
                                       "trained in bf16)")
    assert not choose("auto", None, resumed_bf16=False).bf16


_MEASURE = """
import json, torch
from mindrl.platform import get_platform
speed = get_platform("cpu").bf16_speed()
print(json.dumps({"fast": speed.fast, "ratio": speed.ratio, "evidence": speed.evidence,
                  "native": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}))
"""


def _measure(env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", _MEASURE], env=env, capture_output=True, text=True,
                          timeout=jobs.COMMAND_LIMIT_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_an_avx2_only_cpu_measures_bf16_slow():
    avx2 = _measure(AVX2)
    assert not avx2["native"] and not avx2["fast"] and avx2["ratio"] < 0.5, avx2
    assert avx2["evidence"].endswith("no native bf16 kernels")


def test_this_cpu_is_judged_by_its_own_kernels_and_rates():
    here = _measure({**os.environ, "OMP_NUM_THREADS": "1"})
    assert here["fast"] == (here["native"] and here["ratio"] > 1.0), here


def _agreed(rank: int) -> tuple[str, str]:
    from mindrl.distributed import agreed_precision
    from mindrl.platform import get_platform

    platform = get_platform()
    platform.bf16_speed = lambda: SLOW if rank == 1 else FAST  # one rank's device is slow at bf16
    precision = agreed_precision("auto", "actor_config")
    return precision.params_dtype, precision.line


def test_every_rank_trains_in_one_precision_and_the_slowest_rank_decides():
    results = run_ranks(_agreed, 2)
    assert results[0] == results[1]
    assert results[0] == ("fp32", f"precision: fp32 (actor_config.bf16: auto; {SLOW.evidence})")


def _sft(tokenizer, data, save, bf16: str) -> str:
    overrides = [f"megatron_training.tokenizer_name_or_path={tokenizer}", f"megatron_training.data_path={data}",
                 f"megatron_training.save={save}", "megatron_training.train_iters=1",
                 "megatron_training.global_batch_size=8", "megatron_training.save_interval=0",
                 f"megatron_training.bf16={bf16}"]
    done = subprocess.run([sys.executable, str(jobs.ROOT / "cli" / "train_sft.py"), "--config-name", "sft_tiny_cpu",
                           *overrides], cwd=jobs.ROOT, env=AVX2, capture_output=True, text=True,
                          timeout=jobs.JOB_LIMIT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.job
def test_on_an_avx2_cpu_auto_trains_in_fp32_and_true_in_bf16_with_one_warning(tiny_math_data, tmp_path):
    tokenizer, root = tiny_math_data
    auto = _sft(tokenizer, root / "eight", tmp_path / "auto", "auto")
    lines = [line for line in auto.splitlines() if "precision" in line]
    assert len(lines) == 1 and lines[0].startswith("[mindrl] precision: fp32 (megatron_training.bf16: auto; bf16 "
                                                   "matmul "), auto
    forced = _sft(tokenizer, root / "eight", tmp_path / "forced", "true")
    warnings = [line for line in forced.splitlines() if "bf16 is slow here" in line]
    assert len(warnings) == 1 and "×, no native bf16 kernels" in warnings[0], forced
    weights = torch.load(tmp_path / "forced" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt",
                         weights_only=False)["model"]
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}  # it went on in bf16, as asked


@pytest.mark.parametrize("actor_bf16, engine", [(True, "bfloat16"), (False, "float32")])
def test_the_rollout_engine_follows_the_actors_precision_unless_set(actor_bf16, engine):
    from mindrl.rollout.config import GenerateConfig

    assert GenerateConfig().dtype == "auto"
    assert GenerateConfig().engine_dtype(actor_bf16).dtype == engine
    assert GenerateConfig(dtype="float16").engine_dtype(actor_bf16).dtype == "float16"
