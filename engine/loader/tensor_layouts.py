"""Which tensors a model file of each family holds and the shape each must have, as tables.

A :class:`TensorLayout` maps tensor names (``{i}``: a layer index) to shapes written as
expressions over :class:`~engine.loader.model_dims.ModelDims` (``"heads * head_dim"``; ``+``,
``*``, ``//`` and integers), in Hugging Face order ``(rows, columns)`` = ``(out, in)``; GGUF's
``ne`` order is the reverse. ``required`` lists the names every file must hold; an entry
``"a | b c"`` is satisfied by ``a`` alone or by ``b`` and ``c`` together (Phi-3's fused
``attn_qkv`` or the split projections). A tensor the table does not name is not checked here
(the loaders refuse names they cannot map).

:func:`check_tensor_shapes` holds a file's tensors to its layout and its sizes: the layer indices
present are exactly ``0 .. layers - 1``, every required tensor is there, every named tensor has
its shape; a mismatch names the tensor, the key(s) the expected size came from, and both
numbers. Only shapes are read (headers), never tensor data.

Adding a family: an entry in ``GGUF_LAYOUTS`` (keyed by ``general.architecture``), usually the base
layout with a few names added or reshaped. A family without an entry gets the base shapes for the
tensors it has and no required list. Hugging Face checkpoints have no table here: their tensors are
held to the model's own (``engine.model.weights.expected_shapes``), the names GGUF files are
renamed to as well.
"""

from __future__ import annotations

import ast
import functools
import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields

from tokenbudget.engine.loader.model_dims import ModelDims

__all__ = ["TensorLayout", "GGUF_LAYOUTS", "GGUF_LAYER_RE", "HF_LAYER_RE", "layout_for", "check_layers",
           "layer_indices", "check_tensor_shapes"]

Shape = tuple[str, ...]


@dataclass(frozen=True, slots=True)
class TensorLayout:
    shapes: Mapping[str, Shape]
    required: tuple[str, ...] = ()
    rope_is_head_dim: bool = True  # False for families with partial rotary (Phi-3/4)

    def with_(self, *, required: tuple[str, ...] = (), drop: tuple[str, ...] = (),
              shapes: Mapping[str, Shape] | None = None, rope_is_head_dim: bool | None = None) -> TensorLayout:
        """This layout plus ``required`` names (minus ``drop``), with ``shapes`` overridden."""
        return TensorLayout({**self.shapes, **(shapes or {})},
                            tuple(r for r in self.required if r not in drop) + required,
                            self.rope_is_head_dim if rope_is_head_dim is None else rope_is_head_dim)


# a layer's index in each format's tensor names (at most 9 digits: a longer one is no layer)
GGUF_LAYER_RE = re.compile(r"blk\.(\d{1,9})\.")
HF_LAYER_RE = re.compile(r"model\.layers\.(\d{1,9})\.")

_QKV = "heads * head_dim + kv_heads * head_dim + kv_heads * v_head_dim"

_GGUF_BASE = TensorLayout(
    shapes={
        "token_embd.weight": ("vocab", "hidden"), "output.weight": ("vocab", "hidden"),
        "output_norm.weight": ("hidden",), "rope_freqs.weight": ("rope_dim // 2",),
        "blk.{i}.attn_norm.weight": ("hidden",), "blk.{i}.ffn_norm.weight": ("hidden",),
        "blk.{i}.post_attention_norm.weight": ("hidden",), "blk.{i}.post_ffw_norm.weight": ("hidden",),
        "blk.{i}.attn_q.weight": ("heads * head_dim", "hidden"),
        "blk.{i}.attn_k.weight": ("kv_heads * head_dim", "hidden"),
        "blk.{i}.attn_v.weight": ("kv_heads * v_head_dim", "hidden"),
        "blk.{i}.attn_qkv.weight": (_QKV, "hidden"),
        "blk.{i}.attn_output.weight": ("hidden", "heads * v_head_dim"),
        "blk.{i}.attn_q.bias": ("heads * head_dim",), "blk.{i}.attn_k.bias": ("kv_heads * head_dim",),
        "blk.{i}.attn_v.bias": ("kv_heads * v_head_dim",), "blk.{i}.attn_qkv.bias": (_QKV,),
        "blk.{i}.attn_output.bias": ("hidden",),
        "blk.{i}.attn_q_norm.weight": ("head_dim",), "blk.{i}.attn_k_norm.weight": ("head_dim",),
        "blk.{i}.ffn_gate.weight": ("ffn", "hidden"), "blk.{i}.ffn_up.weight": ("ffn", "hidden"),
        "blk.{i}.ffn_down.weight": ("hidden", "ffn"),
    },
    required=("token_embd.weight", "output_norm.weight", "blk.{i}.attn_norm.weight", "blk.{i}.attn_q.weight",
              "blk.{i}.attn_k.weight", "blk.{i}.attn_v.weight", "blk.{i}.attn_output.weight",
              "blk.{i}.ffn_norm.weight", "blk.{i}.ffn_gate.weight", "blk.{i}.ffn_up.weight",
              "blk.{i}.ffn_down.weight"))
