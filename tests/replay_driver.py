"""``ReplayDriver``: a CUDA-graph driver stand-in for tests (imported, not a conftest), so the
graph runner's bucketing and replay logic runs on the CPU."""

from __future__ import annotations

import torch


class ReplayDriver:
    """Graph driver stand-in: capture runs ``fn`` once; replay re-runs it into the same output."""

    def __init__(self) -> None:
        self.captures = 0

    def capture(self, fn, num_warmup):
        self.captures += 1
        out = fn()

        def replay():
            with torch.inference_mode():
                out.copy_(fn())
        return replay, out

    def synchronize(self) -> None:
        pass
