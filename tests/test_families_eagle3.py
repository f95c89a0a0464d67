"""EAGLE-3 on every supported family (issue 39 item 5), on tiny random 8-layer targets:

* the training side's tap states (``TapForward``, the engine's own decoder layers over a dense
  batch) are transformers' ``output_hidden_states`` at the tapped layers' inputs, its logits
  transformers' logits (Gemma 2's soft-cap and Granite's scaling included);
* a head in the published layout, shaped from its own config (hidden sizes, tap layers), loads for
  the target and serves losslessly: greedy speculation == plain decoding;
* ``train-draft``'s pipeline runs end to end on the family's target.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tokenbudget.api.sampling_params import SamplingParams
from tokenbudget.engine.entrypoints.llm import LLM
from tokenbudget.engine.loader import load_model_files
from tokenbudget.engine.model.eagle3 import Eagle3Config, Eagle3Head, default_aux_layer_ids, save_eagle3
from tokenbudget.training.pipeline import Pipeline, PipelineConfig
from tokenbudget.training.target_forward import TapForward
from tokenbudget.training.train import TrainConfig

from model_families import FAMILIES, make_family_dir

LAYERS = 8  # vLLM's default taps (2, L // 2, L - 3) are distinct from L = 7 on


@pytest.fixture(scope="module", params=list(FAMILIES))
def target(request, tmp_path_factory):
    return request.param, make_family_dir(tmp_path_factory.mktemp(request.param), request.param,
                                          num_hidden_layers=LAYERS)


def test_tap_states_and_logits_match_transformers(target) -> None:
    name, path = target
    loaded = load_model_files(path)
    taps = default_aux_layer_ids(LAYERS)
    fw = TapForward(loaded.config, loaded.state_dict, taps)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 256, (1, 23), generator=gen), torch.randint(0, 256, (1, 9), generator=gen)
    batch = torch.zeros(2, 23, dtype=torch.int64)
    batch[0], batch[1, :9] = a[0], b[0]
    aux, final = fw(batch)
    short, _ = fw(batch, final=False)
    for row, ids in ((0, a), (1, b)):
        with torch.no_grad():
            ref = hf(ids, output_hidden_states=True, use_cache=False)
        want = torch.cat([ref.hidden_states[i][0] for i in taps], dim=-1)
        n = ids.shape[1]
        torch.testing.assert_close(aux[row, :n], want, rtol=1e-4, atol=1e-4, msg=name)
        torch.testing.assert_close(short[row, :n], want, rtol=1e-4, atol=1e-4, msg=name)
        torch.testing.assert_close(fw.logits(final[row, :n]), ref.logits[0], rtol=1e-4, atol=1e-4, msg=name)


def _random_head(path: str, hidden: int, vocab: int, head_dir) -> str:
    torch.manual_seed(0)
    c = Eagle3Config(hidden_size=hidden, target_hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, intermediate_size=96, vocab_size=vocab, draft_vocab_size=64,
                     aux_layer_ids=(1, 3, 4))  # not the default taps: read from the head's config
    head = Eagle3Head(c)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.2)
    head.set_draft_vocab(torch.arange(0, 256, 4))
    save_eagle3(head.eval(), str(head_dir))
    return str(head_dir)


def test_a_published_layout_head_serves_losslessly(target, tmp_path) -> None:
    name, path = target
    cfg = load_model_files(path).config
    head = _random_head(path, cfg.hidden_size, cfg.vocab_size, tmp_path / "head")
    prompts = [[(5 * i) % 250 for i in range(30)], [42] * 5 + list(range(100, 115)) + [42] * 5]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(**kw):
        llm = LLM(path, dtype="float32", num_threads=1, kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=16, **kw)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)], llm

    plain, _ = run()
    spec, llm = run(speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3})
    assert spec == plain, name
    assert llm.get_spec_stats().num_draft_tokens > 0


def test_train_draft_runs_on_the_family(target, tmp_path) -> None:
    name, path = target
    cfg = PipelineConfig(model=path, work_dir=str(tmp_path / "work"), train_prompts=6, heldout_prompts=2,
                         max_tokens=8, max_len=256, draft_vocab=64, intermediate_size=32, shard_size=4, eval_k=2,
                         train=TrainConfig(ttt_steps=2, epochs=1, batch_tokens=128, warmup=1))
    result = Pipeline(cfg, "tokenbudget train-draft (test)", use_tqdm=False, log=lambda *_: None).run()
    assert result["all"]["chains"] > 0, name
    assert (tmp_path / "work" / "head" / "config.json").exists()
