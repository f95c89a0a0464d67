"""The proto's ``GenerateRequest`` -> the engine's prompt and ``SamplingParams``.

Every field of ``vllm.grpc.engine.SamplingParams`` the engine supports maps to the engine's own
field of the same meaning (proto3 leaves unset scalars at 0, which for ``top_p`` and
``repetition_penalty`` means "off", as the gateway sends them); a field or request part the
engine does not support raises ``Unsupported`` naming it (the servicer answers
INVALID_ARGUMENT), and a value the engine refuses raises the engine's own ``ValueError`` naming
the field. The worker returns token ids only (the gateway detokenizes), so ``detokenize`` is on
only when stop strings need the text, and ``spaces_between_special_tokens`` shapes nothing here.
"""

from __future__ import annotations

from tokenbudget.api.sampling_params import RequestOutputKind, SamplingParams
from tokenbudget.api.structured_params import StructuredOutputsParams

# request parts that carry what this engine has no use for: multimodal inputs, PD handoffs, DP ranks
_UNSUPPORTED_PARTS = ("mm_inputs", "media_refs", "kv_transfer_params", "kv_transfer_params_json")


class Unsupported(ValueError):
    """A request field the engine does not support (INVALID_ARGUMENT naming it)."""


def prompt_of(request) -> list[int] | str:
    """The prompt: the gateway's token ids (or text, for a client that sends text)."""
    for name in _UNSUPPORTED_PARTS:
        if request.HasField(name):
            raise Unsupported(f"{name} is not supported by this engine (text models, no PD disaggregation)")
    if len(request.extra_mm_inputs):
        raise Unsupported("extra_mm_inputs is not supported by this engine (text models)")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise Unsupported(f"data_parallel_rank {request.data_parallel_rank}: this engine has one rank (0)")
    kind = request.WhichOneof("input")
    if kind == "tokenized":
        return list(request.tokenized.input_ids)
    if kind == "text":
        return request.text
    raise ValueError("input: a GenerateRequest needs tokenized input_ids or text")


def _constraint(params) -> StructuredOutputsParams | None:
    kind = params.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "structural_tag":
        raise Unsupported("structural_tag is not supported by this engine (json_schema, regex, grammar, "
                          "json_object and choice are)")
    if kind == "json_schema":
        return StructuredOutputsParams(json=params.json_schema)
    if kind == "choice":
        return StructuredOutputsParams(choice=list(params.choice.choices))
    return StructuredOutputsParams(**{kind: getattr(params, kind)})


def sampling_params_of(params, defaults: SamplingParams, stream: bool) -> SamplingParams:
    """Engine sampling parameters for the proto's; fields the proto leaves unset keep the
    engine's defaults (the model's generation config where it has one)."""
    fields = {
        "top_k": params.top_k, "min_p": params.min_p,
        "frequency_penalty": params.frequency_penalty, "presence_penalty": params.presence_penalty,
        "min_tokens": params.min_tokens, "stop": list(params.stop), "stop_token_ids": list(params.stop_token_ids),
        "skip_special_tokens": params.skip_special_tokens, "ignore_eos": params.ignore_eos,
        "n": params.n or 1, "include_stop_str_in_output": params.include_stop_str_in_output,
        "detokenize": bool(params.stop),
        "output_kind": RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
    }
    if params.top_p:
        fields["top_p"] = params.top_p
    if params.repetition_penalty:
        fields["repetition_penalty"] = params.repetition_penalty
    for name in ("temperature", "max_tokens", "logprobs", "prompt_logprobs", "seed", "truncate_prompt_tokens"):
        if params.HasField(name):
            fields[name] = getattr(params, name)
    if params.logit_bias:
        fields["logit_bias"] = dict(params.logit_bias)
    constraint = _constraint(params)
    if constraint is not None:
        fields["structured_outputs"] = constraint
    # grammar_from_first_token: this engine runs no reasoning parser, so a grammar always starts at
    # the first generated token, whichever way the gateway sets it
    base = {name: getattr(defaults, name) for name in defaults.__struct_fields__}
    return SamplingParams(**{**base, **fields})
