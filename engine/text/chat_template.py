"""Chat templates rendered in a sandbox that bounds what one render may cost.

A chat template is code that ships inside the model file, which may come from anywhere; one that
loops or builds a huge string must fail the request that renders it, never take the process's
memory or time (one took 5.3 GB at the first chat). The environment is jinja2's
``ImmutableSandboxedEnvironment`` configured as transformers' ``apply_chat_template`` (so the same
template gives the same text: ``trim_blocks``, ``lstrip_blocks``, loop controls, ``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII), and every template is instrumented when it is
compiled so that each render is held to a :class:`_Budget`:

- **steps**: loop iterations, calls (functions, filters, tests; a macro call counts 50) and outputs
  together at most ``200_000 + 1000 * len(messages)``;
- **characters**: every string the template builds (each output, ``~`` and ``+`` concatenation,
  ``*`` repetition, ``%`` formatting, filter and method results, slices) counts, at most
  ``1 MiB + 16 x`` the characters of its inputs. What could be large is measured *before* it is
  built: a repetition's length, a join's, a replacement's, and the printed size of any container
  (memoised per object, so lists nested from shared references are measured in linear time);
- **numbers**: an integer argument of a call or filter (a width, a count) at most 100 000; integer
  products and powers at most 100 000 bits;
- **time**: 10 s of wall clock, checked every few hundred steps (a backstop for the rest).

Past any of them, or on any error the template raises, the render fails with a ``ValueError``
naming ``chat_template``. ``chat_template_kwargs`` (extra template variables, vLLM's field) are
checked by :func:`check_chat_template_kwargs`.
"""

from __future__ import annotations

import json
import re
import time
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache, wraps
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

__all__ = ["render_chat_template", "check_chat_template_kwargs", "MAX_TEMPLATE_CHARS"]

MAX_TEMPLATE_CHARS = 1 << 20  # a template's own source (real ones are a few KB)
MAX_INT_ARG = 100_000
MAX_INT_BITS = 100_000
BASE_CHARS, CHARS_PER_INPUT_CHAR = 1 << 20, 16
BASE_STEPS, STEPS_PER_MESSAGE = 200_000, 1000
MACRO_STEPS = 50  # a macro call costs tens of simple steps (a frame, a context, a buffer, a join)
SECONDS = 10.0
MAX_KWARGS_CHARS = 1 << 16  # chat_template_kwargs, serialized
_RESERVED_KWARGS = frozenset({"messages", "chat_template", "tokenize"})
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*:([^{}]*)\}")


class _Exceeded(Exception):
    """A render went past its budget (never caught by jinja: not a ValueError/TypeError)."""


class _Budget:
    """The cost one render has spent; one per render, found through :data:`_CURRENT`."""

    def __init__(self, max_steps: int, max_chars: int, seconds: float = SECONDS) -> None:
        self.steps, self.max_steps, self.chars, self.max_chars = 0, max_steps, 0, max_chars
        self.deadline, self.seconds, self._clock_at = time.monotonic() + seconds, seconds, 256
        self._weights: dict[int, tuple[Any, int]] = {}

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.max_steps:
            raise _Exceeded(f"more than {self.max_steps} steps (loop iterations, calls and outputs)")
        if self.steps >= self._clock_at:
            self._clock_at += 256
            if time.monotonic() > self.deadline:
                raise _Exceeded(f"rendering took more than {self.seconds:g} s")

    def room(self, n: int, what: str) -> None:
        """Refuse to build ``n`` more characters when they would not fit."""
        if self.chars + n > self.max_chars:
            raise _Exceeded(f"{what} would take the characters built past {self.max_chars}")

    def built(self, value: Any) -> Any:
        """Count a string (its characters) or a list (its items) the template just made."""
        if isinstance(value, (str, list, tuple)):
            self.chars += len(value)
            self.room(0, "the output")
        return value

    def weight(self, obj: Any, depth: int = 0) -> int:
        """About how many characters printing ``obj`` gives (containers memoised by identity)."""
        if isinstance(obj, str):
            return len(obj)
        if not isinstance(obj, (dict, list, tuple, set, frozenset)):
            attrs = getattr(obj, "_Namespace__attrs", None)  # jinja's namespace() prints its dict
            if not isinstance(attrs, dict):
                return 8
            obj = attrs
        hit = self._weights.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1]
        if depth > 100:
            raise _Exceeded("a value nested more than 100 deep")
        items = [*obj.keys(), *obj.values()] if isinstance(obj, dict) else obj
        total = 2 + 2 * len(items)
        for item in items:
            total += self.weight(item, depth + 1)
            if total > self.max_chars:
                break
        self._weights[id(obj)] = (obj, total)
        return total


_CURRENT: ContextVar[_Budget | None] = ContextVar("chat_template_budget", default=None)


def _budget() -> _Budget:
    # compile-time constant folding runs outside any render: per-operation limits only
    return _CURRENT.get() or _Budget(BASE_STEPS, BASE_CHARS)


