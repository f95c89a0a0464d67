"""What the draft-length controller costs per step, apart from the engine.

``AdaptiveSpecController.choose`` (inside a step of its tables' journal, as in the engine),
``observe`` and ``observe_step``
timed in a loop at batch sizes 1-64, every request with drafts to choose from (caps of 4, the
worst case: a step where no request has a draft returns before any of this), on a synthetic cost
model shaped like the C kernels' (a ~4 ms step). Warm-loop figures: inside the engine the same
calls run right after a forward has evicted the interpreter's working set, and cost ~2-3x more.

    PYTHONPATH=. python benches/controller_overhead.py [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benches.common import print_table, write_json  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from tokenbudget.spec.adaptive import AdaptiveSpecController
    from tokenbudget.spec.cost_model import synthetic_model
    from tokenbudget.spec.step_shape import StepShape

    rows, out = [], {}
    for b in args.batch_sizes:
        cost = synthetic_model(step=4e-3, per_token=2e-4, per_logit_row=5e-5, per_kkey=2e-3, hinges=[3e-4])
        ctrl = AdaptiveSpecController(8, cost)
        reqs = [SimpleNamespace(request_id=f"r{i}", num_computed_tokens=700 + i, max_spec_tokens=None)
                for i in range(b)]
        for r in reqs:   # drafts that pay at every batch size: a full solve every step, no hold
            for _ in range(20):
                ctrl.observe(r.request_id, 4, 4)
        caps, base = [4] * b, StepShape(0, 0, 0, 0.0)
        for _ in range(50):
            ctrl.choose(reqs, base, caps)
        timings = {}
        t = time.perf_counter()
        for _ in range(args.iters):
            for table in ctrl.tables:
                table.begin()
            ctrl.choose(reqs, base, caps)
            for table in ctrl.tables:
                table.commit()
        timings["choose_us"] = (time.perf_counter() - t) / args.iters * 1e6
        t = time.perf_counter()
        for i in range(args.iters):
            ctrl.observe(reqs[i % b].request_id, 4, 4)
        timings["observe_us"] = (time.perf_counter() - t) / args.iters * 1e6
        shape = StepShape(b, 5 * b, 5 * b, 3.5 * b)
        t = time.perf_counter()
        for _ in range(args.iters):
            ctrl.observe_step(shape, 0.006)
        timings["observe_step_us"] = (time.perf_counter() - t) / args.iters * 1e6
        out[b] = timings
        rows.append([b] + [f"{v:.1f}" for v in timings.values()])
    print_table(["B", "snapshot + choose µs", "observe µs (one request)", "observe_step µs"], rows)
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
