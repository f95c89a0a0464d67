"""``tokenbudget train-draft``: the whole EAGLE-3 recipe as resumable stages in one work dir.

Each stage writes its output atomically under ``work_dir`` and a rerun skips every stage whose
output is there (training resumes from its checkpoint), so an interrupted run continues where it
stopped and a finished one only re-exports and re-evaluates. ``times.json`` keeps how long each
stage took when it last ran. Stages and files:

1. prompts      ``prompts.json``            (``data.make_prompts``: self-written + templates)
2. responses    ``responses.json``          (the target's greedy chat responses)
3. features     ``features/{split}_NNNN.pt`` (tap states, ``features.extract``), ``embed.pt``
4. vocab        ``vocab.json``              (draft ids: most frequent response ids; coverage)
5. train        ``checkpoint.pt`` -> ``trained.pt``
6. export       ``out`` (``save_eagle3``, float16) + ``RECIPE.md``
7. evaluate     ``eval.json`` (held-out acceptance of the exported head, as loaded back), and
                ``eval_engine.json``: the same on the engine's own tap states (``engine_states``)
"""

from __future__ import annotations

import gc
import json
import os
import time

import msgspec
import torch

from tokenbudget.engine.loader import load_model_files
from tokenbudget.engine.model.eagle3 import default_aux_layer_ids, load_eagle3, save_eagle3
from tokenbudget.training.data import Conversation, PromptSet, make_prompts, make_responses
from tokenbudget.training.engine_states import engine_states
from tokenbudget.training.evaluate import acceptance
from tokenbudget.training.features import FeatureSet, extract
from tokenbudget.training.precision import resolve
from tokenbudget.training.target_forward import TapForward
from tokenbudget.training.train import TrainConfig, new_head, train
from tokenbudget.training.vocab import coverage, frequent_ids


class PipelineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None = None
    work_dir: str = "train-draft-work"
    out: str | None = None            # export directory; None = work_dir/head
    train_prompts: int = 6000
    heldout_prompts: int = 100
    self_written: float = 0.5
    max_tokens: int = 192
    max_len: int = 512
    draft_vocab: int = 4096
    intermediate_size: int = 768
    shard_size: int = 64
    eval_k: int = 4
    seed: int = 0
    precision: str = "auto"           # training.precision: of the tap-state forward and of training
    train: TrainConfig = TrainConfig()

    def __post_init__(self) -> None:
        for name in ("train_prompts", "heldout_prompts", "max_tokens", "max_len", "draft_vocab",
                     "intermediate_size", "shard_size", "eval_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        resolve(self.precision)
        if not 0.0 <= self.self_written <= 1.0:
            raise ValueError(f"self_written must be in [0, 1], got {self.self_written}")
        t = self.train
        if t.ttt_steps < 1 or t.epochs <= 0 or t.lr <= 0 or t.batch_tokens < 1:
            raise ValueError(f"train: ttt_steps, epochs, lr and batch_tokens must be positive, got {t}")


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(obj), indent=1))
    os.replace(tmp, path)


