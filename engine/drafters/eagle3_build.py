"""Build the EAGLE-3 drafter for a loaded target: find the head, load it, check it fits.

``speculative_config.model`` names a head directory in the published layout
(``engine.model.eagle3.load_eagle3``); omitted, it is the head shipped in the package for the
default model (``engine/model/heads/smollm2-135m-instruct-eagle3``), and only for that target:
a head reads one model's hidden states, so any other target needs its own head. Every mismatch
is a ``ValueError`` naming ``speculative_config.model`` before anything runs: the head's
``vocab_size`` against the target's vocabulary, its ``target_hidden_size`` against the target's
hidden size (the tap states), its ``hidden_size`` against the target's embedding (shared), its tap
layers against the target's depth.

Weights: a head runs after every verify, k times in a row, so at batch 1 its cost is k times
its weight bytes read from memory. On a quantized CPU target (``int8`` / ``int4``) its linears are
quantized the same way, the draft lm head included (``engine.model.eagle3_cpu.quantize_head``: the
C kernels where they run), and its forward is one C call where the C kernels run all of it
(``Eagle3CpuForward``); fp32 and the torch forward otherwise.

The target's tap layers are switched on here, on the engine's runner (``ModelRunner.
set_aux_layers``: its steps then return ``aux_hidden_states``; a CUDA graph wrapper recaptures
its graphs with them).
"""

from __future__ import annotations

import os

from tokenbudget.engine.drafters.eagle3_proposer import Eagle3Proposer
from tokenbudget.engine.model.eagle3 import load_eagle3
from tokenbudget.engine.model.eagle3_cpu import Eagle3CpuForward, quantize_head
from tokenbudget.engine.model.rope import RotaryTable

DEFAULT_TARGET = "smollm2-135m-instruct"
SHIPPED_HEAD = "smollm2-135m-instruct-eagle3"


def shipped_head_dir() -> str:
    from tokenbudget.engine.model import eagle3
    return os.path.join(os.path.dirname(eagle3.__file__), "heads", SHIPPED_HEAD)


def resolve_head_path(model: str | None, target_source: str) -> str:
    """``model`` as given, or the shipped head when the target is SmolLM2-135M-Instruct."""
    if model is not None:
        return os.path.expanduser(model)
    if DEFAULT_TARGET not in os.path.basename(os.path.normpath(target_source)).lower():
        raise ValueError(f"speculative_config.model: no EAGLE-3 head is shipped for {target_source!r} "
                         f"(only for SmolLM2-135M-Instruct): pass the head's directory")
    path = shipped_head_dir()
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"speculative_config.model: the shipped head is missing from {path!r} "
                         "(a broken install?): pass a head directory")
    return path


def build_eagle3_proposer(spec_config, max_model_len: int, target, scheduler, runner) -> Eagle3Proposer:
    if target is None or scheduler is None or runner is None:
        raise ValueError("speculative_config['method'] 'eagle3' needs the loaded target model")
    tcfg = target.config
    path = resolve_head_path(spec_config.model, target.source)
    head = load_eagle3(path, num_target_layers=tcfg.num_hidden_layers, device=target.device, dtype=target.dtype)
    c = head.config
    for name, got, want in (("vocab_size", c.vocab_size, tcfg.vocab_size),
                            ("target_hidden_size", c.target_hidden_size, tcfg.hidden_size),
                            ("hidden_size", c.hidden_size, tcfg.hidden_size)):
        if got != want:
            raise ValueError(f"speculative_config.model: {path!r} has {name}={got}, the target has {want}: "
                             "this head was trained for another model")
    if not all(0 <= i < tcfg.num_hidden_layers for i in c.aux_layer_ids):
        raise ValueError(f"speculative_config.model: {path!r} taps layers {list(c.aux_layer_ids)}, the target "
                         f"has {tcfg.num_hidden_layers}")
    # the engine's positions, whatever the head was trained to (RoPE is a formula: extend the table)
    head._rope = RotaryTable(c.head_dim, c.rope_theta, None, max(c.max_position_embeddings, max_model_len),
                             head.fc.weight.dtype, target.device, positions=max_model_len)
    cpu_forward = None
    if target.quantization in ("int8", "int4") and target.device.type == "cpu":
        quantize_head(head, target.quantization)
        cpu_forward = Eagle3CpuForward.build(head, target.model.embed)
    suffix = None
    if spec_config.enable_suffix_decoding:
        from tokenbudget.spec.suffix import SuffixProposer
        suffix = SuffixProposer.from_config(spec_config, max_model_len)
    runner.set_aux_layers(tuple(c.aux_layer_ids))
    return Eagle3Proposer(head, target.model.embed, max_model_len, scheduler.config.max_num_batched_tokens, suffix,
                          cpu_forward)
