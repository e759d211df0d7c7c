"""Newton-Schulz orthogonalisation for Muon: coefficient sets, matmul precision, batched and TP-distributed.

`newton_schulz(x)` approximates the orthogonal polar factor of a matrix, or of every matrix of a stack
[n, rows, cols] at once (one batched matmul per product: same-shape matrices cost one call, not n):

    X ← x / (‖x‖_F + eps) (per matrix), transposed so that rows ≤ cols; then per step (a, b, c):
    A = X·Xᵀ;  B = b·A + c·A·A;  X ← a·X + B·X

Coefficient sets (`--muon-coefficient-type`, Emerging-Optimizers' names; the numbers are data, with their
sources): "simple" repeats Keller Jordan's (3.4445, -4.7750, 2.0315) every step (Muon's original, any
number of steps; the singular values end in roughly [0.7, 1.2], not at 1); "quintic" is five tuned
per-step sets (modded-nanogpt's train_gpt_medium.py, as tabulated by NVIDIA-NeMo/Emerging-Optimizers
`muon_utils.py`; steps a multiple of 5); "polar_express" is the Polar Express schedule of Amsel, Persson,
Musco and Gower (arXiv 2505.16932), the paper's eight per-step polynomials with its 1.01 safety factor
applied, as tabulated in the same file (at least 8 steps; further steps repeat the last set).

Matmul precision (`--muon-fp32-matmul-prec`, Megatron-LM's flag, torch's level names): "medium" casts the
normalised X to bf16 and iterates in bf16 (what Emerging-Optimizers does for "medium": torch has no fp32-in
/ bf16-compute kernels) and returns bf16; "high" iterates in fp32 with TF32 matmuls allowed (where the device
has them: on a CPU it is fp32); "highest" (or Megatron's "low", which torch does not know and so leaves at
its fp32 default) iterates in full fp32. The normalisation is always computed in fp32.

TP-distributed (`tp_group`): each rank holds a slice of every matrix along one dim; with `transpose` chosen so
that the slices split the long side of X, X·Xᵀ is the sum over ranks of the slices' Gram matrices: one
all-reduce of the squared norm, then one of A per step, and each rank keeps its own slice of the result.
Exact in exact arithmetic (Megatron's `--muon-tp-mode distributed`); rounding differs from gathering.

Gram Newton-Schulz (`gram_newton_schulz`, opt-in: Muon's `--muon-gram-newton-schulz`): the same iterations
computed on the small side. Each step is X ← P(A)·X with P(A) = a·I + b·A + c·A², A = X·Xᵀ, so X_k = Q_k·X_0 with
Q_k = P_{k-1}···P_0 and A_{k+1} = P·A·P (P is a polynomial of A: they commute); iterating on the m x m matrices A
and Q and forming Q·X_0 once costs 4m²n + ~4m³ per step instead of (4m²n + 2m³) every step: for a [h, 4h] MLP
matrix 50 m³ instead of 90 m³ in 5 steps (-44 %), for a square one more (so `newton_schulz(..., gram=True)`
takes it only where cols >= GRAM_MIN_ASPECT x rows). In exact arithmetic it is the same X; in bf16 the product Q
accumulates rounding, so in bf16 it restarts (X_0 ← Q·X_0, A from it) every `GRAM_RESTART_BF16` steps (5 steps:
60 m³, -33 %), as Dao AI Lab's Gram Newton-Schulz restarts; in fp32 it needs none (without a restart bf16 drifts:
singular values up to 3 where the standard iteration ends at 1.2). Even so bf16 rounds it more: its output lies
2-4x farther from the fp32 iteration than the standard bf16 iteration's (Q's gains span 1/σ_min), with the same
singular-value band. bench/step/muon_step.py measures both against the standard iteration and the polar factor.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import Tensor

COEFFICIENT_SETS = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)],
    "polar_express": [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)],
}
COEFFICIENT_TYPES = tuple(COEFFICIENT_SETS)
MATMUL_PRECISIONS = ("medium", "high", "highest", "low")
GRAM_MIN_ASPECT = 2  # Gram iterations only for matrices at least this much wider than tall (fewer FLOPs there)
GRAM_RESTART_BF16 = 3  # steps between restarts of the Gram product in bf16 (fp32 runs all steps in one go)


def coefficients(coefficient_type: str, steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) of each of `steps` iterations; ValueError for a type or step count the set does not take."""
    if coefficient_type not in COEFFICIENT_SETS:
        raise ValueError(f"invalid Newton-Schulz coefficient type {coefficient_type!r} (must be one of "
                         f"{', '.join(COEFFICIENT_TYPES)})")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"invalid number of Newton-Schulz steps: {steps} (must be an integer >= 1)")
    sets = COEFFICIENT_SETS[coefficient_type]
    if coefficient_type == "simple":
        return sets * steps
    if coefficient_type == "polar_express":
        if steps < len(sets):
            raise ValueError(f"Newton-Schulz coefficient type polar_express needs at least {len(sets)} steps, got "
                             f"{steps}")
        return sets + sets[-1:] * (steps - len(sets))
    if steps % len(sets):
        raise ValueError(f"Newton-Schulz coefficient type {coefficient_type} needs a multiple of {len(sets)} steps, "
                         f"got {steps}")
    return sets * (steps // len(sets))


def check_precision(precision: str) -> None:
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"invalid Muon fp32 matmul precision {precision!r} (must be one of "
                         f"{', '.join(MATMUL_PRECISIONS)})")


