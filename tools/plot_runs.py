"""Draw the loss curves (and BLEU, for translation runs) of several runs into one PNG.

    python tools/plot_runs.py runs/1f1b/metrics.jsonl pipeoptim=runs/pipeoptim/metrics.jsonl --out cmp.png

Each run is a `--metrics-file` of pretrain_gpt.py / pretrain_nmt.py (one JSON object per logged
iteration), given as PATH (labelled by its directory) or LABEL=PATH. Training loss is drawn solid and
validation loss dashed with markers, one colour per run; a second panel shows every key containing
"bleu" when a run logged one. A run that was resumed from a checkpoint logs some iterations twice: the
later record wins.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_po.errors import DataError, UserError, run_cli

TRAIN_LOSS_KEYS = ("lm_loss", "loss")  # GPT logs lm_loss; the first key present is the training loss


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="metrics files: PATH or LABEL=PATH")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--x", default="iteration", choices=["iteration", "consumed_samples"], help="x axis")
    p.add_argument("--title", default=None, help="figure title")
    return p


def read_run(path: str) -> list[dict]:
    """The run's records by iteration (the last record of an iteration wins)."""
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such metrics file")
    by_iteration: dict[int, dict] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {n}: not a JSON object ({e.msg})") from None
            if not isinstance(rec, dict) or "iteration" not in rec:
                raise DataError(f"{path} line {n}: a metrics record needs an 'iteration'")
            by_iteration.setdefault(rec["iteration"], {}).update(rec)
    records = [by_iteration[i] for i in sorted(by_iteration)]
    if not any(k in r for r in records for k in TRAIN_LOSS_KEYS + ("val_loss",)):
        raise DataError(f"{path}: no loss records ({', '.join(TRAIN_LOSS_KEYS)} or val_loss)")
    return records


def series(records: list[dict], key: str, x: str) -> tuple[list, list]:
    pts = [(r.get(x, r["iteration"]), r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot(runs: list[tuple[str, list[dict]]], out: str, x: str, title: str | None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bleu_keys = sorted({k for _, recs in runs for r in recs for k in r if "bleu" in k.lower()})
    fig, axes = plt.subplots(1, 2 if bleu_keys else 1, figsize=(12 if bleu_keys else 7, 4.5), squeeze=False)
    loss_ax = axes[0][0]
    for i, (label, recs) in enumerate(runs):
        colour = f"C{i % 10}"
        train_key = next((k for k in TRAIN_LOSS_KEYS if any(k in r for r in recs)), None)
        if train_key:
            loss_ax.plot(*series(recs, train_key, x), color=colour, label=f"{label} train")
        xs, ys = series(recs, "val_loss", x)
        if xs:
            loss_ax.plot(xs, ys, "--o", color=colour, markersize=3, label=f"{label} validation")
    loss_ax.set_xlabel(x.replace("_", " "))
    loss_ax.set_ylabel("loss")
    loss_ax.grid(alpha=0.3)
    loss_ax.legend(fontsize=8)
    if bleu_keys:
        bleu_ax = axes[0][1]
        for i, (label, recs) in enumerate(runs):
            for j, key in enumerate(bleu_keys):
                xs, ys = series(recs, key, x)
                if xs:
                    bleu_ax.plot(xs, ys, ["-o", "--s", ":^"][j % 3], color=f"C{i % 10}", markersize=3,
                                 label=f"{label} {key}")
        bleu_ax.set_xlabel(x.replace("_", " "))
        bleu_ax.set_ylabel("BLEU")
        bleu_ax.grid(alpha=0.3)
        bleu_ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_runs(args: argparse.Namespace) -> None:
    runs = []
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep or os.path.isfile(spec):
            path, label = spec, os.path.basename(os.path.dirname(os.path.abspath(spec)))
        runs.append((label, read_run(path)))
    plot(runs, args.out, args.x, args.title)
    print(f"wrote {args.out} ({len(runs)} runs)")


def main(argv=None) -> int:
    return run_cli(plot_runs, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