_GGUF_QK_NORM = ("blk.{i}.attn_q_norm.weight", "blk.{i}.attn_k_norm.weight")
_GGUF_POST_NORMS = ("blk.{i}.post_attention_norm.weight", "blk.{i}.post_ffw_norm.weight")
_GGUF_GEMMA2 = _GGUF_BASE.with_(required=_GGUF_POST_NORMS)

GGUF_LAYOUTS: dict[str, TensorLayout] = {
    "llama": _GGUF_BASE,
    "granite": _GGUF_BASE,
    "qwen2": _GGUF_BASE.with_(required=("blk.{i}.attn_q.bias", "blk.{i}.attn_k.bias", "blk.{i}.attn_v.bias")),
    "qwen3": _GGUF_BASE.with_(required=_GGUF_QK_NORM),
    "gemma2": _GGUF_GEMMA2,
    "gemma3": _GGUF_GEMMA2.with_(required=_GGUF_QK_NORM),
    "olmo2": _GGUF_BASE.with_(  # norms after attention / MLP only; q/k norms over all heads
        required=_GGUF_POST_NORMS + _GGUF_QK_NORM, drop=("blk.{i}.attn_norm.weight", "blk.{i}.ffn_norm.weight"),
        shapes={"blk.{i}.attn_q_norm.weight": ("heads * head_dim",),
                "blk.{i}.attn_k_norm.weight": ("kv_heads * head_dim",)}),
    "phi3": _GGUF_BASE.with_(  # fused qkv (or split) and a fused gate+up in ffn_up; partial rotary
        required=("blk.{i}.attn_qkv.weight | blk.{i}.attn_q.weight blk.{i}.attn_k.weight blk.{i}.attn_v.weight",),
        drop=("blk.{i}.attn_q.weight", "blk.{i}.attn_k.weight", "blk.{i}.attn_v.weight", "blk.{i}.ffn_gate.weight"),
        shapes={"blk.{i}.ffn_up.weight": ("2 * ffn", "hidden"), "rope_factors_long.weight": ("rope_dim // 2",),
                "rope_factors_short.weight": ("rope_dim // 2",)},
        rope_is_head_dim=False),
}

_L = "model.layers.{i}."
def layout_for(layouts: Mapping[str, TensorLayout], family: str) -> TensorLayout:
    """The family's layout; for a family without one, the base shapes and nothing required."""
    if family in layouts:
        return layouts[family]
    return TensorLayout(next(iter(layouts.values())).shapes)


_DIM_NAMES = frozenset(f.name for f in fields(ModelDims))


@functools.cache
def _compile(expr: str) -> tuple[ast.expr, tuple[str, ...]]:
    """Parse a shape expression once; returns the tree and the dims it names (in order)."""
    tree = ast.parse(expr, mode="eval").body
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if node.id not in _DIM_NAMES:
                raise ValueError(f"shape expression {expr!r}: unknown size {node.id!r}")
            names.append(node.id)
        elif not isinstance(node, (ast.BinOp, ast.Add, ast.Mult, ast.FloorDiv, ast.Load, ast.Constant)):
            raise ValueError(f"shape expression {expr!r}: only +, *, // of sizes and integers")
    return tree, tuple(dict.fromkeys(names))


