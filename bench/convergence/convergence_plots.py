"""bench/convergence/convergence.py's plots: `convergence.png` (train and validation loss per (D, optimizer), mean
over seeds with a ±1 std band) and `predictors.png` (the predictor variants' validation loss)."""

from __future__ import annotations

import math

from convergence_settings import (ASYNC_METHODS, COLORS, LABELS, OPT_LABELS, PREDICTOR_VARIANTS, SYNC_METHODS,
                                  VARIANT_COLORS, Settings)


def fit_ylim(ax, lows: list[float], highs: list[float]) -> None:
    """Y range from the curves' finite lows and highs, padded by 5 % (left to matplotlib when empty)."""
    lows = [v for v in lows if math.isfinite(v)]
    highs = [v for v in highs if math.isfinite(v)]
    if lows and highs and max(highs) > min(lows):
        pad = 0.05 * (max(highs) - min(lows))
        ax.set_ylim(min(lows) - pad, max(highs) + pad)


def mean_band(curves: list[list]) -> tuple:
    """x, the mean and the standard deviation (0 for one seed) of the seeds' curves [(x, y), ...], to the shortest."""
    import numpy as np
    n = min(len(c) for c in curves)
    x = np.array([p[0] for p in curves[0][:n]], dtype=float)
    y = np.array([[p[1] for p in c[:n]] for c in curves])
    return x, y.mean(0), (y.std(0, ddof=1) if len(curves) > 1 else np.zeros(n))


def plot_predictors(s: Settings, summary: dict, path: str) -> str | None:
    """Validation loss over training per (D, optimizer): synchronous, PipeOptim, PipeDream and the variants
    (mean over seeds, band ±1 std)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    methods = ["sync", "pipeoptim", "pipedream", *[m for m in PREDICTOR_VARIANTS if m in s.methods]]
    train = summary["train"]
    nrows, ncols = len(s.depths), len(s.optimizers)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.0 * nrows), squeeze=False)
    handles = {}
    for i, D in enumerate(s.depths):
        for j, o in enumerate(s.optimizers):
            ax = axes[i][j]
            lows, highs = [], []
            for m in methods:
                curves = [r["val"] for r in train.get((0, o, "sync") if m == "sync" else (D, o, m), {}).values()]
                if not curves or not min(map(len, curves)):
                    continue
                x, mean, std = mean_band(curves)
                color = COLORS.get(m) or VARIANT_COLORS[m]
                style = "-" if m in ("sync", "pipeoptim") or m.startswith("po-") else ":"
                (h,) = ax.plot(x, mean, color=color, lw=1.3, ls=style, marker="o", ms=3, label=LABELS[m])
                ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.08, lw=0)
                handles[m] = h
                lows.append(float(np.nanmin(mean - std)))
                highs.append(float(np.nanmax(mean[1:] + std[1:])) if len(x) > 1 else float(mean[0]))
            fit_ylim(ax, lows, highs)  # highs skip the first evaluation: it may be far off
            ax.set_title(f"D={D}, {OPT_LABELS[o]}")
            ax.set_xlabel(f"micro-batches of B={s.micro_batch}")
            ax.set_ylabel("validation loss")
            ax.grid(alpha=0.3)
    if not handles:
        plt.close(fig)
        return None
    ncol = 2 * ncols
    legend_rows = math.ceil(len(handles) / ncol)
    fig.legend(handles=list(handles.values()), loc="lower center", ncol=ncol, frameon=False, fontsize="small")
    fig.suptitle(f"{s.workload.upper()}: weight predictors and gradient-side variants vs PipeOptim and synchronous\n"
                 f"(validation loss, mean over {s.seeds} seed(s), band ±1 std)")
    fig.tight_layout(rect=(0, 0.035 * legend_rows * 2 / nrows, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot(s: Settings, summary: dict, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    train = summary["train"]
    nrows, ncols = len(s.depths), len(s.optimizers)
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(10.4, 5.2 * ncols), 4.0 * nrows), squeeze=False)
    window = max(1, s.eval_interval // 4)
    handles = {}
    for i, D in enumerate(s.depths):
        for j, o in enumerate(s.optimizers):
            ax = axes[i][j]
            lows, highs = [], []
            for m in ("sync",) + ASYNC_METHODS:
                if m == "sync" and not any(x in s.methods for x in SYNC_METHODS):
                    continue
                if m != "sync" and m not in s.methods:
                    continue
                runs = train.get((0, o, "sync") if m == "sync" else (D, o, m), {})
                if not runs:
                    continue
                n = min(len(r["losses"]) for r in runs.values())
                if n == 0:
                    continue
                curves = np.array([_smooth(r["losses"][:n], window) for r in runs.values()])
                x = np.arange(1, n + 1)
                mean, std = curves.mean(0), curves.std(0, ddof=1) if len(curves) > 1 else np.zeros(n)
                color = COLORS[m]
                (h,) = ax.plot(x, mean, color=color, lw=1.2, label=LABELS[m])
                ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.15, lw=0)
                handles[m] = h
                if min(len(r["val"]) for r in runs.values()):
                    vx, vm, vs = mean_band([r["val"] for r in runs.values()])
                    ax.plot(vx, vm, color=color, lw=1.2, ls="--", marker="o", ms=3)
                    ax.fill_between(vx, vm - vs, vm + vs, color=color, alpha=0.15, lw=0)
                    lows.append(float(np.nanmin(vm - vs)))
                lows.append(float(np.nanmin(mean - std)))
                highs.append(float(mean[min(n - 1, max(0, n // 5))]))
            fit_ylim(ax, lows, highs)
            ax.set_title(f"D={D}, {OPT_LABELS[o]}")
            ax.set_xlabel(f"micro-batches of B={s.micro_batch} (samples / {s.micro_batch})")
            ax.set_ylabel("loss")
            ax.grid(alpha=0.3)
    from matplotlib.lines import Line2D
    extra = [Line2D([], [], color="k", lw=1.2, label=f"train (moving mean, {window} micro-batches)"),
             Line2D([], [], color="k", lw=1.2, ls="--", marker="o", ms=3, label="validation")]
    fig.legend(handles=list(handles.values()) + extra, loc="lower center",  # one panel: two legend rows
               ncol=min(8 if ncols > 1 else 4, len(handles) + 2), frameon=False)
    fig.suptitle(f"{s.workload.upper()} convergence: mean over {s.seeds} seed(s), band = ±1 std "
                 f"(GPipe/1F1B = the same synchronous run at every D)")
    fig.tight_layout(rect=(0, 0.05 if ncols > 1 else 0.1, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
