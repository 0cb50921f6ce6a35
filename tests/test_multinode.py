"""Two Ray nodes started by the example scripts, in a network namespace of the test's own (loopback only).

`unshare --net --pid --fork --mount-proc` gives the test a loopback-only network and a PID namespace:
`ray start` / `ray stop` there see nothing of this machine's other processes, and when the namespace's
first process ends the kernel ends every process left in it.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import jobs

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _namespaces_work() -> bool:
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    probe = subprocess.run(["unshare", "--net", "--pid", "--fork", "--mount-proc", "ip", "link", "set", "lo", "up"],
                           capture_output=True)
    return probe.returncode == 0


pytestmark = [pytest.mark.job,
              pytest.mark.skipif(not _namespaces_work(), reason="needs unshare and ip with namespace rights")]


def test_two_nodes_from_the_example_scripts_train_and_refuse_what_they_cannot_run(tiny_math_data, tmp_path):
    """In one namespace: (a) a master whose worker never comes stops with the join sentence; (b) a driver
    asking for more CPUs than the one-node cluster offers stops with the resource sentence after its wait;
    (c) the worker script started before the master (so it retries) and the master train two steps with
    the actor on one node and the reference on the other; (d) the same two nodes start a longer run and the
    worker node's raylet is killed after its first step: the run stops with one sentence naming that node and
    what of the run it held."""
    import torch

    from mindrl.ckpt_convert import hf_to_mcore
    from tests.hf_models import build_hf_model, save_hf_model

    tokenizer, root = tiny_math_data
    save = tmp_path / "run"
    model = build_hf_model("qwen2", seed=5, vocab_size=1024, hidden_size=128, intermediate_size=352,
                           max_position_embeddings=1024, rope_theta=1e6)
    release = hf_to_mcore(save_hf_model(model, tmp_path / "hf"), tmp_path / "mg", "qwen2", 1, 1,
                          params_dtype=torch.float32, progress=False)
    lost = tmp_path / "lost"

    def overrides(save: Path, steps: int) -> str:
        return " ".join([
            f"megatron_training.tokenizer_name_or_path={tokenizer}", f"megatron_training.data_path={root / 'math'}",
            f"megatron_training.save={save}", f"megatron_training.train_iters={steps}",
            "megatron_training.save_interval=0",
            "rl_config.test_interval=0", "rl_config.use_tensorboard=false",
            "generate_config.sampling_config.max_tokens=16", "rl_config.rollout_max_tokens=16",
            "rl_config.overlong_buffer=8", "generate_config.max_num_seqs=32", f"actor_config.load={release}",
            "rl_config.use_integrated_worker=false", "'rl_config.actor_resource={num_cpus: 1}'",
            "'+rl_config.reference_resource={num_cpus: 1}'", "+rl_config.resource_wait_timeout=3"])
    script = f"""
set -u
ip link set lo up
export PATH={BIN}:$PATH PYTHON={sys.executable} RAY={BIN / 'ray'} DEVICE=cpu DEVICES_PER_NODE=1
export MASTER_ADDR=127.0.0.1 NODE_ADDR=127.0.0.1 MASTER_PORT=6380 NNODES=2 CONFIG=grpo_tiny_cpu
export OMP_NUM_THREADS=1 VLLM_LOGGING_LEVEL=ERROR
cd {ROOT}
JOIN_TIMEOUT_S=3 bash examples/r1/qwen25/r1_zero_qwen25_7b_master.sh > {tmp_path}/a.log 2>&1
echo "a=$?"
"$RAY" start --head --port 6381 --node-ip-address 127.0.0.1 --include-dashboard=false --disable-usage-stats \\
  --num-cpus 1 > /dev/null 2>&1
RAY_ADDRESS=127.0.0.1:6381 "$PYTHON" cli/train_grpo.py --config-name grpo_tiny_cpu {overrides(save, 2)} \\
  > {tmp_path}/b.log 2>&1
