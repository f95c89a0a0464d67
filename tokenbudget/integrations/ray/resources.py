"""How many engine actors a Ray Data job runs, and how many CPUs (GPUs) each asks for, from the
resources of the Ray cluster it runs on.

Ray never places an actor that asks for more CPUs than one node has: it waits for it forever,
silently. And Ray Data's own tasks (reading the input, writing the output) need a CPU beside the
actors: when the actors hold every CPU the read task waits forever (measured with ``ray.init(
num_cpus=2)``: 2 actors of 1 CPU over ``read_json`` hang, 1 actor of 1 CPU runs). So:

* ``num_cpus`` unset: a node's CPUs less one (the smallest node's, so an actor fits on every
  node), at least 1; with GPUs, 1 CPU per actor;
* ``concurrency`` unset: as many actors as fit on the nodes while one CPU of the cluster stays
  free for Ray Data's tasks (and as many as the GPUs allow), at least 1;
* an actor asking for more CPUs (GPUs) than any node has is a ``ValueError`` naming
  ``num_cpus`` (``num_gpus``) before Ray starts anything; set values that leave no CPU for Ray
  Data's tasks are run as asked, with a warning saying why the job may wait.

On a 2-CPU machine the defaults are one actor of 1 CPU; on 4 nodes of 16 CPUs, 4 actors of 15.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

logger = logging.getLogger("tokenbudget")


@dataclass(frozen=True, slots=True)
class ActorPlan:
    concurrency: int
    num_cpus: float
    num_gpus: float


def cluster_nodes() -> list[dict[str, float]]:
    """The resources of the alive nodes of the Ray cluster (started here when none is)."""
    import ray

    if not ray.is_initialized():
        ray.init()
    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]


def plan_actors(nodes: list[dict[str, float]], concurrency: int | None, num_cpus: float | None,
                num_gpus: float) -> ActorPlan:
    """The actors for ``nodes`` (each ``{"CPU": n, "GPU": m, ...}``), the given values kept."""
    cpus = [n.get("CPU", 0.0) for n in nodes if n.get("CPU", 0.0) > 0]
    if not cpus:
        raise ValueError("the Ray cluster has no node with a CPU")
    gpus = [n.get("GPU", 0.0) for n in nodes]
    if num_gpus > max(gpus, default=0.0):
        raise ValueError(f"num_gpus={num_gpus:g} per actor: no node of this Ray cluster has that many GPUs "
                         f"(the most is {max(gpus, default=0.0):g})")
    if num_cpus is None:
        num_cpus = 1.0 if num_gpus else float(max(1, int(min(cpus)) - 1))
    elif num_cpus > max(cpus):
        raise ValueError(f"num_cpus={num_cpus:g} per actor: no node of this Ray cluster has that many CPUs (the "
                         f"largest has {max(cpus):g}); Ray would wait for one forever. Ask for at most "
                         f"{max(1, int(max(cpus)) - 1)} (one CPU stays for Ray Data's tasks), or leave num_cpus unset")
    total = sum(cpus)
    if concurrency is None:
        fits = sum(int(c // num_cpus) for c in cpus)
        fits = min(fits, int(max(total - 1, num_cpus) // num_cpus))  # one CPU for reading and writing
        if num_gpus:
            fits = min(fits, int(math.floor(sum(gpus) / num_gpus)))
        concurrency = max(1, fits)
    elif concurrency * num_cpus > total - 1:
        logger.warning("tokenbudget: %d actors of %g CPUs hold %g of the cluster's %g CPUs: Ray Data's read and "
                       "write tasks need one more, and wait until an actor leaves (with read_json or read_parquet, "
                       "forever); leave concurrency unset to size it from the cluster",
                       concurrency, num_cpus, concurrency * num_cpus, total)
    return ActorPlan(concurrency, num_cpus, num_gpus)
