"""Charts for benches/adaptive.py: tokens/s per configuration and the batch-size sweep."""

from __future__ import annotations

import os

ADAPTIVE = "adaptive"
BASE = "no-spec"


def figures(summ: dict, sweep_keys: list[str], out_dir: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    names = [n for n in ("low", "high") if n in summ]
    if names:
        labels = list(summ[names[0]])
        fig, ax = plt.subplots(figsize=(7, 4))
        w = 0.8 / len(labels)
        for j, lab in enumerate(labels):
            ys = [summ[n][lab]["tok_s"] for n in names]
            bars = ax.bar([i + j * w for i in range(len(names))], ys, w, label=lab,
                          color="black" if lab == ADAPTIVE else None)
            for b_, y in zip(bars, ys):
                ax.text(b_.get_x() + b_.get_width() / 2, y, f"{y:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(names))])
        ax.set_xticklabels({"low": "low acceptance (open chat)", "high": "high acceptance (code edit, summ.)"}[n]
                           for n in names)
        ax.set_ylabel("tokens/s (generation phase, batch 1)")
        ax.set_title("n-gram speculation: adaptive vs fixed k (CPU, SmolLM2-135M)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "adaptive_workloads.png"), dpi=110)
        plt.close(fig)
    if sweep_keys:
        bs = [int(k.split("=")[1]) for k in sweep_keys]
        labels = list(summ[sweep_keys[0]])
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for lab in labels:
            ys = [summ[k][lab]["tok_s"] for k in sweep_keys]
            style = dict(color="black", lw=2.5) if lab == ADAPTIVE else {}
            ax.plot(bs, ys, marker="o", label=lab, **style)
            ax2.plot(bs, [summ[k][lab]["tok_s"] / summ[k][BASE]["tok_s"] for k in sweep_keys],
                     marker="o", label=lab, **style)
        for a in (ax, ax2):
            a.set_xscale("log", base=2)
            a.set_xticks(bs)
            a.set_xticklabels([str(b) for b in bs])
            a.set_xlabel("batch size")
        ax.set_ylabel("tokens/s (generation phase)")
        ax2.set_ylabel("tokens/s ÷ no speculation")
        ax2.axhline(1.0, color="gray", lw=0.8)
        ax.set_title("Batch sweep, mixed prompts")
        ax2.set_title("Relative to no speculation")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "adaptive_batch_sweep.png"), dpi=110)
        plt.close(fig)
