"""Sync-bracketed per-component timers for an engine's step (used by benches/gpu_spec.py)."""

from __future__ import annotations

import time
from collections import defaultdict

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Sync-bracketed timers on the runner/model/scheduler/speculator (instance attributes)."""

    def __init__(self, eng) -> None:
        self.eng = eng
        self.cur: dict[str, float] = defaultdict(float)
        self._restore: list[tuple[object, str, object]] = []

    def _wrap(self, obj, name: str, key: str, gpu: bool) -> None:
        fn = getattr(obj, name)
        own = name in vars(obj) if hasattr(obj, "__dict__") else False
        cur_ref, dev = self, self.eng.device

        def timed(*a, **kw):
            if gpu:
                sync(dev)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                if gpu:
                    sync(dev)
                cur_ref.cur[key] += time.perf_counter() - t

        setattr(obj, name, timed)
        self._restore.append((obj, name, fn if own else None))

    def __enter__(self):
        e, r = self.eng, self.eng.runner
        self._wrap(e.scheduler, "schedule", "schedule", False)
        self._wrap(e.scheduler, "plan_update", "update", False)
        self._wrap(e.scheduler, "apply_update", "update", False)
        self._wrap(e.speculator, "propose", "spec", False)
        self._wrap(e.speculator, "commit", "spec", False)
        self._wrap(r, "_prepare", "prepare", True)
        self._wrap(r.model, "forward", "forward", True)
        self._wrap(r.model, "compute_logits", "logits", True)
        self._wrap(r, "sampler", "sampler", True)
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, orig in reversed(self._restore):
            if orig is not None:
                setattr(obj, name, orig)
            else:
                delattr(obj, name)
