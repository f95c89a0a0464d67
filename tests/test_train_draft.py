"""The EAGLE-3 training pipeline (tokenbudget.training, ``tokenbudget train-draft``) on tiny models.

- tap states: the plain forward's states are Hugging Face's ``output_hidden_states[i]`` (Contract 2
  of issue 27: the input of layer i), on right-padded batches;
- the training-time test's unrolled attention is exactly drafting with a KV cache (what the engine
  does), position by position;
- the draft vocabulary survives save/load (d2t/t2d) and maps both ways;
- the whole pipeline runs end to end on a tiny random Llama (held-out acceptance on the training
  side's states and on the engine's own), and a rerun skips finished stages.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from tokenbudget.engine.loader import load_model_files
from tokenbudget.engine.model.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    causal_attention,
    default_aux_layer_ids,
    load_eagle3,
    save_eagle3,
)
from tokenbudget.training import data as data_mod
from tokenbudget.training.pipeline import Pipeline, PipelineConfig
from tokenbudget.training.target_forward import TapForward
from tokenbudget.training.train import TrainConfig
from tokenbudget.training.ttt import chain_labels, unroll
from tokenbudget.training.vocab import coverage, frequent_ids, target_to_draft

from tiny_llama import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", layers=8, scale=8.0)


def test_tap_states_are_hf_hidden_states_at_layer_inputs(tiny_dir):
    import transformers

    loaded = load_model_files(tiny_dir)
    taps = default_aux_layer_ids(loaded.config.num_hidden_layers)
    fw = TapForward(loaded.config, loaded.state_dict, taps)
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_dir).eval()
    torch.manual_seed(0)
    a, b = torch.randint(0, 259, (1, 23)), torch.randint(0, 259, (1, 9))
    batch = torch.zeros(2, 23, dtype=torch.int64)
    batch[0], batch[1, :9] = a[0], b[0]
    aux, final = fw(batch)
    short, _ = fw(batch, final=False)
    for row, ids in ((0, a), (1, b)):
        with torch.no_grad():
            ref = hf(ids, output_hidden_states=True)
        want = torch.cat([ref.hidden_states[i][0] for i in taps], dim=-1)
        n = ids.shape[1]
        torch.testing.assert_close(aux[row, :n], want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(short[row, :n], want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fw.logits(final[row, :n]), ref.logits[0], rtol=1e-4, atol=1e-4)


def _small_head(seed=0) -> Eagle3Head:
    torch.manual_seed(seed)
    c = Eagle3Config(hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, intermediate_size=48, vocab_size=50, draft_vocab_size=20, aux_layer_ids=(1, 2, 3))
    head = Eagle3Head(c)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    head.set_draft_vocab(torch.arange(0, 40, 2))
    return head.eval()


def _draft_with_cache(head, embed, aux, tokens, base, steps):
    """What the engine does after verifying position ``base``: the head's cache holds the entries
    of positions 0..base (from the target's states), then it drafts ``steps`` tokens, one query at
    a time over that cache plus its own chain entries. Returns each step's draft logits."""
    keys, values = [], []

    def record_causal(q, k, v):
        keys.append(k)
        values.append(v)
        return causal_attention(q, k, v)

    def over_cache(q, k, v):
        keys.append(k)
        values.append(v)
        kk, vv = torch.cat(keys), torch.cat(values)
        rep = q.shape[1] // kk.shape[1]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), kk.repeat_interleave(rep, 1).transpose(0, 1),
                                             vv.repeat_interleave(rep, 1).transpose(0, 1))
        return out.transpose(0, 1).reshape(q.shape[0], -1)

    n = base + 1
    hidden, logits = head(F.embedding(tokens[1:n + 1], embed), head.fuse(aux[:n]), torch.arange(n), record_causal)
    out, hidden = [logits[-1]], hidden[-1:]
    for j in range(1, steps):
        hidden, logits = head(F.embedding(tokens[base + j + 1:base + j + 2], embed), hidden,
                              torch.tensor([base + j]), over_cache)
        out.append(logits[0])
    return out


