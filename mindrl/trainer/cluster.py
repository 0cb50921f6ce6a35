"""Joining a Ray cluster, or starting one on this machine.

`RAY_ADDRESS` (set by `ray start` scripts or by the user) means a running cluster, whose nodes
may still be joining; without it the driver starts a private one-node cluster with this
machine's cores and devices, reachable on this machine only, with no dashboard unless the config asks
for one (Ray 2.60 still starts its per-node agent: its raylet needs it for runtime environments).

Workers' output is not streamed to the driver's terminal: with a run log open (mindrl.console) each
worker process appends everything it writes to that log from its first moment, and a worker's failure
reaches the terminal as the driver's one message about it (mindrl.workers.group).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from mindrl import console
from mindrl.config.errors import ConfigError
from mindrl.config.resources import Cluster

#: seconds between looks at a running cluster that does not yet offer what the run needs (a look is one call to
#: the cluster's control store; a node that joins is seen within this)
POLL_S = 1.0


def connect_when_ready(check: Callable[[Cluster], None], wait_s: float, dashboard: bool = False) -> Cluster:
    """Join the cluster (or start one) and return what it offers once `check` accepts it.

    A running cluster (RAY_ADDRESS) may still be gaining nodes, so it is looked at again every
    POLL_S seconds for up to `wait_s`, saying once what is missing; then `check`'s sentence ends the
    run. A private cluster of this machine will not grow: it is judged once."""
    cluster = connect(dashboard)
    if not os.environ.get("RAY_ADDRESS"):
        check(cluster)
        return cluster
    import ray

    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            check(cluster)
            return cluster
        except ConfigError as err:
            if time.monotonic() >= deadline:
                raise ConfigError(f"{str(err).rstrip('.')} (after waiting {wait_s:.0f} s for nodes to join).") from None
            if not said:
                console.say(f"waiting up to {wait_s:.0f} s for the cluster: {err}")
                said = True
        time.sleep(POLL_S)
        cluster = Cluster.from_ray(ray.cluster_resources())


def connect(dashboard: bool = False) -> Cluster:
    """What the cluster offers, for the caller to check its roles against."""
    import ray

    # Quieter worker logs unless the user chose otherwise; the workers inherit the driver's environment.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if dashboard and not os.environ.get("RAY_ADDRESS"):
        from ray._private.utils import get_dashboard_dependency_error

        if get_dashboard_dependency_error() is not None:
            raise ConfigError('include_dashboard: true needs Ray\'s dashboard packages, which are not installed; run '
                              'pip install "ray[default]==2.60.0" or set it to false.')
    if not ray.is_initialized():
        log = os.environ.get(console.RUN_LOG_ENV)
        runtime_env = {"worker_process_setup_hook": console.WORKER_SETUP_HOOK,
                       "env_vars": {console.RUN_LOG_ENV: log}} if log else None
        address = os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=not log, runtime_env=runtime_env)
        else:
            ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=dashboard, log_to_driver=not log,
                     runtime_env=runtime_env)
    return Cluster.from_ray(ray.cluster_resources())


def wait_for_nodes(address: str, nodes: int, timeout_s: float) -> list[str]:
    """Join the running cluster at `address` and wait until `nodes` nodes are alive; their addresses.

    The multi-node scripts' master runs this before training, so a worker that never joins is one
    sentence naming how many did and which, not a placement that waits for devices that never come."""
    import ray

    ray.init(address=address, log_to_driver=False)
    try:
        deadline = time.monotonic() + timeout_s
        said = None
        while True:
            alive = sorted(node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"])
            if len(alive) >= nodes:
                return alive
            if time.monotonic() >= deadline:
                raise ConfigError(f"only {len(alive)} of {nodes} nodes joined the cluster at {address} within "
                                  f"{timeout_s:.0f} s (joined: {', '.join(alive) or 'none'}); start the worker "
                                  f"script on the missing nodes, check they reach {address}, or lower NNODES.")
            if len(alive) != said:  # once per change, not once per look
                console.say(f"{len(alive)} of {nodes} nodes joined; waiting")
                said = len(alive)
            time.sleep(POLL_S)
    finally:
        ray.shutdown()
