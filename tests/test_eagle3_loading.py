"""Loading EAGLE-3 heads: the published layout (vLLM / SGLang) and its variants (``model.``-prefixed
names with an embedding, no ``t2d``, fp16), heads that do not fit the target, and the validation
errors, each naming its field before anything runs."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenbudget.engine.model.eagle3 import load_eagle3, save_eagle3

from eagle3_fixtures import (
    AUX_IDS,
    DRAFT_VOCAB,
    PROMPTS,
    baseline_tokens,
    eagle,
    engine,
    greedy,
    make_dirs,
    random_head,
    token_ids,
    write_head,
)
from tiny_llama import VOCAB


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_dirs(tmp_path_factory.mktemp("eagle3"))


@pytest.fixture(scope="module")
def baseline(dirs):
    return baseline_tokens(dirs)


def _published(src, dst, *, prefix: str = "", drop=(), embed: bool = False) -> str:
    os.makedirs(dst, exist_ok=True)
    state = load_file(os.path.join(src, "model.safetensors"))
    state = {prefix + k: v for k, v in state.items() if k not in drop}
    if embed:
        state[prefix + "embed_tokens.weight"] = torch.zeros(VOCAB, 64)
    save_file(state, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


def test_published_layout_names_and_variants(dirs) -> None:
    head = dirs["head"]
    with open(os.path.join(head, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["vocab_size"] == VOCAB
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(AUX_IDS)
    names = set(load_file(os.path.join(head, "model.safetensors")))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"} <= names
    ref = load_eagle3(head)
    root = dirs["root"]
    variants = [_published(head, root / "prefixed", prefix="model.", embed=True),
                _published(head, root / "no_t2d", drop=("t2d",))]
    for path in variants:
        got = load_eagle3(path)
        for (name, a), (_, b) in zip(sorted(ref.state_dict().items()), sorted(got.state_dict().items())):
            assert torch.equal(a, b), name
    want = token_ids(engine(dirs["target"], eagle(head)), PROMPTS[:2], greedy(12))
    for path in variants:  # the same drafts: the same acceptance
        llm = engine(dirs["target"], eagle(path))
        assert token_ids(llm, PROMPTS[:2], greedy(12)) == want


def test_fp16_head_runs(dirs, baseline) -> None:
    path = dirs["root"] / "fp16"
    save_eagle3(random_head(1), str(path))  # the default: float16 on disk
    assert token_ids(engine(dirs["target"], eagle(path, k=2)), PROMPTS, greedy()) == baseline


@pytest.mark.parametrize("override, field", [({"vocab_size": VOCAB + 10}, "vocab_size"),
                                             ({"target_hidden_size": 32}, "target_hidden_size"),
                                             ({"aux_layer_ids": (1, 3, 9)}, "taps layers")])
def test_mismatched_head_is_refused(dirs, override, field) -> None:
    path = write_head(dirs["root"] / f"bad_{field}", random_head(2, **override))
    with pytest.raises(ValueError, match=rf"speculative_config\.model: .*{field}"):
        engine(dirs["target"], eagle(path))


@pytest.mark.parametrize("spec, match", [
    ({"method": "eagle3", "model": "/nonexistent/head"}, r"speculative_config\.model: .*not a directory"),
    ({"method": "eagle3"}, r"speculative_config\.model: no EAGLE-3 head is shipped"),
    ({"method": "eagle3", "num_speculative_tokens": 0}, r"num_speculative_tokens"),
    ({"method": "eagle3", "draft_num_layers": 2}, r"draft_num_layers"),
    ({"method": "ngram", "model": "/x"}, r"speculative_config\['model'\]"),
    ({"method": "suffix", "enable_suffix_decoding": True}, r"speculative_config\['enable_suffix_decoding'\]"),
])
def test_validation_errors_name_the_field(dirs, spec, match) -> None:
    with pytest.raises(ValueError, match=match):
        engine(dirs["target"], spec)


def test_not_a_head_directory(dirs) -> None:
    with pytest.raises(ValueError, match=r"speculative_config\.model: .*no config.json"):
        engine(dirs["target"], eagle(dirs["root"]))


def test_out_rows_computes_those_rows_and_every_rows_kv() -> None:
    """The engine's catch-up asks for the last row of each request only (``out_rows``): its output
    is the full forward's, and every row's K/V still reaches the cache."""
    from tokenbudget.engine.drafters.eagle3_kv import HeadState, segment_attend

    head = random_head(3)
    c = head.config
    gen = torch.Generator().manual_seed(1)
    lens = (5, 1, 9)
    n = sum(lens)
    embeds, hidden = torch.randn(n, c.hidden_size, generator=gen), torch.randn(n, c.hidden_size, generator=gen)
    positions = torch.cat([torch.arange(m) + 3 for m in lens])
    kv_shape = (3, c.num_key_value_heads, c.head_dim)  # 3 rows already cached per request
    cached = [(torch.randn(kv_shape, generator=gen), torch.randn(kv_shape, generator=gen)) for _ in lens]

    def run(last_only: bool):
        states = [HeadState(torch.stack([k, v]), n=3) for k, v in cached]
        for st, m in zip(states, lens):
            st.reserve(m)
        attend = segment_attend([(st, 3, m) for st, m in zip(states, lens)], last_only=last_only)
        last = torch.tensor(lens).cumsum(0) - 1
        with torch.no_grad():
            h, logits = head(embeds, hidden, positions, attend, out_rows=last if last_only else None)
        return (h, logits) if last_only else (h[last], logits[last]), states

    (h_all, lg_all), st_all = run(False)
    (h_last, lg_last), st_last = run(True)
    torch.testing.assert_close(h_last, h_all)
    torch.testing.assert_close(lg_last, lg_all)
    for a, b, m in zip(st_all, st_last, lens):
        assert torch.equal(a.k[:3 + m], b.k[:3 + m]) and torch.equal(a.v[:3 + m], b.v[:3 + m])
