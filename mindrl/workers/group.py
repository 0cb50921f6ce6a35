"""A role's Ray actors: one per device, placed together, forming one torch.distributed world.

The group reserves its devices with a placement group (one bundle per rank), starts one
actor per bundle, has rank 0 publish the rendezvous (a store on a port the OS picks; on
loopback when every rank is on one node) and hands it to the others. Methods are then
called on every rank at once, since Megatron's are collectives.

The driver is the run's watchdog: a step's phase waits for its ranks at most `phase_timeout_s`
(rl_config.phase_timeout), since a rank that hangs (stopped, swapped out, stuck in a driver call) also holds
its peers in a collective until COLLECTIVE_TIMEOUT_S, or forever where nothing times out; past it, the ranks
that have not answered are named and the group is killed. A rank lost with its node is reported as the node's
loss, naming everything of the run that node held (`hold`), since all of it is gone at once.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch

from mindrl.config.errors import ConfigError, RunError
from mindrl.config.resources import RoleResource
from mindrl.console import say

#: seconds a collective or the rendezvous may wait before the run fails instead of hanging
COLLECTIVE_TIMEOUT_S = 1800.0


class PlacementTimeout(RunError):
    """The cluster did not offer a role's devices in time."""


class WorkerLost(RunError):
    """A rank's process died (killed, out of memory; NodeLost where its node went with it): the run cannot go on."""


class PhaseTimeout(RunError):
    """A phase of a step ran past rl_config.phase_timeout: the ranks (or scorers) that had not answered are named."""


class NodeLost(RunError):
    """A node left the cluster (its raylet died, the machine went down or off the network), and with it every
    rank and scorer of the run it held."""


class WorkerFailed(RunError):
    """A rank raised: the run cannot go on. The message names the rank and ends with its traceback's last lines;
    the whole traceback is in the run's log."""


#: lines of a failed rank's traceback its message carries
TRACEBACK_TAIL = 8
#: seconds a rank's error waits for news of another rank's death, which it may only follow from: a peer's closed
#: connection fails a collective at once, and Ray reports the dead process a moment later
DEATH_GRACE_S = 3.0
#: seconds to wait for Ray's verdict on a node whose process stopped answering: Ray calls such a process
#: unavailable at once, and declares its node dead after the node's health checks fail (5 misses 3 s apart)
NODE_VERDICT_S = 30.0
#: the resume hint every message about a run that stops ends with
RESUME = "resume it from its last checkpoint with actor_config.load"

#: what of the run each node holds, by Ray node id: (role, unit, index, count), e.g. ("actor", "rank", 0, 2), so
#: that the loss of a node is one message naming all of it rather than the first of its processes to be missed
_HELD: dict[str, list[tuple[str, str, int, int]]] = {}


def hold(node_id: str, role: str, unit: str, index: int, count: int) -> None:
    """Record that `node_id` holds `role`'s `unit` `index` of `count` (a rank, a scorer)."""
    _HELD.setdefault(node_id, []).append((role, unit, index, count))


def release(role: str, unit: str) -> None:
    """Forget every `role` `unit`: the role has been ended."""
    for node_id in list(_HELD):
        _HELD[node_id] = [held for held in _HELD[node_id] if held[:2] != (role, unit)]
        if not _HELD[node_id]:
            del _HELD[node_id]


def numbers(indices: list[int]) -> str:
    """0-3, 6 for [0, 1, 2, 3, 6]: long runs of ranks stay readable."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)


def members(role: str, unit: str, indices: list[int], count: int) -> str:
    """actor rank 1 of 2, actor ranks 0-7 of 16."""
    return f"{role} {unit}{'s' if len(indices) > 1 else ''} {numbers(indices)} of {count}"


def _listing(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def plain(err: Exception) -> str:
    """A Ray error's text without the colour codes Ray puts in it for a terminal (the log is a file)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", str(err)).rstrip()


def death(err: Exception) -> str:
    """How Ray says a process died, in one short line (its message goes on for lines)."""
    return str(err).strip().splitlines()[0][:200]


def time_left(since: float, timeout_s: float) -> float | None:
    """Seconds a phase started at perf_counter time `since` has left of `timeout_s` (None: no limit, at 0)."""
    return max(since + timeout_s - time.perf_counter(), 0.0) if timeout_s > 0 else None