echo "b=$?"
"$RAY" stop > /dev/null 2>&1
RETRY_S=1 JOIN_TIMEOUT_S=120 bash examples/r1/qwen25/r1_zero_qwen25_7b_worker.sh > {tmp_path}/worker.log 2>&1 &
sleep 1.5
JOIN_TIMEOUT_S=120 bash examples/r1/qwen25/r1_zero_qwen25_7b_master.sh {overrides(save, 2)} > {tmp_path}/c.log 2>&1
echo "c=$?"
wait
RETRY_S=1 JOIN_TIMEOUT_S=120 bash examples/r1/qwen25/r1_zero_qwen25_7b_worker.sh > {tmp_path}/worker_d.log 2>&1 &
sleep 1.5
JOIN_TIMEOUT_S=120 bash examples/r1/qwen25/r1_zero_qwen25_7b_master.sh {overrides(tmp_path / 'lossy', 50)} \\
  > {tmp_path}/d.log 2>&1 &
master=$!
until [ -s {tmp_path}/lossy/metrics.jsonl ] || ! kill -0 $master 2>/dev/null; do sleep 0.2; done
for pid in $(pgrep -x raylet); do  # this namespace's raylets: the one without --head is the worker node's
  if ! tr '\\0' '\\n' < /proc/$pid/cmdline | grep -qx -- --head; then
    tr '\\0' '\\n' < /proc/$pid/cmdline | sed -n 's/^--node_id=//p' > {lost}
    kill -9 $pid
  fi
done
wait $master
echo "d=$?"
wait
"""
    start = time.monotonic()
    job = subprocess.Popen(["unshare", "--net", "--pid", "--fork", "--mount-proc", "bash", "-c", script],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                           env={**os.environ})
    try:
        out, _ = job.communicate(timeout=jobs.JOB_LIMIT_S)
    except subprocess.TimeoutExpired:
        jobs.kill_session(job)
        pytest.fail(f"the namespace's run passed {jobs.JOB_LIMIT_S} s: " +
                    "\n".join((tmp_path / n).read_text()[-2000:] for n in ("a.log", "b.log", "c.log", "d.log")
                              if (tmp_path / n).is_file()))
    logs = {n: (tmp_path / f"{n}.log").read_text() for n in ("a", "b", "c", "worker", "d")}
    assert "a=1" in out and "only 1 of 2 nodes joined the cluster at 127.0.0.1:6380 within 3 s" in logs["a"], logs["a"]
    assert "b=2" in out, logs["b"][-3000:]
    assert "the roles need 1 (actor) + 1 (reference) = 2 CPU but the cluster offers 1 CPU on 1 node" in logs["b"]
    assert "after waiting 3 s for nodes to join" in logs["b"]
    assert "c=0" in out, logs["c"][-5000:] + logs["worker"][-2000:]
    assert "retrying in 1 s" in logs["worker"] and "joined the cluster at 127.0.0.1:6380" in logs["worker"]
    assert "2 nodes joined" in logs["c"]
    actor = next(line for line in logs["c"].splitlines() if line.startswith("[mindrl] actor ranks on"))
    reference = next(line for line in logs["c"].splitlines() if line.startswith("[mindrl] reference ranks on"))
    assert actor.split(" on ")[1] != reference.split(" on ")[1]  # different Ray nodes (both at 127.0.0.1)
    steps = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and "timing/reference_model" in steps[0]
    # (d): one sentence for the lost node, naming the role whose rank was there and its rule-reward scorer
    assert "d=1" in out, logs["d"][-5000:]
    node = lost.read_text().strip()[:8]
    held = [line.split(" ranks on ")[0].removeprefix("[mindrl] ") for line in logs["d"].splitlines()
            if line.startswith("[mindrl] ") and line.endswith(f" ranks on 127.0.0.1 ({node})")]
    errors = [line for line in logs["d"].splitlines() if line.startswith("error:")]
    assert len(held) == 1 and len(errors) == 1, logs["d"][-5000:]
    assert re.match(rf"error: node 127.0.0.1 \({node}\) left the cluster, and with it rule-reward scorer [01] of 2 "
                    rf"and {held[0]} rank 0 of 1; the run stops — .* resume it from its last checkpoint with "
                    rf"actor_config.load", errors[0]), errors[0]
    assert jobs.session_pids(job.pid) == []  # the namespace's end took every process with it
    print(f"namespace run: {time.monotonic() - start:.0f} s")
