#!/usr/bin/env python3
"""Plot keel training curves from one or more metrics.jsonl files.

  python3 scripts/plot_metrics.py RUN1/metrics.jsonl [RUN2/metrics.jsonl ...] -o curves.png

keel writes one JSON object per line. Training records carry "step" and "loss" (and usually
"lr", "grad_norm", "consumed_tokens", "loss_scale", "tokens_per_s", ...); validation records
carry "step", "val_loss" (data.val) and "val_losses" ({name: loss} for data.val_sets) and no
"loss"; choice_eval records carry "choice_acc",
"choice_acc_per_token" and (text items) "choice_acc_per_byte". Three panels: loss (train solid,
validation dashed with markers, one colour per file, each named validation set dotted with
a marker of its own), gradient norm (log y) and learning rate;
a fourth with the multiple-choice accuracies when any file has them (acc solid, per token
dashed, per byte dotted). Missing fields,
blank or broken lines and non-finite values are skipped. After a resume or a rewind, only the
trajectory the run went on with is drawn. Each file is labelled by its parent directory's name
(or --labels).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys


def _num(v):
    """A finite float, or None."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


# choice_eval's accuracies and their line styles
CHOICE_KEYS = ("choice_acc", "choice_acc_per_token", "choice_acc_per_byte")
CHOICE_STYLES = {"choice_acc": "-o", "choice_acc_per_token": "--s", "choice_acc_per_byte": ":^"}
# one marker per named validation set (data.val_sets)
VAL_SET_MARKERS = "sD^vP*X"