def end_actors(actors: list[Any], skip: set[int], hurried: bool, close_timeout_s: float, role: str,
               unit: str) -> None:
    """Let the actors close, but not those in `skip` (still in a call that ran out of time: a close would wait
    behind it), for seconds only when `hurried` (after a failure, a survivor's close may wait behind a call stuck
    in a collective with the lost one), then end them all (Ray SIGKILLs one that does not close when told, a
    stopped process too) and forget what their nodes held."""
    import ray

    closing = [actor.close.remote() for index, actor in enumerate(actors) if index not in skip]
    if closing:
        ray.wait(closing, num_returns=len(closing), timeout=5.0 if hurried else close_timeout_s)
    for actor in actors:
        ray.kill(actor)
    release(role, unit)


def lost_node(node_id: str, err: Exception) -> NodeLost | None:
    """The error to report for `err`, a process of the run on `node_id` lost, when its node is what was lost:
    one message naming the node and everything of the run it held. A process Ray calls unavailable (its node's
    raylet gone, or only the process) waits up to NODE_VERDICT_S for Ray to declare the node dead; None when the
    node is alive, for the caller to report the one process."""
    import ray
    from ray.exceptions import ActorUnavailableError

    deadline = time.monotonic() + (NODE_VERDICT_S if isinstance(err, ActorUnavailableError) else 0.0)
    while True:
        node = next((node for node in ray.nodes() if node["NodeID"] == node_id), None)
        if node is not None and not node["Alive"]:
            break
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)
    by_role: dict[tuple[str, str, int], list[int]] = {}
    for role, unit, index, count in _HELD.get(node_id, []):
        by_role.setdefault((role, unit, count), []).append(index)
    held = [members(role, unit, indices, count) for (role, unit, count), indices in by_role.items()]
    return NodeLost(f"node {node['NodeManagerAddress']} ({node_id[:8]}) left the cluster, and with it "
                    f"{_listing(held) if held else 'the run’s processes there'}; the run stops — bring the node back "
                    f"(restart Ray there) and {RESUME}.")


def actor_options(resource: RoleResource) -> tuple[dict[str, float], dict[str, Any]]:
    """(one rank's placement bundle, the Ray actor options that claim it)."""
    if resource.kind == "CPU":
        return {"CPU": 1}, {"num_cpus": 1}
    if resource.kind == "GPU":
        return {"GPU": 1}, {"num_cpus": 0, "num_gpus": 1}
    return {resource.kind: 1}, {"num_cpus": 0, "resources": {resource.kind: 1}}


