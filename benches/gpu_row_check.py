"""Row invariance inside the engine's own steps (``benches/gpu_spec.py --check-rows``).

``gpu_check``'s ``row_invariance`` builds synthetic batches; on an H200 it finds every verify row
equal to the decode of its position, while greedy speculation in deterministic mode still drifts
from plain decoding on the 8B shape with FlashInfer (benches/RESULTS.md, "Second GPU run"). This
asks the same question of the steps the engine really runs: at every layer of every step, each
row j of each verify request is attended again as a one-row decode of its position (its K/V are
already in the cache, written by this layer's ``write_kv``) by a second backend of the same kind,
mode and tile floor, and compared bitwise with the engine's output for that row. The second
backend keeps the engine's plans untouched. Eager steps only (a hooked ``attend`` is not captured
in a CUDA graph).
"""

from __future__ import annotations

import torch

from tokenbudget.kernels.attention.torch_ref import TorchRefBackend


def _twin(backend):
    """A fresh backend like ``backend``: same kind, spec, device, mode and tile floor."""
    if backend.name == "torch_ref":
        return TorchRefBackend(backend.spec, backend.device)
    twin = type(backend)(backend.spec, backend.device, deterministic=backend.deterministic,
                         flashinfer=backend._fi)
    twin.q_len_floor = backend.q_len_floor
    return twin


class RowCheck:
    """Wraps ``backend.attend`` (an instance attribute, so ``uninstall`` restores the class's)."""

    def __init__(self, backend, num_layers: int, max_records: int = 64) -> None:
        self.backend, self.num_layers, self.max_records = backend, num_layers, max_records
        self.twin = _twin(backend)
        self.calls = self.rows_checked = self.rows_unequal = 0
        self.records: list[dict] = []
        self._attend = backend.attend
        backend.attend = self._checked_attend

    def uninstall(self) -> None:
        del self.backend.attend

    def _checked_attend(self, q: torch.Tensor, kv_cache: torch.Tensor, md) -> torch.Tensor:
        out = self._attend(q, kv_cache, md)
        step, layer = divmod(self.calls, self.num_layers)
        self.calls += 1
        no_write = torch.full((1,), -1, dtype=torch.long, device=q.device)
        for b, kv_len in enumerate(md.kv_lens):
            start, q_len = md.qo_indptr[b], md.qo_indptr[b + 1] - md.qo_indptr[b]
            if q_len < 2:
                continue
            for j in range(q_len):
                dmd = self.twin.build_metadata([0, 1], [kv_len - (q_len - 1 - j)], [md.block_tables[b]], no_write)
                row = self.twin.attend(q[start + j:start + j + 1], kv_cache, dmd)[0]
                self.rows_checked += 1
                if not torch.equal(row, out[start + j]):
                    self.rows_unequal += 1
                    if len(self.records) < self.max_records:
                        self.records.append({"step": step, "layer": layer, "request": b, "row": j, "q_len": q_len,
                                             "kv_len": kv_len, "batch": len(md.kv_lens),
                                             "max_abs_diff": (row.float() - out[start + j].float()).abs().max().item()})
        return out

    def report(self) -> dict:
        """Prints one line and returns the counts and the first records (for the bench's JSON)."""
        print(f"row check: {self.rows_unequal} of {self.rows_checked} verify rows differ from a decode of their "
              f"position; first: {self.records[:3]}", flush=True)
        return {"rows_checked": self.rows_checked, "rows_unequal": self.rows_unequal, "records": self.records}


__all__ = ["RowCheck"]