def _evaluate(node: ast.expr, dims: ModelDims) -> int:
    if isinstance(node, ast.Name):
        return getattr(dims, node.id).value
    if isinstance(node, ast.Constant):
        return int(node.value)
    left, right = _evaluate(node.left, dims), _evaluate(node.right, dims)
    return left + right if isinstance(node.op, ast.Add) else left * right if isinstance(node.op, ast.Mult) \
        else left // right


def _expected(shape: Shape, dims: ModelDims) -> tuple[int, ...]:
    return tuple(_evaluate(_compile(expr)[0], dims) for expr in shape)


def _where(shape: Shape, dims: ModelDims) -> str:
    names = dict.fromkeys(n for expr in shape for n in _compile(expr)[1])
    return "; ".join(f"{n}: {getattr(dims, n).source}" for n in names)


def layer_indices(names, layer_re: re.Pattern) -> set[int]:
    return {int(m.group(1)) for n in names if (m := layer_re.match(n))}


def check_layers(present: set[int], dims: ModelDims, path: str) -> None:
    """The layer indices present are exactly ``0 .. layers - 1`` (without building that range:
    ``layers`` is the file's word, up to 2**31)."""
    n = dims.layers.value
    extra = sorted(i for i in present if i >= n)
    if not extra and len(present) == n:
        return
    found = f"layers {min(present)} to {max(present)} ({len(present)} layers)" if present else "no layers"
    first_missing = next((i for i, j in enumerate(sorted(present)) if i != j), len(present))
    detail = f"layer {extra[0]} is present" if extra else f"layer {first_missing} is missing"
    raise ValueError(f"{path}: {dims.layers.source} but the file has tensors for {found}: {detail}")


def _format(shape: Shape) -> str:
    """``("heads * head_dim", "hidden")`` -> ``(heads * head_dim) x hidden``."""
    return " x ".join(f"({e})" if " " in e and len(shape) > 1 else e for e in shape)


def check_tensor_shapes(shapes: Mapping[str, tuple[int, ...]], dims: ModelDims, layout: TensorLayout,
                        layer_re: re.Pattern, path: str) -> None:
    """Hold ``shapes`` (tensor name -> shape in HF order) to ``layout`` and ``dims`` (module doc);
    ``layer_re`` finds a layer index in a name (``GGUF_LAYER_RE``, ``HF_LAYER_RE``)."""
    check_layers(layer_indices(shapes, layer_re), dims, path)
    per_layer = [r for r in layout.required if "{i}" in r]
    for requirement in itertools.chain((r for r in layout.required if "{i}" not in r),
                                       (r.replace("{i}", str(i)) for i in range(dims.layers.value) for r in per_layer)):
        options = [option.split() for option in requirement.split("|")]
        if not any(all(name in shapes for name in option) for option in options):
            missing = [name for name in options[0] if name not in shapes]
            alternatives = " or ".join(" + ".join(option) for option in options[1:])
            raise ValueError(f"{path}: tensor {missing[0]!r} is missing"
                             + (f" (and the alternative {alternatives} is not complete)" if alternatives else ""))
    for template, shape in layout.shapes.items():
        names = ((template.replace("{i}", str(i)) for i in range(dims.layers.value)) if "{i}" in template
                 else (template,))
        expected = _expected(shape, dims)
        for name in names:
            got = shapes.get(name)
            if got is not None and tuple(got) != expected:
                raise ValueError(
                    f"{path}: tensor {name!r} is {' x '.join(map(str, got))}, expected {_format(shape)} = "
                    f"{' x '.join(map(str, expected))} ({'rows x columns; ' if len(shape) == 2 else ''}"
                    f"{_where(shape, dims)})")
    if layout.rope_is_head_dim and dims.rope_dim.value != dims.head_dim.value:
        raise ValueError(f"{path}: {dims.rope_dim.source} rotary dimensions but the head dimension is "
                         f"{dims.head_dim.source} (this family rotates whole heads)")