def load_metrics(path: str) -> dict:
    """Each series as [(step, value)] sorted by step, one point per step: the last record of a step
    counts, and a resume at step S (or a rewind to S) drops the earlier records of the steps after
    S, which belong to the trajectory the run abandoned (as TensorBoard does at its restart marker);
    a new run's start in the same directory drops all earlier records."""
    by_step = {k: {} for k in ("train", "val", "grad_norm", "lr") + CHOICE_KEYS}
    val_sets = {}
    counts = {"bad_lines": 0, "nonfinite": 0}

    def restart_at(s):
        for points in list(by_step.values()) + list(val_sets.values()):
            for step in [x for x in points if x > s]:
                del points[step]

    with open(path, "r", encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                counts["bad_lines"] += 1  # e.g. a line cut short by a crash
                continue
            if not isinstance(rec, dict):
                counts["bad_lines"] += 1
                continue
            step = _num(rec.get("step"))
            if step is None:
                continue
            if rec.get("event") == "start":  # a new run in the same directory
                restart_at(-1)
            elif rec.get("event") == "resume":
                restart_at(step)
            elif rec.get("event") == "rewind" and _num(rec.get("to")) is not None:
                restart_at(_num(rec["to"]))
            if "loss" in rec:
                loss = _num(rec["loss"])
                if loss is None:
                    counts["nonfinite"] += 1
                else:
                    by_step["train"][step] = loss
                gn = _num(rec.get("grad_norm"))
                if gn is not None and gn > 0:
                    by_step["grad_norm"][step] = gn
                lr = _num(rec.get("lr"))
                if lr is not None:
                    by_step["lr"][step] = lr
            if "val_loss" in rec:
                vl = _num(rec["val_loss"])
                if vl is not None:
                    by_step["val"][step] = vl
            if isinstance(rec.get("val_losses"), dict):
                for name, v in rec["val_losses"].items():
                    vl = _num(v)
                    if vl is not None:
                        val_sets.setdefault(name, {})[step] = vl
            for k in CHOICE_KEYS:
                acc = _num(rec.get(k))
                if acc is not None:
                    by_step[k][step] = acc
    series = {k: sorted(points.items()) for k, points in by_step.items()}
    series["val_sets"] = {name: sorted(points.items()) for name, points in val_sets.items() if points}
    series.update(counts)
    return series


def default_label(path: str) -> str:
    parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return parent or os.path.basename(path)


def unique_labels(labels: list) -> list:
    seen, out = {}, []
    for lab in labels:
        n = seen.get(lab, 0)
        seen[lab] = n + 1
        out.append(lab if n == 0 else f"{lab} ({n + 1})")
    return out


def plot(runs: list, out: str, title: str | None = None, smooth: int = 1) -> None:
    import matplotlib  # here, so that load_metrics works without it (test/scripts)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_choice = any(s[k] for _, s in runs for k in CHOICE_KEYS)
    ratios = [2, 1, 1] + ([1] if with_choice else [])
    fig, axes = plt.subplots(len(ratios), 1, figsize=(10, 10 + 3 * with_choice), sharex=True,
                             gridspec_kw={"height_ratios": ratios})
    ax_loss, ax_gn, ax_lr = axes[:3]
    ax_choice = axes[3] if with_choice else None
    colours = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    gn_any = False
    for i, (label, s) in enumerate(runs):
        c = colours[i % len(colours)]
        if s["train"]:
            x, y = zip(*s["train"])
            if smooth > 1:
                y = moving_average(y, smooth)
            ax_loss.plot(x, y, "-", color=c, lw=1.2, label=f"{label} train")
        if s["val"]:
            x, y = zip(*s["val"])
            ax_loss.plot(x, y, "--o", color=c, lw=1.2, ms=4, label=f"{label} val")
        for j, (name, points) in enumerate(sorted(s["val_sets"].items())):
            x, y = zip(*points)
            ax_loss.plot(x, y, ":" + VAL_SET_MARKERS[j % len(VAL_SET_MARKERS)], color=c, lw=1.2, ms=4,
                         label=f"{label} val ({name})")
        if s["grad_norm"]:
            x, y = zip(*s["grad_norm"])
            ax_gn.plot(x, y, "-", color=c, lw=1.0, label=label)
            gn_any = True
        if s["lr"]:
            x, y = zip(*s["lr"])
            ax_lr.plot(x, y, "-", color=c, lw=1.2, label=label)
        for k in CHOICE_KEYS if with_choice else ():
            if s[k]:
                x, y = zip(*s[k])
                ax_choice.plot(x, y, CHOICE_STYLES[k], color=c, lw=1.2, ms=4,
                               label=f"{label} {k.replace('choice_', '')}")

    ax_loss.set_ylabel("loss")
    ax_loss.set_title(title or "keel training curves")
    ax_gn.set_ylabel("grad norm")
    if gn_any:
        ax_gn.set_yscale("log")
    ax_lr.set_ylabel("learning rate")
    axes[-1].set_xlabel("step")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if ax_choice is not None:
        ax_choice.set_ylabel("choice accuracy")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes,
                    color="grey")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def moving_average(y, k: int):
    out, acc = [], 0.0
    window = []
    for v in y:
        window.append(v)
        acc += v
        if len(window) > k:
            acc -= window.pop(0)
        out.append(acc / len(window))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics", nargs="+", help="metrics.jsonl files")
    ap.add_argument("-o", "--out", default="curves.png", help="output image (default curves.png)")
    ap.add_argument("--labels", nargs="+", help="one label per file (default: parent dir names)")
    ap.add_argument("--title", help="figure title")
    ap.add_argument("--smooth", type=int, default=1, help="moving-average window for the train loss")
    args = ap.parse_args(argv)
    if args.labels and len(args.labels) != len(args.metrics):
        ap.error("--labels needs one label per metrics file")

    labels = unique_labels(args.labels or [default_label(p) for p in args.metrics])
    runs = []
    for path, label in zip(args.metrics, labels):
        if not os.path.exists(path):
            print(f"warning: {path} not found, skipped", file=sys.stderr)
            continue
        s = load_metrics(path)
        note = []
        if s["bad_lines"]:
            note.append(f"{s['bad_lines']} unreadable lines")
        if s["nonfinite"]:
            note.append(f"{s['nonfinite']} non-finite losses")
        last = f", last loss {s['train'][-1][1]:.4f} at step {s['train'][-1][0]:g}" if s["train"] else ""
        lastv = f", last val_loss {s['val'][-1][1]:.4f}" if s["val"] else ""
        lastc = f", last choice_acc {s['choice_acc'][-1][1]:.4f}" if s["choice_acc"] else ""
        print(f"{label}: {len(s['train'])} train / {len(s['val'])} val records{last}{lastv}{lastc}"
              + (f" ({'; '.join(note)})" if note else ""))
        runs.append((label, s))
    if not runs:
        print("no metrics files could be read", file=sys.stderr)
        return 1
    plot(runs, args.out, args.title, max(1, args.smooth))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
