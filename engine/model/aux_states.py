"""Auxiliary hidden states: the target's residual stream at chosen layers, kept from a forward.

EAGLE-3 heads read, at every position, the target's hidden states at three layers of the forward
that already runs (prefill chunks, decodes, verifies). A forward asked for them
(``model(input_ids, positions, attn_metadata, kv_caches, aux_layers=ids)``: ``DecoderLM``;
``CpuForwardModel``, whose C forward copies the rows out; the CUDA graph wrapper, whose graphs
keep them) returns ``(hidden, aux)``: ``aux [T, len(ids) * hidden]`` float32 on the model's
device, for the T real (unpadded) rows of the forward in its input order, tap ``ids[j]`` in
columns ``[j * hidden, (j + 1) * hidden)``. Nothing is left on the model: the taps a runner asks
for are the runner's (``ModelRunner.set_aux_layers``, checked by ``check_aux_layers``), and its
step hands them on in ``ModelRunnerOutput.aux_hidden_states``.

Tap id ``i`` is the residual stream at the INPUT of decoder layer ``i`` (the output of layer
``i - 1``; 0 is the token embedding): HF ``output_hidden_states[i]``, and what vLLM's EAGLE-3
target keeps (``hidden_states + residual`` before layer ``i``), so published heads read the
states they were trained on. ``i`` ranges over ``[0, num_layers)``: HF's entry ``num_layers`` is
after the final norm, which no head reads.

The forward runs under ``torch.inference_mode``, so the states are inference tensors: training
code that feeds them to a module with gradients clones them first (outside inference mode).

The states are returned by the forward that computed them (nothing carries over between steps,
so a rolled-back or retried step recomputes them, and a forward that raises leaves none behind).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable


def check_aux_layers(ids: Iterable[int] | None, num_layers: int) -> tuple[int, ...] | None:
    """``ids`` as a tuple of distinct layer indices in ``[0, num_layers)``; None (or empty) = no taps.
    ValueError naming ``aux_layers`` otherwise."""
    if ids is None:
        return None
    try:
        taps = tuple(ids)
    except TypeError:
        raise ValueError(f"aux_layers: expected a sequence of layer indices or None, got {ids!r}") from None
    if not taps:
        return None
    out = []
    for i in taps:
        try:
            if isinstance(i, bool):
                raise TypeError
            j = operator.index(i)  # ints, numpy ints, 0-d integer tensors
        except TypeError:
            j = None
        if j is None or not 0 <= j < num_layers:
            raise ValueError(f"aux_layers: {i!r} is not a decoder layer index in [0, {num_layers})")
        out.append(j)
    taps = tuple(out)
    if len(set(taps)) != len(taps):
        raise ValueError(f"aux_layers: repeated layer index in {taps}")
    return taps


__all__ = ["check_aux_layers"]
