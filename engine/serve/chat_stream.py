"""The chunks of a streamed chat completion, choice by choice.

As vLLM streams them: first a ``{"role": "assistant", "content": ""}`` chunk for every choice
(``index`` 0..n-1), then, per step, the new deltas of each choice that has any, each chunk
carrying one choice and its ``index``: content, or tool calls (``tool_calls.ToolStream``). A
choice's logprobs ride on its first chunk of the step, its ``finish_reason`` on its last (a chunk
with an empty delta when the step brought neither text nor calls but has logprobs or the finish).
"""

from __future__ import annotations

from tokenbudget.api.outputs import RequestOutput
from tokenbudget.engine.serve import responses as resp
from tokenbudget.engine.serve.tool_calls import ToolRequest, ToolStream


class ChatChunks:
    def __init__(self, rid: str, created: int, model: str, n: int, n_logprobs: int, token_text: resp.TokenText,
                 tools: ToolRequest) -> None:
        self.rid, self.created, self.model, self.n = rid, created, model, n
        self.n_logprobs, self.token_text, self.tools = n_logprobs, token_text, tools
        self.streams: dict[int, ToolStream] = {}
        self.started = False

    def render(self, out: RequestOutput) -> list[dict]:
        """The chunks of one step's (DELTA) output."""
        chunks = []
        if not self.started:
            self.started = True
            chunks += [self._chunk(i, {"role": "assistant", "content": ""}) for i in range(self.n)]
        for c in out.outputs:
            stream = self.streams.setdefault(c.index, self.tools.stream())
            deltas = stream.feed(c.text)
            finish = None
            if c.finish_reason:
                more, finish = stream.finish(c.finish_reason)
                deltas += more
            lps = resp.chat_logprobs(c.token_ids, c.logprobs, self.n_logprobs, self.token_text) if c.token_ids else None
            if not deltas and lps is None and not finish:
                continue  # nothing to say yet (a call being written, text held back)
            deltas = deltas or [{}]
            for j, delta in enumerate(deltas):
                last = j == len(deltas) - 1
                chunks.append(self._chunk(c.index, delta, finish if last else None, lps if j == 0 else None))
        return chunks

    def _chunk(self, index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
        return resp.chat_chunk(self.rid, self.created, self.model, delta, finish_reason, logprobs, index)