def _check_ints(args: tuple, kwargs: dict, what: str) -> None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT_ARG:
            raise _Exceeded(f"{what} was given {v}, more than {MAX_INT_ARG}")


def _wide_format(fmt: str) -> bool:
    """Whether a ``%`` or ``str.format`` string asks for a width or precision past MAX_INT_ARG
    (or one taken from the arguments, ``*``)."""
    for m in _PERCENT_SPEC.finditer(fmt):
        if any(g == "*" or (g and int(g) > MAX_INT_ARG) for g in m.groups()):
            return True
    return any(int(d) > MAX_INT_ARG for spec in _BRACE_SPEC.findall(fmt) for d in re.findall(r"\d+", spec))


def _check_amplifier(name: str, target: Any, args: tuple, kwargs: dict, b: _Budget) -> None:
    """Measure, before it is built, what a few arguments can make huge: ``target.join(items)`` /
    ``items|join(sep)`` (``target`` is then the separator), replace, indent, expandtabs, format,
    and the printing filters."""
    if name == "join" and args:
        sep = target if isinstance(target, str) else str(args[1] if len(args) > 1 else kwargs.get("d", ""))
        b.room(sum(b.weight(x) for x in args[0]) + len(sep) * len(args[0]), "a join")
    elif name == "replace" and isinstance(target, str) and len(args) >= 2:
        b.room((len(target) + 1) * max(1, len(str(args[1]))), "a replace")
    elif name == "indent" and isinstance(target, str):
        width = args[0] if args else kwargs.get("width", 4)
        b.room((target.count("\n") + 1) * (len(width) if isinstance(width, str) else int(width)), "an indent")
    elif name == "expandtabs" and isinstance(target, str):
        b.room(len(target) * (int(args[0]) if args else 8), "expandtabs")
    elif name == "format" and isinstance(target, str):
        if _wide_format(target):
            raise _Exceeded(f"a format width or precision over {MAX_INT_ARG}")
        b.room(len(target) + sum(b.weight(a) for a in (*args, *kwargs.values())), "|format")
    elif name in ("tojson", "pprint", "string", "list"):
        indent = kwargs.get("indent", args[1] if name == "tojson" and len(args) > 1 else None)
        per_char = 1 + (len(indent) if isinstance(indent, str) else int(indent or 0))
        b.room(b.weight(target) * per_char, f"|{name}")


def _guard_filter(name: str, func: Any) -> Any:
    # a filter that receives the context/environment first has its value second
    lead = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0

    @wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        b = _budget()
        b.step()
        if len(args) > lead:
            value, rest = args[lead], args[lead + 1:]
            if hasattr(value, "__next__"):  # measured below, so read once (it would be read anyway)
                value = list(value)
                args = (*args[:lead], value, *rest)
            _check_ints(rest, kwargs, f"|{name}")
            if name == "join":
                _check_amplifier("join", None, (value, *rest), kwargs, b)
            else:
                _check_amplifier(name, value, rest, kwargs, b)
        return b.built(func(*args, **kwargs))
    return guarded


