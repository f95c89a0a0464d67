"""Stop conditions applied as each committed token is appended."""

from __future__ import annotations

from tokenbudget.scheduler.request import Request, RequestStatus


def append_and_check_stop(request: Request, tokens: list[int], max_model_len: int) -> int:
    """Append ``tokens`` one by one, stopping at the first that ends the request.

    Returns how many tokens were appended. On a stop, ``request.status`` becomes FINISHED_*
    (and ``stop_reason`` names a matched stop token id); later tokens are discarded.
    Order of checks per token: EOS / stop token (after ``min_tokens``), then ``max_tokens``,
    then ``max_model_len``.
    """
    all_ids = request.all_token_ids
    num_prompt = len(request.prompt_token_ids)
    eos = None if request.ignore_eos else request.eos_token_id
    stop_ids = request.stop_token_ids
    # Fast path (the common decode step): no token can stop the request and the lengths stay
    # below both limits after the last token, so no per-token check could fire; append at once.
    num_after = len(all_ids) + len(tokens)
    if (num_after - num_prompt < request.max_tokens and num_after < max_model_len
            and (eos is None or eos not in tokens) and (not stop_ids or stop_ids.isdisjoint(tokens))):
        all_ids.extend(tokens)
        return len(tokens)
    for i, token in enumerate(tokens):
        all_ids.append(token)
        num_output = len(all_ids) - num_prompt
        if num_output >= request.min_tokens:
            if token == eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return i + 1
            if token in stop_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
                return i + 1
        if num_output >= request.max_tokens or len(all_ids) >= max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
            return i + 1
    return len(tokens)