def test_bfloat16_tap_states_stay_close_to_float32(tiny_dir):
    """bfloat16 autocast (``--precision``) only rounds the matmuls: the residual stream stays float32."""
    loaded = load_model_files(tiny_dir)
    taps = default_aux_layer_ids(loaded.config.num_hidden_layers)
    ids = torch.randint(0, 259, (2, 31), generator=torch.Generator().manual_seed(0))
    ref, _ = TapForward(loaded.config, loaded.state_dict, taps)(ids)
    got, final = TapForward(loaded.config, loaded.state_dict, taps, "bfloat16")(ids)
    assert got.dtype == final.dtype == torch.float32
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert 0 < rel.mean() < 0.03 and rel.max() < 0.1  # SmolLM2-135M: mean 0.008


def test_unrolled_training_attention_is_drafting_with_a_kv_cache():
    head = _small_head()
    torch.manual_seed(1)
    embed = torch.randn(50, 32)
    lengths = [14, 10]
    aux = torch.randn(2, 14, 96)
    tokens = torch.randint(0, 50, (2, 14))
    tokens[1, 10:] = 0
    steps = 3
    rows = torch.tensor([2, 5, 9, 11, 14 + 3, 14 + 6])
    got = unroll(head, embed, aux, tokens, rows, steps)
    labels = chain_labels(tokens, torch.tensor(lengths), rows, steps)
    with torch.no_grad():
        for r, flat in enumerate(rows.tolist()):
            b, i = divmod(flat, 14)
            want = _draft_with_cache(head, embed, aux[b, :lengths[b]], tokens[b, :lengths[b]], i,
                                     min(steps, lengths[b] - i - 2))
            for j, w in enumerate(want):
                torch.testing.assert_close(got[j][r], w, rtol=1e-4, atol=1e-4)
                assert labels[j, r] == tokens[b, i + j + 2]
            for j in range(len(want), steps):
                assert labels[j, r] == -1  # past the conversation's end: no label


def test_draft_vocab_round_trips_through_the_published_layout(tmp_path):
    responses = [[5, 5, 5, 7, 7, 9, 11], [7, 5, 3, 3, 3, 3]]
    ids = frequent_ids(responses, 50, 4)
    assert ids.tolist() == [3, 5, 7, 9]  # counts 4, 4, 3, then 9 before 11 (tie: lower id)
    assert coverage(responses, ids, 50) == pytest.approx(12 / 13)
    head = _small_head()
    c = head.config
    ids20 = frequent_ids([list(range(49, 9, -2)) * 2, [0]], 50, c.draft_vocab_size)
    head.set_draft_vocab(ids20)
    save_eagle3(head, str(tmp_path / "h"))
    back = load_eagle3(str(tmp_path / "h"))
    draft = torch.arange(c.draft_vocab_size)
    assert back.to_target_ids(draft).tolist() == ids20.tolist()
    assert back.t2d.nonzero().flatten().tolist() == ids20.tolist()
    t2d = target_to_draft(ids20, 50)
    assert t2d[back.to_target_ids(draft)].tolist() == draft.tolist()
    assert int((t2d >= 0).sum()) == c.draft_vocab_size


def _tiny_config(tiny_dir, work, **over) -> PipelineConfig:
    kw = dict(model=tiny_dir, work_dir=str(work), train_prompts=10, heldout_prompts=4, max_tokens=12, max_len=512,
              draft_vocab=64, intermediate_size=32, shard_size=4, eval_k=3,
              train=TrainConfig(ttt_steps=3, epochs=2, batch_tokens=128, warmup=2))
    kw.update(over)
    return PipelineConfig(**kw)