def host_threads(node_resources: Mapping[str, float], kind: str) -> int:
    """OpenMP threads for a device rank: its node's CPUs shared among the node's devices. A device rank claims no
    CPU from Ray (the devices are what is scarce), and Ray gives an actor without CPUs OMP_NUM_THREADS=1, which
    leaves the rank's host work (batches, the optimizer's host parts, torch's CPU ops) one core on a 100-core node."""
    return max(1, int(node_resources.get("CPU", 1) // max(node_resources.get(kind, 1), 1)))


class WorkerGroup:
    def __init__(self, role: str, cls: type, resource: RoleResource, placement_timeout_s: float = 300.0,
                 phase_timeout_s: float = 0.0) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.role, self.world_size = role, resource.count
        #: per rank, the node it runs on (filled at the rendezvous), for messages about it
        self.nodes: list[str] = []
        #: a rank died or failed: the others may be stuck in a collective with it, so closing is not waited for long
        self.lost = False
        #: the other ranks' results of the call that failed: read when the group is killed, so that their errors
        #: (consequences of the failure reported) go to the run's log, not to Ray's "unhandled error" report
        #: on the terminal once the driver drops them
        self.abandoned: list[Any] = []
        #: seconds a phase's call may take on the ranks (rl_config.phase_timeout); 0: no limit
        self.phase_timeout_s = phase_timeout_s
        #: ranks still in a call when its phase ran out of time: they cannot take another (close) before it ends
        self.stuck: set[int] = set()
        bundle, options = actor_options(resource)
        self.placement = placement_group([bundle] * self.world_size, strategy="PACK", name=f"mindrl-{role}")
        ready, _ = ray.wait([self.placement.ready()], timeout=placement_timeout_s)
        if not ready:
            ray.util.remove_placement_group(self.placement)
            raise PlacementTimeout(
                f"{role} asks for {resource} but the cluster ({_describe(ray.available_resources())} free) did not "
                f"offer them within {placement_timeout_s:.0f} s; free devices, add nodes or lower the resource.")
        remote = ray.remote(cls)
        self.actors = []
        to_node = ray.util.placement_group_table(self.placement)["bundles_to_node_id"]
        bundles = ranks_by_node(to_node)
        #: per rank, its Ray node's id, to tell a lost node from a lost process
        self.node_ids = [to_node[bundles[rank]] for rank in range(self.world_size)]
        for rank, node_id in enumerate(self.node_ids):
            hold(node_id, role, "rank", rank, self.world_size)
        node_resources = {node["NodeID"]: node["Resources"] for node in ray.nodes() if node["Alive"]}
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=bundles[rank])
            own = dict(options)
            if resource.kind != "CPU" and "OMP_NUM_THREADS" not in os.environ:  # a value the user set stays
                threads = host_threads(node_resources.get(to_node[bundles[rank]], {}), resource.kind)
                own["runtime_env"] = {"env_vars": {"OMP_NUM_THREADS": str(threads)}}
            # the role's device kind, not what its node has: a num_cpus role on a GPU node still runs on CPU
            self.actors.append(remote.options(scheduling_strategy=strategy, name=f"mindrl-{role}-{rank}",
                                              **own).remote(rank, self.world_size, resource.platform))

    def rendezvous(self, timeout_s: float) -> tuple[str, int]:
        import ray

        self.nodes = self.wait([actor.node.remote() for actor in self.actors])
        if os.environ.get("RAY_ADDRESS"):  # a cluster of several nodes, maybe: say where the role landed
            say(f"{self.role} ranks on {', '.join(sorted(set(self.nodes)))}")
        return ray.get(self.actors[0].rendezvous.remote(len(set(self.nodes)) == 1, timeout_s))

    def call(self, method: str, *args: Any, phase: str | None = None) -> list[Any]:
        """`method(*args)` on every rank; the results by rank. Large arguments go in one object-store put. A
        `phase` of a step (StepTimer's name for it) is given phase_timeout_s."""
        return self.wait(self.call_async(method, *args), phase)

    def wait(self, refs: list[Any], phase: str | None = None, since: float | None = None) -> list[Any]:
        """The results of one call on every rank, by rank. The first rank to fail ends the wait at once, with
        WorkerLost (its process died), NodeLost (its node did) or WorkerFailed (it raised; a ConfigError or
        RunError it raised, already one sentence, stays as it is) naming the role, rank and node: the other ranks
        may be blocked in a collective with it, and would otherwise hold the run until the collective timeout.
        Their own errors, which follow from it, go to the log only. A rank that raised may itself be the
        consequence: a peer's death fails its collective at once, before Ray reports the death, so a death heard
        of within DEATH_GRACE_S is the failure reported. With a `phase`, the call may take phase_timeout_s from
        `since` (a perf_counter time; default now, for a call submitted earlier the time it was), then
        PhaseTimeout names the ranks that have not answered."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        since = time.perf_counter() if since is None else since
        limit_s = self.phase_timeout_s if phase is not None else 0.0
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=time_left(since, limit_s))
            if not done:
                self.lost, self.stuck = True, {rank_of[ref] for ref in pending}
                self.abandoned += pending
                raise self._overdue(phase, sorted(self.stuck))
            try:
                results[rank_of[done[0]]] = ray.get(done[0])
            except (RayActorError, RayTaskError) as err:
                self.lost = True  # the other ranks may be waiting for this one in a collective
                self.abandoned += pending
                rank, cause = rank_of[done[0]], err
                if not isinstance(err, RayActorError):
                    rank, cause = self._death_among(pending, rank_of) or (rank, err)
                raise self._failure(rank, cause) from None
        return [results[rank] for rank in range(len(refs))]

    def _overdue(self, phase: str, ranks: list[int]) -> PhaseTimeout:
        by_node: dict[str, list[int]] = {}
        for rank in ranks:
            by_node.setdefault(self.nodes[rank] if self.nodes else "unknown", []).append(rank)
        where = _listing([f"{'rank' if len(on) == 1 else 'ranks'} {numbers(on)}"
                          f"{f' of {self.world_size}' if i == 0 else ''} on node {node}"
                          for i, (node, on) in enumerate(by_node.items())])
        peers = ": one of them hangs, and the others wait for it in a collective" if len(ranks) > 1 else ""
        return PhaseTimeout(f"{self.role} {where} did not finish the {phase} phase within {self.phase_timeout_s:g} s "
                            f"(rl_config.phase_timeout){peers}; the run stops — {RESUME}, or raise "
                            f"rl_config.phase_timeout if the phase is only slow.")

    @staticmethod
    def _death_among(pending: list[Any], rank_of: dict[Any, int]) -> tuple[int, Exception] | None:
        """A rank among `pending` whose process died within DEATH_GRACE_S, and how: the cause to report when
        another rank's error may only be its consequence. The other ranks' results and errors are dropped."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        deadline = time.monotonic() + DEATH_GRACE_S
        while pending and (left := deadline - time.monotonic()) > 0:
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            for ref in done:
                try:
                    ray.get(ref)
                except RayActorError as err:
                    return rank_of[ref], err
                except RayTaskError:  # a consequence, like the error being reported
                    continue
        return None

    def _failure(self, rank: int, err: Exception) -> Exception:
        """The one error the driver reports for `rank`'s failure; its whole traceback goes to the log."""
        from ray.exceptions import RayActorError

        where = f"{self.role} rank {rank} of {self.world_size} on node {self.nodes[rank] if self.nodes else 'unknown'}"
        if isinstance(err, RayActorError):
            node = lost_node(self.node_ids[rank], err)
            if node is not None:
                return node
            return WorkerLost(f"{where} died ({death(err)}); the run stops — {RESUME}.")
        # Ray raises a RayTaskError that is also the cause's type; its text is the rank's traceback (colour codes
        # and all, for a terminal: gone here)
        traceback = plain(err)
        print(f"{where} failed:\n{traceback}", file=sys.stderr, flush=True)
        if isinstance(err.cause, ConfigError | RunError):  # already the one sentence for the user (a failed save)
            return type(err.cause)(str(err.cause))
        tail = traceback.splitlines()[-TRACEBACK_TAIL:]
        return WorkerFailed("\n".join([f"{where} failed: {type(err.cause).__name__}: {err.cause}", *tail]))

    def call_async(self, method: str, *args: Any) -> list[Any]:
        import ray

        refs = [ray.put(a) if isinstance(a, dict) else a for a in args]
        return [getattr(actor, method).remote(*refs) for actor in self.actors]

    def kill(self, close_timeout_s: float = 60.0) -> None:
        """Let every rank close (engines remove their temporary model folders), then end the actors.

        Closing is bounded (end_actors): a rank that failed or hangs in a collective is ended all the same."""
        import ray

        end_actors(self.actors, self.stuck, self.lost, close_timeout_s, self.role, "rank")
        ray.util.remove_placement_group(self.placement)
        self._log_abandoned()

    def _log_abandoned(self) -> None:
        """The abandoned results' errors, to the run's log (stderr there); the actors are gone, so each settles at
        once (one on a lost node may not within the wait, and is left)."""
        import ray

        if not self.abandoned:
            return
        settled, _ = ray.wait(self.abandoned, num_returns=len(self.abandoned), timeout=10.0)
        for ref in settled:
            try:
                ray.get(ref)
            except Exception as err:  # any outcome of a rank already reported as failed is only logged
                print(f"{self.role}: after the failure reported, another rank's call ended with: {plain(err)}",
                      file=sys.stderr, flush=True)
        self.abandoned = []


def ranks_by_node(bundles_to_node: Mapping[int, str]) -> list[int]:
    """The bundle each rank takes, so that every node's bundles hold consecutive ranks: Megatron's and vLLM's
    tensor-parallel groups are consecutive ranks, and PACK promises few nodes, not bundle order (a TP group
    split over nodes runs its every layer's collectives over the network). Nodes come in the order of their
    first bundle."""
    first: dict[str, int] = {}
    for index in sorted(bundles_to_node):
        first.setdefault(bundles_to_node[index], index)
    return sorted(bundles_to_node, key=lambda index: (first[bundles_to_node[index]], index))


def gather_rows(results: list[tuple[int, torch.Tensor, torch.Tensor] | None], dp_size: int) -> torch.Tensor:
    """The whole batch's rows, in its order, from the (data-parallel rank, rows, their places in the batch) parts
    the result-holding ranks returned (a balanced pass gives each rank rows from anywhere in the batch)."""
    parts = {}
    for item in results:
        if item is not None:
            parts.setdefault(item[0], item[1:])
    if sorted(parts) != list(range(dp_size)):
        raise RuntimeError(f"results came from data-parallel ranks {sorted(parts)} of {dp_size}; every "
                           f"data-parallel rank's last pipeline stage must return its rows.")
    values = torch.cat([parts[rank][0] for rank in range(dp_size)])
    places = torch.cat([parts[rank][1] for rank in range(dp_size)])
    return torch.empty_like(values).index_copy_(0, places, values)


def _describe(resources: dict[str, float]) -> str:
    kinds = [f"{resources[k]:g} {k}" for k in ("NPU", "GPU", "CPU") if resources.get(k)]
    return ", ".join(kinds) or "nothing"
