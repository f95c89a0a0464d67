"""The whole step loop over the CUDA-graph path, on CPU: EngineCore -> ModelRunner ->
CUDAGraphRunner (replay driver) -> FlashInfer backend (stand-in) -> the real DecoderLM.

Greedy speculation whose draft counts vary from request to request and step to step (0..k, as
n-gram and suffix drafts do) must produce exactly the tokens of plain decoding, with the
verify steps replayed in the k bucket (padded draft counts), not run eagerly.
"""

from __future__ import annotations

import random

from tokenbudget.engine.worker.cuda_graphs import CUDAGraphRunner
from tokenbudget.kernels.attention.flashinfer_backend import FlashInferBackend
from tokenbudget.spec.proposer import Proposal

import flashinfer_standin as fis
from benches.gpu_spec import run_generation
from benches.synthetic_model import OracleProposer, build_synthetic_engine
from replay_driver import ReplayDriver

K = 3


class RaggedOracle(OracleProposer):
    """The recorded greedy continuation, cut to a random 0..k drafts per request and step."""

    def propose(self, requests, num_tokens):
        drafts = super().propose(requests, num_tokens).token_ids
        return Proposal([d[:self.rng.randint(0, len(d))] for d in drafts])


class CountingRunner(CUDAGraphRunner):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.replays, self.eager = {}, 0

    def __call__(self, input_ids, positions, md, kv_caches):
        cap = self._bucket_for(md.qo_indptr)
        if cap is None:
            self.eager += 1
        else:
            key = next(k for k, v in self.graphs.items() if v is cap)
            self.replays[key] = self.replays.get(key, 0) + 1
        return super().__call__(input_ids, positions, md, kv_caches)


def test_ragged_speculation_through_graphs_equals_plain_decoding():
    eng = build_synthetic_engine("tiny", "cpu", "float32", kv_bytes=1 << 22, max_num_seqs=4)
    runner = eng.runner
    runner.attn_backend = FlashInferBackend(runner.attn_backend.spec, "cpu", flashinfer=fis, num_sms=132)
    graphs = CountingRunner(eng.model, runner.kv_caches, runner.attn_backend, batch_sizes=(1, 2, 4),
                            draft_lens=(0, K), max_pages_per_req=8, driver=ReplayDriver())
    graphs.capture()
    runner.model = graphs
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (9, 14, 5)]
    eng.set_speculator(None)
    ref, *_ = run_generation(eng, prompts, 16)
    plain_replays = dict(graphs.replays)
    graphs.replays = {}
    eng.set_speculator(RaggedOracle(0.8, 512, {f"r{i}": t for i, t in enumerate(ref)}, seed=3), K)
    out, *_ = run_generation(eng, prompts, 16)
    assert out == ref
    assert plain_replays.get((4, 1), 0) > 5                # plain decodes ran in the decode graph
    assert graphs.replays.get((4, 1 + K), 0) > 3           # ragged verifies ran in the k graph
    st = eng.speculator.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