def test_pipeline_end_to_end_then_resumes_without_redoing_stages(tiny_dir, tmp_path, monkeypatch):
    torch.set_num_threads(2)
    cfg = _tiny_config(tiny_dir, tmp_path / "work")
    result = Pipeline(cfg, "tokenbudget train-draft (test)", use_tqdm=False, log=lambda *_: None).run()
    head_dir = tmp_path / "work" / "head"
    head = load_eagle3(str(head_dir))
    assert head.config.draft_vocab_size == 64 and head.config.aux_layer_ids == (2, 4, 5)
    assert (head_dir / "RECIPE.md").read_text().count("| all |") == 1
    s = result["all"]
    assert s["chains"] > 0 and 1.0 <= s["tau"] <= 1.0 + 3
    assert len(s["accept_at_position"]) == 3
    served = json.loads((tmp_path / "work" / "eval_engine.json").read_text())  # the engine's own tap states
    assert served["all"]["chains"] == s["chains"] and served["all"]["tau"] == pytest.approx(s["tau"], abs=0.05)
    prompts = json.loads((tmp_path / "work" / "prompts.json").read_text())
    assert len(prompts["train"]) == 10 and len(prompts["heldout"]) == 4
    assert not {p for _, p in prompts["train"]} & {p for _, p in prompts["heldout"]}
    shards = sorted(os.listdir(tmp_path / "work" / "features"))
    assert shards == ["heldout_0000.pt", "train_0000.pt", "train_0001.pt", "train_0002.pt"]

    # rerun: generation and features are not redone; training resumes from its checkpoint
    os.remove(tmp_path / "work" / "trained.pt")
    os.remove(tmp_path / "work" / "features" / "train_0001.pt")

    def no_generation(*a, **k):
        raise AssertionError("a finished stage ran again")
    monkeypatch.setattr(data_mod, "make_prompts", no_generation)
    monkeypatch.setattr("tokenbudget.training.pipeline.make_prompts", no_generation)
    monkeypatch.setattr("tokenbudget.training.pipeline.make_responses", no_generation)
    monkeypatch.setattr("tokenbudget.training.pipeline.Pipeline.llm", no_generation)
    import tokenbudget.training.train as train_mod
    steps = []
    real = train_mod.chain_loss
    monkeypatch.setattr(train_mod, "chain_loss", lambda *a, **k: steps.append(1) or real(*a, **k))
    again = Pipeline(cfg, use_tqdm=False, log=lambda *_: None).run()
    assert steps == []  # the checkpoint already holds every batch
    assert os.path.exists(tmp_path / "work" / "features" / "train_0001.pt")  # the missing shard only
    assert again == result


def test_cli_rejects_bad_sizes_naming_the_field(capsys):
    from tokenbudget.cli.main import main

    assert main(["train-draft", "--draft-vocab", "0"]) == 2
    assert "draft_vocab" in capsys.readouterr().err
    assert main(["train-draft", "--precision", "fp8"]) == 2
    assert "precision" in capsys.readouterr().err


def test_acceptance_summary_counts_leading_matches():
    from tokenbudget.training.evaluate import _summary

    # accepted lengths of 5 chains at k = 3: reach 1: 4 chains, reach 2: 2, reach 3: 1
    s = _summary(torch.tensor([0, 1, 2, 3, 1]), 3)
    assert s["tau"] == pytest.approx(1 + 7 / 5)
    assert s["accept_at_position"] == [0.8, 0.5, 0.5]
    assert s["reach_position"] == [0.8, 0.4, 0.2]


def test_work_dir_refuses_other_data_settings(tiny_dir, tmp_path):
    Pipeline(_tiny_config(tiny_dir, tmp_path / "w"), use_tqdm=False, log=lambda *_: None)
    Pipeline(_tiny_config(tiny_dir, tmp_path / "w", eval_k=2), use_tqdm=False, log=lambda *_: None)  # eval only
    with pytest.raises(ValueError, match="train_prompts"):
        Pipeline(_tiny_config(tiny_dir, tmp_path / "w", train_prompts=11), use_tqdm=False, log=lambda *_: None)
