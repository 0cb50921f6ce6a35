"""Joining a Ray cluster, or starting one on this machine.

`RAY_ADDRESS` (set by `ray start` scripts or by the user) means a running cluster; without
it the driver starts a private one-node cluster with this machine's cores and devices, no
dashboard, reachable on this machine only.
"""

from __future__ import annotations

import os

from mindrl.trainer.resources import Cluster


def connect() -> Cluster:
    """What the cluster offers, for the caller to check its roles against."""
    import ray

    # Quieter worker logs unless the user chose otherwise; the workers inherit the driver's environment.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=True)
        else:
            ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=True)
    return Cluster.from_ray(ray.cluster_resources())
