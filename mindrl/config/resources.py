"""Per-role device requests (`num_npus` | `num_gpus` | `num_cpus`) and whether a cluster can give them.

MindSpeed-RL only knows `num_npus`; mindrl takes the key for the device kind at hand and
maps it to Ray's resource name, so one config shape serves NPU, GPU and CPU clusters. A count
is the TOTAL over all nodes (as in MindSpeed-RL) and is the role's world size: one rank per
device, or per CPU core on a CPU run.

The check runs before Ray starts anything. Without a cluster description it compares with
this machine (a single-node run); a driver joining a running Ray cluster passes
`Cluster.from_ray(ray.cluster_resources())`, which needs no worker to start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mindrl.config.errors import ConfigError
from mindrl.platform import RESOURCE_PLATFORMS

#: config key → Ray resource name
RESOURCE_KEYS = {"num_npus": "NPU", "num_gpus": "GPU", "num_cpus": "CPU"}
_KEY_OF = {kind: key for key, kind in RESOURCE_KEYS.items()}


@dataclass(frozen=True)
class RoleResource:
    """`{num_gpus: 8}`: eight ranks, one GPU each."""

    kind: str
    count: int

    @property
    def key(self) -> str:
        return _KEY_OF[self.kind]

    @property
    def platform(self) -> str:
        return RESOURCE_PLATFORMS[self.kind]

    def __str__(self) -> str:
        return f"{self.key}: {self.count}"

    @classmethod
    def from_dict(cls, where: str, values: Any) -> RoleResource:
        if not isinstance(values, Mapping) or len(values) != 1 or next(iter(values)) not in RESOURCE_KEYS:
            raise ConfigError(f"{where} must be a mapping with exactly one of {', '.join(RESOURCE_KEYS)}, "
                              f"e.g. {{num_gpus: 8}}; got {values!r}.")
        key, count = next(iter(values.items()))
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ConfigError(f"{where}.{key} must be a positive integer (the total over all nodes), got {count!r}.")
        return cls(RESOURCE_KEYS[key], count)


@dataclass(frozen=True)
class Cluster:
    """What a cluster offers, in Ray's resource names ({"CPU": 2} or {"GPU": 16, "CPU": 192})."""

    resources: dict[str, float] = field(default_factory=dict)
    nodes: int = 1

    def offers(self, kind: str) -> int:
        return int(self.resources.get(kind, 0))

    def describe(self) -> str:
        parts = [f"{self.offers(kind)} {kind}" for kind in ("NPU", "GPU", "CPU") if self.offers(kind)]
        return f"{', '.join(parts) or 'nothing'} on {self.nodes} node{'s' if self.nodes > 1 else ''}"

    @classmethod
    def local(cls) -> Cluster:
        """This machine: its CPU cores and the devices of the platform mindrl detects."""
        from mindrl.platform import PLATFORMS, detect

        platform = PLATFORMS[detect()]
        resources: dict[str, float] = {"CPU": os.cpu_count() or 1}
        if platform.ray_resource:
            resources[platform.ray_resource] = platform.device_count()
        return cls(resources)

    @classmethod
    def from_ray(cls, resources: Mapping[str, float]) -> Cluster:
        """From `ray.cluster_resources()`: totals, plus one `node:<ip>` entry per node."""
        nodes = sum(1 for key in resources if key.startswith("node:") and key != "node:__internal_head__")
        return cls({k: v for k, v in resources.items() if k in _KEY_OF}, max(nodes, 1))


def check_resources(groups: list[tuple[str, RoleResource]], cluster: Cluster | None = None,
                    global_batch_size: int | None = None, rule_reward: bool = False) -> None:
    """Raise ConfigError if the disjoint device groups do not fit in `cluster` (default: this machine).

    `groups` holds one entry per set of devices (colocated roles share one); rule rewards run
    one scorer per node, so the prompt batch must split evenly over the nodes.
    """
    cluster = cluster or Cluster.local()
    kinds = {res.kind for _, res in groups}
    if len(kinds) > 1:
        described = ", ".join(f"{roles} {res}" for roles, res in groups)
        raise ConfigError(f"roles ask for different device kinds ({described}); give every role's resource "
                          f"the same key.")
    needed: dict[str, int] = {}
    for _, res in groups:
        needed[res.kind] = needed.get(res.kind, 0) + res.count
    for kind, count in needed.items():
        if count > cluster.offers(kind):
            described = " + ".join(f"{res.count} ({roles})" for roles, res in groups if res.kind == kind)
            raise ConfigError(f"the roles need {described} = {count} {kind} but the cluster offers "
                              f"{cluster.describe()}; lower rl_config's {_KEY_OF[kind]} or colocate roles.")
    if rule_reward and global_batch_size is not None and global_batch_size % cluster.nodes:
        raise ConfigError(f"global_batch_size={global_batch_size} does not split over the {cluster.nodes} nodes' "
                          f"rule-reward scorers; make it a multiple of {cluster.nodes}.")
