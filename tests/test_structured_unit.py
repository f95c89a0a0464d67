"""Structured output without a model: parameters, bitmasks, and the grammar manager's row
preparation, draft handling and transaction on a byte-level vocabulary (259 ids)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from tokenbudget import SamplingParams, StructuredOutputsParams
from tokenbudget.engine.structured.bitmask import apply_bitmask, unpack_bitmask
from tokenbudget.engine.structured.manager import StructuredOutputs
from tokenbudget.engine.text.tokenizer import Tokenizer
from tokenbudget.engine.worker.sampler import Sampler, SamplingRow
from tokenbudget.scheduler.output import EngineCoreOutput, ScheduledRequest, SchedulerOutput
from tokenbudget.scheduler.request import Request, RequestStatus
from tokenbudget.scheduler.request_fault import RequestFault

from model_helpers import write_tokenizer_files

VOCAB = 259
GREEDY = 0.0


# ----------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("kwargs, field", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 3]}, "structured_outputs.choice"),
    ({"choice": ["a", ""]}, "structured_outputs.choice"),
    ({"regex": "(("}, "structured_outputs.regex"),
    ({"regex": 5}, "structured_outputs.regex"),
    ({"json": {"type": "foo"}}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": [1, 2]}, "structured_outputs.json"),
    ({"json": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}},
     "structured_outputs.json"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
    ({"grammar": "root ::= ("}, "structured_outputs.grammar"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
])
def test_bad_structured_outputs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match="structured_outputs") as err:
        StructuredOutputsParams(**kwargs)
    assert field in str(err.value)


def test_sampling_params_field():
    so = StructuredOutputsParams(choice=["yes", "no"])
    assert SamplingParams(structured_outputs=so).structured_outputs is so
    assert SamplingParams(structured_outputs={"regex": "[0-9]+"}).structured_outputs.regex == "[0-9]+"
    assert SamplingParams().structured_outputs is None
    with pytest.raises(ValueError, match="^structured_outputs"):
        SamplingParams(structured_outputs="json")
    with pytest.raises(ValueError, match="^structured_outputs"):
        SamplingParams(structured_outputs={"regex": "(("})
    with pytest.raises(ValueError, match="^structured_outputs"):
        SamplingParams(structured_outputs={"nonsense": 1})


def test_sampling_params_round_trip_with_structured_outputs():
    p = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    assert msgspec.json.decode(msgspec.json.encode(p), type=SamplingParams) == p
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p
    with pytest.raises(msgspec.ValidationError, match="structured_outputs.regex"):
        msgspec.json.decode(b'{"structured_outputs": {"regex": "(("}}', type=SamplingParams)


# ----------------------------------------------------------------------------- bitmask
def test_apply_bitmask_matches_a_plain_loop():
    rng = np.random.default_rng(0)
    vocab = 70  # not a multiple of 32: the last word is partial
    words = rng.integers(-2**31, 2**31, size=(3, 3), dtype=np.int64).astype(np.int32)
    allowed = unpack_bitmask(words, vocab)
    for r in range(3):
        for t in range(vocab):
            assert bool(allowed[r, t]) == bool((int(words[r, t // 32]) >> (t % 32)) & 1)
    logits = torch.randn(5, vocab)
    want = logits.clone()
    apply_bitmask(logits, 1, words)
    for i, r in enumerate([1, 2, 3]):
        want[r][~allowed[i]] = float("-inf")
    assert torch.equal(logits, want)


# ----------------------------------------------------------------------------- the manager
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(str(path))
    return Tokenizer.from_pretrained_dir(str(path))


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


def _request(rid: str, so: StructuredOutputsParams, temperature: float = GREEDY, seed=None) -> Request:
    params = SamplingParams(temperature=temperature, seed=seed, structured_outputs=so)
    return Request(rid, [5, 6, 7], sampling_params=params, eos_token_id=257)


def _manager(tokenizer, *requests: Request) -> StructuredOutputs:
    so = StructuredOutputs(tokenizer, VOCAB)
    for r in requests:
        so.add(r.request_id, so.compile(r))
    return so


def _scheduled(request: Request, drafts: list[int]) -> ScheduledRequest:
    return ScheduledRequest(request.request_id, 2, [7] + drafts, drafts, [0], False, True,
                            request.sampling_params, 0, 0)


def _apply_masks(so: StructuredOutputs, logits: torch.Tensor, sr: ScheduledRequest) -> None:
    """What the core and the runner do: masks after ``schedule()``, applied to the raw logits."""
    masks = so.grammar_bitmask(SchedulerOutput([sr]))
    apply_bitmask(logits, 0, masks[sr.request_id])


def _allowed(so: StructuredOutputs, rid: str) -> set[int]:
    mask = np.zeros(so._backend.bitmask_width, dtype=np.int32)
    so.matchers[rid].fill_bitmask(mask)
    return set(np.flatnonzero(unpack_bitmask(mask[None], VOCAB)[0].numpy()).tolist())


def test_forbidden_draft_is_rejected_by_the_verify(tokenizer):
    """Row j is masked with the state after drafts[:j]: 'a' is legal, then only 'b' is; the
    forced draft 'x' (the raw argmax everywhere) is rejected and 'b' is emitted."""
    (a, b, c, x) = (_ids(tokenizer, ch)[0] for ch in "abcx")
    req = _request("r", StructuredOutputsParams(choice=["ab", "cd"]))
    so = _manager(tokenizer, req)
    before = _allowed(so, "r")
    assert before == {a, c}
    logits = torch.zeros(3, VOCAB)
    logits[:, x] = 10.0
    logits[0, a], logits[0, c] = 5.0, 4.0
    logits[1, b] = 1.0
    raw = logits.clone()
    sr = _scheduled(req, [a, x])
    _apply_masks(so, logits, sr)
    assert torch.isinf(logits[0, x]) and torch.isinf(logits[1, x]) and torch.isinf(logits[1, a])
    assert torch.equal(logits[2], raw[2])  # after the illegal draft: never read, left alone
    assert _allowed(so, "r") == before  # rolled back to the committed state
    rows = [SamplingRow(req.sampling_params, 0, 3, [a, x])]
    assert Sampler()(logits, rows).token_ids == [[a, b]]
    assert Sampler()(raw, rows).token_ids == [[x]]  # without the mask the draft would decide


def test_forbidden_draft_rejected_under_rejection_sampling(tokenizer):
    """Random request with drafter probabilities (classic rejection sampling): a draft with
    q = 1 on a forbidden token is never accepted and the recovered token is always legal."""
    (a, c, x) = (_ids(tokenizer, ch)[0] for ch in "acx")
    req = _request("r", StructuredOutputsParams(choice=["ab", "cd"]), temperature=1.0)
    so = _manager(tokenizer, req)
    q = torch.zeros(1, VOCAB)
    q[0, x] = 1.0
    for seed in range(30):
        logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(seed))
        _apply_masks(so, logits, _scheduled(req, [x]))
        (out,) = Sampler()(logits, [SamplingRow(req.sampling_params, seed, 3, [x], q)]).token_ids
        assert len(out) == 1 and out[0] in (a, c)


def test_drafts_after_completion_are_not_consumed(tokenizer):
    """Drafts "a", "b" complete the grammar; EOS and anything after it are never consumed (an
    llguidance matcher that consumes past its end breaks for good) and their rows stay as they are."""
    a, b, x = (_ids(tokenizer, ch)[0] for ch in "abx")
    eos = 257
    req = _request("r", StructuredOutputsParams(choice=["ab"]))
    so = _manager(tokenizer, req)
    start = _allowed(so, "r")
    logits = torch.zeros(5, VOCAB)
    _apply_masks(so, logits, _scheduled(req, [a, b, eos, x]))
    assert torch.isinf(logits[2]).sum() == VOCAB - 1 and logits[2, eos] == 0  # after "ab": EOS only
    assert not torch.isinf(logits[3:]).any()
    assert _allowed(so, "r") == start
    entry = EngineCoreOutput("r", [a, b, eos], num_draft_tokens=3, num_accepted_tokens=2)
    so.prepare([entry])
    assert entry.new_token_ids == [a, b] and entry.finish_status == RequestStatus.FINISHED_STOPPED


def test_drafts_are_trimmed_at_the_first_illegal_token(tokenizer):
    from tokenbudget.scheduler.drafts import DraftBatch
    a, b, x = (_ids(tokenizer, ch)[0] for ch in "abx")
    req = _request("r", StructuredOutputsParams(choice=["ab", "cd"]))
    so = _manager(tokenizer, req)
    batch = DraftBatch(["r", "other"], [[a, b, x, a], [x, x]], [torch.ones(4, VOCAB), None])
    out = so.trim_drafts(batch)
    assert out.token_ids == [[a, b], [x, x]] and out.probs[0].shape == (2, VOCAB)
    assert batch.token_ids == [[a, b, x, a], [x, x]]  # the proposer's batch is not touched


def test_prepare_rollback_commit_and_completion(tokenizer):
    a, b, c = (_ids(tokenizer, ch)[0] for ch in "abc")
    eos = 257
    req = _request("r", StructuredOutputsParams(choice=["ab", "abc"]))
    so = _manager(tokenizer, req)
    start = _allowed(so, "r")
    so.prepare([EngineCoreOutput("r", [a])])
    assert _allowed(so, "r") != start
    so.rollback()  # a failed step leaves no trace
    assert _allowed(so, "r") == start
    entry = EngineCoreOutput("r", [a, b])
    so.prepare([entry])
    so.commit([entry])
    assert entry.finish_status is None  # "ab" may still become "abc": not complete yet
    assert _allowed(so, "r") == {c, eos}
    entry = EngineCoreOutput("r", [c, eos], num_draft_tokens=1, num_accepted_tokens=1)
    so.prepare([entry])
    assert entry.new_token_ids == [c] and entry.finish_status == RequestStatus.FINISHED_STOPPED
    so.commit([entry])
    for table in so.tables:  # the engine's release path
        table.drop(req.request_id)
    assert not so.matchers


def test_illegal_committed_token_fails_the_step_without_changing_state(tokenizer):
    a, x = (_ids(tokenizer, ch)[0] for ch in "ax")
    req = _request("r", StructuredOutputsParams(choice=["ab"]))
    so = _manager(tokenizer, req)
    start = _allowed(so, "r")
    with pytest.raises(RequestFault, match="breaks the grammar") as fault:  # the request's fault, not the engine's
        so.prepare([EngineCoreOutput("r", [a, x])])
    assert list(fault.value.reasons) == ["r"]
    so.rollback()
    assert _allowed(so, "r") == start


def test_structured_request_needs_a_tokenizer():
    req = _request("r", StructuredOutputsParams(choice=["a"]))
    with pytest.raises(ValueError, match="structured_outputs needs an engine with a tokenizer"):
        StructuredOutputs(None).compile(req)