class _Instrument(NodeTransformer):
    """Route every loop, output and ``~`` through the budget (see the module docstring)."""

    @staticmethod
    def _call(name: str, args: list, lineno: int) -> nodes.Call:
        return nodes.Call(nodes.EnvironmentAttribute(name), args, [], None, None, lineno=lineno)

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = self._call("tb_iter", [node.iter], node.lineno)
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Output:
        node = self.generic_visit(node)
        node.nodes = [self._call("tb_out", [nodes.Const(n.data) if isinstance(n, nodes.TemplateData) else n],
                                 n.lineno) for n in node.nodes]
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        node = self.generic_visit(node)
        return self._call("tb_concat", list(node.nodes), node.lineno)

    def visit_Getitem(self, node: nodes.Getitem) -> nodes.Node:
        node = self.generic_visit(node)
        if not isinstance(node.arg, nodes.Slice):  # plain subscripts go through the sandbox's getitem
            return node
        parts = [p if p is not None else nodes.Const(None) for p in (node.arg.start, node.arg.stop, node.arg.step)]
        return self._call("tb_slice", [node.node, *parts], node.lineno)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        self.filters["tojson"] = _tojson
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        self.tests = {name: _guard_filter(name, f) for name, f in self.tests.items()}
        self.globals.pop("lipsum", None)
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        self.tb_iter, self.tb_out, self.tb_concat, self.tb_slice = _iterate, _output, _concat, _slice
        self._instruments = (_iterate, _output, _concat, _slice)

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _Instrument().visit(super()._parse(source, name, filename))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        if __obj in __self._instruments:
            return __obj(*args)
        b = _budget()
        b.step(MACRO_STEPS if isinstance(__obj, Macro) else 1)
        name = getattr(__obj, "__name__", "")
        _check_ints(args, kwargs, f"a call of {name or 'a function'}")
        if name == "join" and args and hasattr(args[0], "__next__"):
            args = (list(args[0]), *args[1:])
        _check_amplifier(name, getattr(__obj, "__self__", None), args, kwargs, b)
        return b.built(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _budget()
        b.step()
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "*" and ints:
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise _Exceeded(f"an integer product of more than {MAX_INT_BITS} bits")
        elif operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(n, int) and hasattr(seq, "__len__"):
                b.room(b.weight(seq) * max(n, 0), "a repetition")
        elif operator == "**" and ints and right > 0 and left.bit_length() * right > MAX_INT_BITS:
            raise _Exceeded(f"an integer power of more than {MAX_INT_BITS} bits")
        elif operator == "+" and hasattr(left, "__len__") and hasattr(right, "__len__"):
            b.room(b.weight(left) + b.weight(right), "a concatenation")
        elif operator == "%" and isinstance(left, str):
            if _wide_format(left):
                raise _Exceeded(f"a format width or precision over {MAX_INT_ARG}")
            b.room(len(left) + b.weight(right), "a % format")
        return b.built(super().call_binop(context, operator, left, right))

    def wrap_str_format(self, value: Any) -> Any:
        """``str.format`` / ``format_map`` (which the sandbox runs through its own formatter):
        widths and the result measured first."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        @wraps(wrapped)
        def guarded(*args: Any, **kwargs: Any) -> str:
            if _wide_format(fmt):
                raise _Exceeded(f"a format width or precision over {MAX_INT_ARG}")
            b = _budget()
            b.room(len(fmt) + sum(b.weight(a) for a in (*args, *kwargs.values())), "str.format")
            return b.built(wrapped(*args, **kwargs))
        return guarded


def _slice(obj: Any, start: Any, stop: Any, step: Any) -> Any:
    b = _budget()
    b.step()
    return b.built(obj[start:stop:step])  # never longer than what it slices: counted after


def _iterate(iterable: Any) -> Any:
    b = _budget()
    for item in iterable:
        b.step()
        yield item


def _output(value: Any) -> str:
    b = _budget()
    b.step()
    if not isinstance(value, str):
        b.room(b.weight(value), "printing a value")
    return b.built(str(value))


def _concat(*parts: Any) -> str:
    b = _budget()
    b.room(sum(b.weight(p) for p in parts), "a ~ concatenation")
    return b.built("".join(str(p) for p in parts))


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    return _BoundedEnvironment().from_string(source)


def check_chat_template_kwargs(value: Any) -> dict[str, Any]:
    """``chat_template_kwargs`` as a dict of JSON values (vLLM's field), or ``ValueError`` naming it:
    string keys, none of ``messages`` / ``chat_template`` / ``tokenize``, at most 64 KiB as JSON."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError("chat_template_kwargs must be an object with string keys")
    if reserved := sorted(_RESERVED_KWARGS & value.keys()):
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)}")
    try:
        size = len(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        raise ValueError("chat_template_kwargs must hold JSON values only") from None
    if size > MAX_KWARGS_CHARS:
        raise ValueError(f"chat_template_kwargs is {size} characters as JSON, more than {MAX_KWARGS_CHARS}")
    return dict(value)


def render_chat_template(source: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                         continue_final_message: bool = False, **variables: Any) -> str:
    """The text of ``messages`` through the template ``source`` (``variables``: ``bos_token``,
    ``tools``, ``enable_thinking``...). ``continue_final_message`` ends the text inside the last
    message, for the model to continue it (transformers' rule). ``ValueError`` naming
    ``chat_template`` on any failure or limit."""
    if not isinstance(source, str) or len(source) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"chat_template must be a string of at most {MAX_TEMPLATE_CHARS} characters")
    if continue_final_message:
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if not messages or not isinstance(messages[-1].get("content"), str):
            raise ValueError("continue_final_message needs a final message with text content")
        messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_TAG}]
    try:
        template = _compile(source)
    except (TemplateError, RecursionError) as exc:
        raise ValueError(f"chat_template does not compile: {exc}") from None
    variables = {"tools": None, "documents": None, **variables}
    token = _CURRENT.set(None)
    try:
        sizer = _Budget(0, 1 << 62)
        inputs = sizer.weight(messages) + sizer.weight(list(variables.values()))
        _CURRENT.set(_Budget(BASE_STEPS + STEPS_PER_MESSAGE * len(messages),
                             BASE_CHARS + CHARS_PER_INPUT_CHAR * inputs))
        text = "".join(template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **variables))
    except _Exceeded as exc:
        raise ValueError(f"chat_template: the render stopped: {exc}") from None
    except TemplateError as exc:
        raise ValueError(f"chat template error: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the template is foreign code: any failure is its own
        raise ValueError(f"chat_template failed: {type(exc).__name__}: {exc}") from None
    finally:
        _CURRENT.reset(token)
    if continue_final_message:
        final = messages[-1]["content"][:-len(_CONTINUE_TAG)]
        at = text.rfind(_CONTINUE_TAG.strip())
        if at < 0 or final.strip() not in text:
            raise ValueError("continue_final_message: the chat_template dropped the final message")
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text
