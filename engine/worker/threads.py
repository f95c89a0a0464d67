"""How many threads torch uses on the CPU, chosen on purpose and reported at start-up.

torch's default is one thread per logical CPU. On a shared 2-core machine whose other core is
busy, two threads were many times slower than one (benches/RESULTS.md, "Figures behind decisions
in the source"): an intra-op thread waiting for a core that another process holds stalls every
GEMM. So the default is the number of *physical* cores this
process may run on (affinity mask, cgroup CPU quota, SMT siblings counted once), minus the cores
other processes keep busy (the 1-minute load average, read before the engine starts any work),
and at least one. ``EngineConfig.num_threads`` overrides it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def _cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int]) -> int:
    """Cores among ``cpus`` with SMT siblings counted once (all of them when topology is unknown)."""
    groups = set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                groups.add(f.read().strip())
        except OSError:
            return len(cpus)
    return len(groups)


def cgroup_cpu_limit() -> float | None:
    """CPUs granted by a cgroup v2 quota (``cpu.max``), or None when unlimited or unknown."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def default_num_threads() -> int:
    cpus = _cpus()
    n = physical_cores(cpus)
    limit = cgroup_cpu_limit()
    if limit is not None:
        n = min(n, max(1, math.floor(limit)))
    try:
        busy = math.floor(os.getloadavg()[0])
    except OSError:
        busy = 0
    return max(1, min(n, len(cpus) - busy))


def set_torch_threads(num_threads: int | None) -> int:
    """Set torch's intra-op threads (``None``: :func:`default_num_threads`); return the count."""
    n = num_threads if num_threads else default_num_threads()
    torch.set_num_threads(n)
    return n


@contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """``n`` intra-op threads inside, the engine's count restored after. Used by the EAGLE-3 drafter
    (``engine.drafters.eagle3_proposer``): drafting at small batch is many tiny ops, and every
    parallel op waits for all its threads: on a busy 2-core machine a second thread made a draft
    step many times slower (benches/RESULTS.md, "Figures behind decisions in the source"), so
    small work runs on one thread and large catch-ups (a prompt) on the engine's count."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
