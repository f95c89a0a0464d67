"""TEMPORARY (until the target side of issue 27 lands ``set_aux_layers`` on every model object):
the target's tap states taken by wrapping the torch Llama forward's per-layer input norm.

For tap id ``i`` the state is the residual stream at the INPUT of decoder layer ``i`` (Contract 2
in issue 27's plan: HF ``output_hidden_states[i]``): exactly the ``x`` that
``LlamaForCausalLM.forward`` passes to ``rms_norm`` with ``layers[i].input_norm``. The C decoder
forward has no such call, so a ``CpuForwardModel`` is switched to the model's torch forward while
tapped. ``take(num_rows)`` returns the last forward's ``[num_rows, len(ids) * H]`` float32.
"""

from __future__ import annotations

import torch


class AuxTaps:
    def __init__(self, model, layer_ids: tuple[int, ...]) -> None:
        inner = getattr(model, "model", model) if hasattr(model, "cpu_forward") else model
        if hasattr(model, "cpu_forward"):
            model.cpu_forward = None  # the C forward has no per-layer hook: run the torch forward
        self.layer_ids = tuple(layer_ids)
        self._norm_ids = {id(inner.layers[i].input_norm): slot for slot, i in enumerate(self.layer_ids)}
        self._rows: list[torch.Tensor | None] = [None] * len(self.layer_ids)
        plain = inner.rms_norm

        def tapped(x, weight, eps):
            slot = self._norm_ids.get(id(weight))
            if slot is not None:
                self._rows[slot] = x.detach().to(torch.float32)
            return plain(x, weight, eps)

        inner.rms_norm = tapped

    def take(self, num_rows: int) -> torch.Tensor | None:
        rows, self._rows = self._rows, [None] * len(self.layer_ids)
        if any(r is None or r.shape[0] < num_rows for r in rows):
            return None
        return torch.cat([r[:num_rows] for r in rows], dim=-1)