class Pipeline:
    def __init__(self, cfg: PipelineConfig, command: str = "", use_tqdm: bool = True, log=print):
        self.cfg, self.command, self.use_tqdm, self.log = cfg, command, use_tqdm, log
        self.dir = cfg.work_dir
        self.out = cfg.out or os.path.join(self.dir, "head")
        self.precision = resolve(cfg.precision)
        os.makedirs(os.path.join(self.dir, "features"), exist_ok=True)
        self._llm = self._loaded = None
        self.times = self._read("times.json", dict) or {}
        self._check_work_dir()

    # -- plumbing ---------------------------------------------------------------------------
    _DATA_FIELDS = ("model", "train_prompts", "heldout_prompts", "self_written", "max_tokens", "max_len",
                    "draft_vocab", "shard_size", "seed", "precision")

    def _check_work_dir(self) -> None:
        """A work dir holds one run: its cached stages are reused only for the same settings
        (data settings always; model and training settings once training has started)."""
        cfg = msgspec.to_builtins(self.cfg)
        old = self._read("config.json", dict)
        if old is not None:
            fields = list(self._DATA_FIELDS)
            if os.path.exists(self.path("checkpoint.pt")):
                fields += ["intermediate_size", "train"]
            bad = [f for f in fields if f in old and old[f] != cfg[f]]
            if bad:
                raise ValueError(f"{bad[0]}: {self.dir!r} holds a run made with {bad[0]}={old[bad[0]]!r}, not "
                                 f"{cfg[bad[0]]!r}; use another work dir (or the same settings to resume)")
        _write_json(self.path("config.json"), cfg)

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def _read(self, name: str, typ):
        p = self.path(name)
        if not os.path.exists(p):
            return None
        with open(p, "rb") as f:
            return msgspec.json.decode(f.read(), type=typ)

    def _timed(self, stage: str, fn):
        self.log(f"train-draft: {stage} ...")
        t = time.monotonic()
        out = fn()
        self.times[stage] = round(time.monotonic() - t + (self.times.get(stage, 0) if stage == "train" else 0), 1)
        _write_json(self.path("times.json"), self.times)
        return out

    def llm(self):
        if self._llm is None:
            from tokenbudget.engine.entrypoints.llm import LLM
            self._llm = LLM(self.cfg.model, num_threads=torch.get_num_threads())
        return self._llm

    def loaded(self):
        if self._loaded is None:
            self._loaded = load_model_files(self.cfg.model)
        return self._loaded

    # -- stages -----------------------------------------------------------------------------
    def prompts(self) -> PromptSet:
        got = self._read("prompts.json", PromptSet)
        if got is None:
            c = self.cfg
            got = self._timed("prompts", lambda: make_prompts(self.llm(), c.train_prompts, c.heldout_prompts,
                                                              c.seed, c.self_written, self.use_tqdm))
            _write_json(self.path("prompts.json"), got)
        return got

    def responses(self) -> dict[str, list[Conversation]]:
        got = self._read("responses.json", dict[str, list[Conversation]])
        if got is None:
            ps = self.prompts()
            got = self._timed("responses", lambda: {
                "train": make_responses(self.llm(), ps.train, self.cfg.max_tokens, self.use_tqdm),
                "heldout": make_responses(self.llm(), ps.heldout, self.cfg.max_tokens, self.use_tqdm)})
            _write_json(self.path("responses.json"), got)
        return got

    def features(self, split: str) -> FeatureSet:
        convs = self.responses()[split]
        n = self.cfg.shard_size
        names = [self.path(f"features/{split}_{i // n:04d}.pt") for i in range(0, len(convs), n)]
        todo = [i for i, p in enumerate(names) if not os.path.exists(p)]
        if todo:
            from tqdm import tqdm

            def run():
                loaded = self.loaded()
                taps = default_aux_layer_ids(loaded.config.num_hidden_layers)
                fw = TapForward(loaded.config, loaded.state_dict, taps, self.precision)
                for i in tqdm(todo, desc=f"Features ({split})", unit="shard", disable=not self.use_tqdm):
                    extract(fw, convs[i * n:(i + 1) * n], self.cfg.max_len).save(names[i])
            self._timed(f"features_{split}", run)
        return FeatureSet.concat([FeatureSet.load(p) for p in names])

    def embed(self) -> torch.Tensor:
        p = self.path("embed.pt")
        if not os.path.exists(p):
            torch.save(self.loaded().state_dict["model.embed_tokens.weight"].float().clone(), p + ".tmp")
            os.replace(p + ".tmp", p)
        return torch.load(p, weights_only=True)

    def vocab(self) -> dict:
        got = self._read("vocab.json", dict)
        if got is None:
            def run():
                res = self.responses()
                v = self.loaded().config.vocab_size
                ids = frequent_ids((c.response_ids for c in res["train"]), v, self.cfg.draft_vocab)
                return {"draft_ids": ids.tolist(), "vocab_size": v,
                        "coverage_train": round(coverage((c.response_ids for c in res["train"]), ids, v), 4),
                        "coverage_heldout": round(coverage((c.response_ids for c in res["heldout"]), ids, v), 4)}
            got = self._timed("vocab", run)
            _write_json(self.path("vocab.json"), got)
        return got

    def trained(self):
        p = self.path("trained.pt")
        loaded = self.loaded()
        taps = default_aux_layer_ids(loaded.config.num_hidden_layers)
        head = new_head(loaded.config, taps, torch.tensor(self.vocab()["draft_ids"]), self.cfg.intermediate_size,
                        loaded.state_dict, self.cfg.seed)
        if os.path.exists(p):
            head.load_state_dict(torch.load(p, weights_only=True))
            return head.eval()
        fs, embed = self.features("train"), self.embed()
        partial = self.path("head_partial")
        summary = self._timed("train", lambda: train(head, embed, fs, self.cfg.train, self.path("checkpoint.pt"),
                                                     lambda h: save_eagle3(h, partial), self.use_tqdm,
                                                     self.precision))
        _write_json(self.path("train.json"), {**summary, "tokens": int(fs.offsets[-1]), "conversations": len(fs)})
        torch.save(head.state_dict(), p + ".tmp")
        os.replace(p + ".tmp", p)
        return head.eval()

    def evaluate(self, head_dir: str) -> dict:
        loaded = self.loaded()
        head = load_eagle3(head_dir, num_target_layers=loaded.config.num_hidden_layers)
        # greedy responses of a small model often loop until max_tokens: report those apart
        ended = ["(response hit max_tokens)" if len(c.response_ids) >= self.cfg.max_tokens else "(response ended)"
                 for c in self.responses()["heldout"]]
        res = self._timed("evaluate", lambda: acceptance(head, self.embed(), self.features("heldout"),
                                                         self.cfg.eval_k, groups=ended))
        _write_json(self.path("eval.json"), res)

        def on_engine():  # the same chains on the states the engine serves the head (engine_states)
            fs, quant = engine_states(self.cfg.model, self.features("heldout"))
            return {"quantization": quant,
                    **acceptance(head, self.embed(), fs, self.cfg.eval_k, groups=ended)}
        _write_json(self.path("eval_engine.json"), self._timed("evaluate_engine_states", on_engine))
        return res

    def run(self) -> dict:
        self.prompts()
        self.responses()
        self._llm = None  # the engine's KV cache (GiBs) is not needed past generation
        gc.collect()
        self.features("train")
        self.features("heldout")
        self.vocab()
        head = self.trained()
        self._timed("export", lambda: save_eagle3(head, self.out))
        result = self.evaluate(self.out)
        self.write_recipe(result)
        return result

    def write_recipe(self, result: dict) -> None:
        res = self.responses()
        tr = self._read("train.json", dict) or {}
        voc = self.vocab()
        c = self.cfg
        ntok = lambda split, f: sum(len(getattr(x, f)) for x in res[split])
        lines = [
            "# EAGLE-3 head: recipe", "",
            "Produced by `tokenbudget train-draft` (tokenbudget/training/); rerun to reproduce:", "",
            "```", self.command or "tokenbudget train-draft", "```", "",
            f"- target: `{c.model or 'default (SmolLM2-135M-Instruct Q4_1 GGUF)'}`; taps (input of layers) "
            f"{list(default_aux_layer_ids(self.loaded().config.num_hidden_layers))}",
            f"- data (self-distilled, nothing downloaded): {len(res['train'])} training conversations "
            f"({ntok('train', 'prompt_ids')} prompt + {ntok('train', 'response_ids')} response tokens), "
            f"{len(res['heldout'])} held-out ({ntok('heldout', 'response_ids')} response tokens); prompts: "
            f"{c.self_written:.0%} written by the target, the rest templates and standard-library text; "
            "responses greedy, max_tokens " f"{c.max_tokens}",
            f"- head: hidden {self.loaded().config.hidden_size}, intermediate {c.intermediate_size}, draft vocabulary "
            f"{c.draft_vocab} (coverage of response tokens: train {voc['coverage_train']:.1%}, held-out "
            f"{voc['coverage_heldout']:.1%}), float16",
            f"- training: {c.train.ttt_steps}-step training-time test, {c.train.epochs} epochs "
            f"({tr.get('batches', '?')} batches of <= {c.train.batch_tokens} tokens), AdamW lr {c.train.lr}, "
            f"{tr.get('seconds', '?')} s",
            f"- stage times (s, {torch.get_num_threads()} threads): {json.dumps(self.times)}", "",
            f"## Held-out acceptance (greedy, k = {c.eval_k})", "",
            "tau = 1 + mean accepted drafts per verify; accept@j = P(draft j accepted | drafts before it were).", "",
            "| kind | chains | tau | " + " | ".join(f"accept@{j + 1}" for j in range(c.eval_k)) + " |",
            "|---|---|---|" + "---|" * c.eval_k]
        for kind, s in result.items():
            if s.get("chains"):
                lines.append(f"| {kind} | {s['chains']} | {s['tau']:.2f} | "
                             + " | ".join(f"{a:.2f}" if a is not None else "-" for a in s["accept_at_position"]) + " |")
        eng = self._read("eval_engine.json", dict)
        if eng and eng["all"].get("chains"):
            a = eng["all"]
            lines += ["", f"The table reads the tap states of the torch forward training reads ({self.precision}). On "
                      f"the engine's own states (quantization {eng['quantization']}, the forward that serves "
                      f"the head): tau {a['tau']:.2f}, accept@j "
                      + " / ".join(f"{x:.2f}" for x in a["accept_at_position"] if x is not None)
                      + (f"; chat tau {eng['chat']['tau']:.2f}" if eng.get("chat", {}).get("chains") else "") + "."]
        with open(os.path.join(self.out, "RECIPE.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


def run_pipeline(cfg: PipelineConfig, command: str = "", use_tqdm: bool = True) -> dict:
    return Pipeline(cfg, command, use_tqdm).run()
