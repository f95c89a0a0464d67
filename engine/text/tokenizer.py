"""Tokenizer: a thin, typed wrapper around ``tokenizers.Tokenizer`` plus a chat template.

Two constructors: :meth:`Tokenizer.from_pretrained_dir` (a Hugging Face directory with
``tokenizer.json`` and ``tokenizer_config.json``, the chat template taken from
``chat_template.jinja`` or ``tokenizer_config.json``) and ``gguf_tokenizer.build_gguf_tokenizer``
(a GGUF file's ``tokenizer.*`` metadata; a function of that module, which builds on this one).

Decisions (as in Hugging Face transformers):
- ``encode(text, add_special_tokens=False)`` never adds BOS unless asked; special tokens written
  in the text (``<|im_start|>``) are always recognised, so ``encode(apply_chat_template(...))``
  gives the ids the model was trained on. With ``add_special_tokens=True`` the tokenizer's post
  processor runs (it adds BOS for Llama-style vocabularies that want one).
- The chat template runs in a sandboxed jinja2 environment with ``trim_blocks`` and
  ``lstrip_blocks``, the ``raise_exception`` and ``strftime_now`` globals and a ``tojson``
  filter that keeps non-ASCII characters.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from datetime import datetime
from functools import lru_cache
from typing import Any

import tokenizers
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["Tokenizer"]


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encode/decode text and render chat templates for one model.

    Attributes (safe to read at any time): ``bos_token_id`` / ``eos_token_id`` (``None`` when
    the vocabulary has none), ``chat_template`` (``None`` when the model ships none),
    ``vocab_size`` (including added tokens), ``all_special_ids``.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, chat_template: str | None = None,
                 extra_eos_token_ids: Iterable[int] = ()) -> None:
        self._tok = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        self._extra_eos = [i for i in extra_eos_token_ids if i != self.eos_token_id]
        specials = {tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special}
        specials.update(i for i in (self.bos_token_id, self.eos_token_id) if i is not None)
        self.all_special_ids: list[int] = sorted(specials)

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``)."""
        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise FileNotFoundError(
                f"{path} has no tokenizer.json (only fast tokenizers are supported)")
        backend = tokenizers.Tokenizer.from_file(tok_file)
        cfg: dict[str, Any] = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            with open(cfg_file, encoding="utf-8") as f:
                cfg = json.load(f)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        return cls(backend, bos_token=_token_content(cfg.get("bos_token")),
                   eos_token=_token_content(cfg.get("eos_token")), chat_template=template)

    # ---- vocabulary ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation by default (the EOS token first)."""
        first = [self.eos_token_id] if self.eos_token_id is not None else []
        return first + self._extra_eos

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer`` (do not mutate)."""
        return self._tok

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of ``token_id`` (byte-level form for BPE), None if unknown."""
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # ---- encode / decode ----------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens spelled in the text are always recognised."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        # encode_batch releases the GIL while it works (encode does not): a long text tokenized in
        # a server's preparation thread must not stop its event loop and step thread.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete UTF-8 sequences decode to U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat ---------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        """Render ``messages`` with the model's chat template (or ``chat_template``).

        Extra keyword arguments (``tools``, ``documents``...) are passed to the template.
        Raises ``ValueError`` when there is no template or the template rejects the messages.
        """
        source = chat_template or self.chat_template
        if source is None:
            raise ValueError("this tokenizer has no chat_template; pass chat_template= or a prompt")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        try:
            return _compile_template(source).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **context)
        except TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from exc

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
                f"eos={self.eos_token!r}, chat_template={'yes' if self.chat_template else 'no'})")