def output_dtype(precision: str) -> torch.dtype:
    """The dtype `newton_schulz` returns at this precision (bf16 for "medium", else fp32)."""
    return torch.bfloat16 if precision == "medium" else torch.float32


@contextlib.contextmanager
def _fp32_matmuls(precision: str):
    """TF32 allowed ("high") or forbidden (otherwise) for fp32 matmuls inside, restored after. Uses torch's
    per-backend setting (`torch.backends.cuda.matmul.fp32_precision`), which, unlike the global
    `set_float32_matmul_precision`, reads and writes without error whichever API the caller used."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):  # torch < 2.9: the legacy switch
        previous = matmul.allow_tf32
        matmul.allow_tf32 = precision == "high"
        try:
            yield
        finally:
            matmul.allow_tf32 = previous
        return
    previous = matmul.fp32_precision
    matmul.fp32_precision = "tf32" if precision == "high" else "ieee"
    try:
        yield
    finally:
        matmul.fp32_precision = previous


def newton_schulz(u: Tensor, steps: int = 5, coefficient_type: str = "simple", precision: str = "highest",
                  eps: float = 1e-7, transpose: bool | None = None, tp_group=None, gram: bool = False) -> Tensor:
    """Approximate orthogonal polar factor of `u` ([rows, cols] or a stack [n, rows, cols]); see the module
    docstring. Returns fp32 (bf16 at precision "medium"), same shape as `u`. `transpose` (default: when
    rows > cols) iterates on uᵀ; `tp_group`: `u` is this rank's slice, split along the dim that `transpose`
    makes the columns of X (the TP-distributed iteration). `gram`: the Gram iteration (module docstring) where
    the matrix is at least GRAM_MIN_ASPECT times wider than tall and whole (no `tp_group`)."""
    if u.ndim not in (2, 3):
        raise ValueError(f"Newton-Schulz needs a matrix or a stack of matrices, got shape {tuple(u.shape)}")
    check_precision(precision)
    schedule = coefficients(coefficient_type, steps)
    x = u.float() if u.ndim == 3 else u.float().unsqueeze(0)
    if transpose is None:
        transpose = x.shape[-2] > x.shape[-1]
    if transpose:  # iterate on the wide orientation: A = X·Xᵀ is then the smaller Gram matrix
        x = x.mT
    squares = x.square().sum(dim=(-2, -1), keepdim=True)
    if tp_group is not None:
        dist.all_reduce(squares, group=tp_group)
    x = x / (squares.sqrt() + eps)
    if precision == "medium":
        x = x.bfloat16()
    with _fp32_matmuls(precision):
        if gram and tp_group is None and x.shape[-1] >= GRAM_MIN_ASPECT * x.shape[-2]:
            x = _gram_iterations(x, schedule)
        else:
            x = _iterations(x, schedule, tp_group)
    if transpose:
        x = x.mT
    return x if u.ndim == 3 else x[0]


def _iterations(x: Tensor, schedule, tp_group) -> Tensor:
    for a, b, c in schedule:
        gram = x @ x.mT
        if tp_group is not None:
            dist.all_reduce(gram, group=tp_group)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def _gram_iterations(x: Tensor, schedule) -> Tensor:
    """The steps of `schedule` on X (a stack of wide matrices) through the Gram matrix A = X·Xᵀ and the product
    Q of the step polynomials: X_k = Q·X_0 (module docstring), in bf16 restarting every GRAM_RESTART_BF16 steps."""
    eye = torch.eye(x.shape[-2], dtype=x.dtype, device=x.device).expand(x.shape[0], -1, -1)
    every = GRAM_RESTART_BF16 if x.dtype == torch.bfloat16 else len(schedule)
    for start in range(0, len(schedule), every):
        steps = schedule[start:start + every]
        gram, q = x @ x.mT, None
        for i, (a, b, c) in enumerate(steps):
            p = torch.baddbmm(torch.add(eye, gram, alpha=b / a), gram, gram, beta=a, alpha=c)  # aI + bA + cA²
            q = p if q is None else p @ q
            if i + 1 < len(steps):
                gram = p @ gram @ p
        x = q @ x
    return x


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """Multiply-add FLOPs (x2) of `steps` iterations on one rows x cols matrix: per step X·Xᵀ (2·m²n), A·A
    (2·m³) and B·X (2·m²n), with m = min(rows, cols), n = max(rows, cols)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def gram_newton_schulz_flops(rows: int, cols: int, steps: int, bf16: bool = True) -> int:
    """The same for the Gram iteration (`newton_schulz(..., gram=True)` on a wide matrix): per segment between
    restarts A = X·Xᵀ and Q·X (2·m²n each), and per step A·A, P·Q (not the first) and P·A·P (not the last)."""
    m, n = min(rows, cols), max(rows, cols)
    every = GRAM_RESTART_BF16 if bf16 else steps
    total = 0
    for start in range(0, steps, every):
        k = min(every, steps - start)
        total += 4 * m * m * n + 2 * m ** 3 * (k + (k - 1) + 2 * (k - 1))
    return total
