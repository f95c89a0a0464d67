"""Tokenizer: a thin, typed wrapper around ``tokenizers.Tokenizer`` plus a chat template.

Two constructors: :meth:`Tokenizer.from_pretrained_dir` (a Hugging Face directory with
``tokenizer.json`` and ``tokenizer_config.json``, the chat template taken from
``chat_template.jinja`` or ``tokenizer_config.json``, the stop tokens from ``tokenizer_config.json``'s
``eos_token`` and ``generation_config.json``'s ``eos_token_id``) and
``gguf_tokenizer.build_gguf_tokenizer`` (a GGUF file's ``tokenizer.*`` metadata; a function of that
module, which builds on this one).

Decisions (as in Hugging Face transformers):
- ``encode(text, add_special_tokens=False)`` never adds BOS unless asked; special tokens written
  in the text (``<|im_start|>``) are always recognised, so ``encode(apply_chat_template(...))``
  gives the ids the model was trained on. With ``add_special_tokens=True`` the tokenizer's post
  processor runs (it adds BOS for Llama-style vocabularies that want one). A chat prompt is encoded
  without it (:meth:`Tokenizer.chat_prompt`): the template writes BOS itself when the model wants one.
- A vocabulary whose encoding ``tokenizers`` cannot express exactly (SentencePiece from GGUF) brings
  its own ``encoder``; the wrapped ``tokenizers.Tokenizer`` then holds its vocabulary and decoder.
- Chat templates render in ``chat_template``'s bounded sandbox.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any, Protocol

import tokenizers

from tokenbudget.engine.text.chat_template import check_chat_template_kwargs, render_chat_template

__all__ = ["Tokenizer"]


class TextEncoder(Protocol):
    """Text to ids for a vocabulary ``tokenizers`` cannot encode exactly (``spm.SentencePieceText``)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...


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
                 extra_eos_token_ids: Iterable[int] = (), encoder: TextEncoder | None = None) -> None:
        self._tok = backend
        self._encoder = encoder
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        self._extra_eos = [i for i in dict.fromkeys(extra_eos_token_ids) if i != self.eos_token_id]
        specials = {tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special}
        specials.update(i for i in (self.bos_token_id, self.eos_token_id) if i is not None)
        self.all_special_ids: list[int] = sorted(specials)

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``,
        ``generation_config.json``)."""
        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise FileNotFoundError(
                f"{path} has no tokenizer.json (only fast tokenizers are supported)")
        backend = tokenizers.Tokenizer.from_file(tok_file)
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        gen_eos = _read_json(os.path.join(path, "generation_config.json")).get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in gen_eos):
            raise ValueError(f"{path}/generation_config.json: eos_token_id must be a token id or a list of them")
        return cls(backend, bos_token=_token_content(cfg.get("bos_token")),
                   eos_token=_token_content(cfg.get("eos_token")), chat_template=template,
                   extra_eos_token_ids=gen_eos)

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
        """The wrapped ``tokenizers.Tokenizer`` (do not mutate): the vocabulary, added tokens and
        decoder. A vocabulary with its own ``encoder`` (SentencePiece from GGUF) is encoded by
        :meth:`encode` only; the backend's own ``encode`` is not the model's there."""
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
        if self._encoder is not None:
            return self._encoder.encode(text, add_special_tokens)
        # encode_batch releases the GIL while it works (encode does not): a long text tokenized in
        # a server's preparation thread must not stop its event loop and step thread.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete UTF-8 sequences decode to U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat ---------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, *, continue_final_message: bool = False,
                            **kwargs: Any) -> str:
        """Render ``messages`` with the model's chat template (or ``chat_template``).

        Extra keyword arguments (``tools``, ``enable_thinking``...) are template variables.
        Raises ``ValueError`` when there is no template, the template rejects the messages or goes
        past its limits (``chat_template.render_chat_template``).
        """
        source = chat_template or self.chat_template
        if source is None:
            raise ValueError("this tokenizer has no chat_template; pass chat_template= or a prompt")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        return render_chat_template(source, messages, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, **context)

    def chat_prompt(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The prompt of one conversation as the engine takes it: ``{"prompt": text,
        "prompt_token_ids": ids}``, the ids encoded without adding BOS (the template writes it).

        ``tools``: the template's ``tools`` variable, as transformers' ``apply_chat_template``
        passes JSON-schema tools (OpenAI's ``{"type": "function", "function": {...}}`` dicts).
        ``chat_template_kwargs`` (vLLM's argument) are extra template variables, and override
        ``add_generation_prompt`` / ``continue_final_message`` / ``tools`` when they set them, as in
        vLLM.
        """
        options = {"add_generation_prompt": add_generation_prompt,
                   "continue_final_message": continue_final_message,
                   **({"tools": tools} if tools is not None else {}),
                   **check_chat_template_kwargs(chat_template_kwargs)}
        text = self.apply_chat_template(messages, chat_template=chat_template, **options)
        return {"prompt": text, "prompt_token_ids": self.encode(text)}

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
                f"eos={self.eos_token!r}, chat_template={'yes' if self.chat_template else 'no'})")


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        value = json.load(f)
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return value
