"""Megatron's sample-counted schedule (megatron_po/optim/sample_schedule.py) against closed forms.

- --rampup-batch-size START INCR SAMPLES: the batch of every iteration is Megatron's rule
  START + floor(c / (SAMPLES / n)) * INCR (n = (G - START) / INCR increments) while c <= SAMPLES, else G;
  consumed samples are the running sum; --train-samples gives Megatron's iteration count.
- The lr: iteration flags, sample flags and --lr-warmup-fraction follow the closed form (in iterations, in
  samples); with a ramp the warm-up reads the consumed samples, not iterations; the studies' micro-batch clock
  (`microbatch_lr`: step i of a chunk stepping every k micro-batches at the lr of micro-batch i*k) is the same
  rule, to the bit.
- A synchronous TP=2 x PP=2 run with a ramp consumes and logs exactly those samples (the micro-batch
  count changes every few iterations), and a 1-process run with a ramp equals it (loss per logged iteration).
"""

import math

import pytest

from megatron_po.config import TrainingConfig, parse_args
from megatron_po.config_rules import validate
from megatron_po.errors import ConfigError
from megatron_po.optim.sample_schedule import SampleSchedule, microbatch_lr

MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


def schedule(argv, world=1):
    cfg = parse_args(MOCK + argv)
    validate(cfg, world)
    return SampleSchedule(cfg, world)


def ramp_closed_form(start, incr, ramp_samples, gbs, iters):
    n = (gbs - start) // incr
    consumed, batches = 0, []
    for _ in range(iters):
        b = gbs if consumed > ramp_samples else start + math.floor(consumed / (ramp_samples / n)) * incr
        batches.append(b)
        consumed += b
    return batches


def test_rampup_batches_and_consumed_samples_follow_megatron_rule():
    s = schedule(["--micro-batch-size", "2", "--global-batch-size", "32", "--rampup-batch-size", "8", "8", "100",
                  "--train-iters", "20"], world=2)  # DP=2: every ramp batch is whole micro-batches per rank
    expected = ramp_closed_form(8, 8, 100, 32, 20)
    assert expected[:6] == [8, 8, 8, 8, 8, 16] and expected[-1] == 32  # 100 / 3 samples per increment
    assert [s.batch(i) for i in range(20)] == expected
    assert [s.consumed_before(i) for i in range(21)] == [sum(expected[:i]) for i in range(21)]
    assert [s.num_microbatches(i) for i in range(20)] == [b // 4 for b in expected]
    assert s.total_samples == sum(expected)


def test_train_samples_gives_megatrons_iteration_count():
    assert schedule(["--global-batch-size", "8", "--micro-batch-size", "4", "--train-samples", "100"]).train_iters == 12
    s = schedule(["--micro-batch-size", "2", "--global-batch-size", "32", "--rampup-batch-size", "8", "8", "100",
                  "--train-samples", "1000"])
    b = ramp_closed_form(8, 8, 100, 32, 1000)
    # Megatron's update_train_iters: ramp iterations while consumed <= 100, then whole batches of 32
    iters, consumed = 0, 0
    while consumed <= 100:
        consumed += b[iters]
        iters += 1
    assert s.train_iters == iters + (1000 - consumed) // 32


def iteration_closed_form(i: int, style: str, lr: float, low: float, W: int, T: int, wsd: int) -> float:
    """Megatron's schedule in iterations: warm-up lr (i + 1) / W, then constant, linear, cosine or WSD (stable,
    then linear over the last wsd iterations) from lr to low at T, low after."""
    if i < W:
        return lr * (i + 1) / W
    if style == "constant":
        return lr
    if i >= T:
        return low
    if style == "wsd":
        return lr if i < T - wsd else lr - (lr - low) * (i - (T - wsd)) / wsd
    frac = (i - W) / (T - W)
    coeff = 1 - frac if style == "linear" else 0.5 * (math.cos(math.pi * frac) + 1)
    return low + coeff * (lr - low)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "wsd"])
def test_iteration_flags_follow_the_closed_form(style):
    argv = ["--global-batch-size", "8", "--micro-batch-size", "4", "--train-iters", "50", "--lr-warmup-iters", "5",
            "--lr-decay-iters", "40", "--lr-decay-style", style, "--min-lr", "1e-5"]
    cfg = parse_args(MOCK + argv)
    s = SampleSchedule(cfg, 1)
    t = cfg.training
    for i in range(50):
        want = iteration_closed_form(i, style, t.lr, t.min_lr, 5, 40, 3)  # WSD: 10 % of the 35 decay iterations
        assert s.lr_at(i) == pytest.approx(want, rel=1e-12, abs=1e-15), i
        # the studies' micro-batch clock at k = 1: the same schedule, one micro-batch per iteration, to the bit
        # where no rounding differs (warm-up and the single-formula decays)
        if style != "wsd":
            assert microbatch_lr(i, 1, t) == iteration_closed_form(i, style, t.lr, t.min_lr, 5, 40, 3), i


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_microbatch_clock_steps_at_the_lr_of_micro_batch_i_times_k(k):
    """Step i of a chunk that steps every k micro-batches uses the lr of micro-batch i*k: warm-up over 7 micro-batches
    (not a power of two: the order of the warm-up's product and quotient is pinned), cosine to 0.1 x at 96."""
    t = TrainingConfig(lr=3e-3, min_lr=3e-4, lr_decay_style="cosine", lr_warmup_iters=7, train_iters=96)
    for i in range(96 // k + 2):
        assert microbatch_lr(i, k, t) == iteration_closed_form(i * k, "cosine", 3e-3, 3e-4, 7, 96, 0), (k, i)


def test_sample_flags_follow_the_closed_form():
    lr, low, W, D = 3e-4, 3e-5, 40, 200
    s = schedule(["--global-batch-size", "8", "--micro-batch-size", "4", "--train-samples", "240",
                  "--lr-warmup-samples", str(W), "--lr-decay-samples", str(D), "--lr", str(lr), "--min-lr", str(low),
                  "--lr-decay-style", "linear"])
    assert s.train_iters == 30
    for i in range(30):
        c = 8 * i
        want = lr * min(1, (c + 8) / W) if c < W else (low if c >= D else lr - (lr - low) * (c - W) / (D - W))
        assert s.lr_at(i) == pytest.approx(want, rel=1e-12), i


def test_warmup_fraction_and_ramp_read_consumed_samples():
    lr = 1e-3
    s = schedule(["--micro-batch-size", "2", "--global-batch-size", "32", "--rampup-batch-size", "8", "8", "100",
                  "--train-iters", "40", "--lr-warmup-fraction", "0.1", "--lr", str(lr), "--lr-decay-style", "cosine",
                  "--min-lr", "0"])
    D = 40 * 32  # iteration flags: decay over --lr-decay-iters (default train iters) x the full global batch
    W = 0.1 * D
    for i in range(40):
        c, b = s.consumed_before(i), s.batch(i)
        if c < W:
            want = lr * min(1, (c + b) / W)
        else:
            want = 0.5 * (math.cos(math.pi * (c - W) / (D - W)) + 1) * lr
        assert s.lr_at(i) == pytest.approx(want, rel=1e-12), i


@pytest.mark.parametrize("argv, words", [
    (["--rampup-batch-size", "8", "8", "100", "--global-batch-size", "30", "--micro-batch-size", "2"],
     "must be START (8) plus a multiple of INCR (8)"),
    (["--rampup-batch-size", "6", "2", "100", "--global-batch-size", "32", "--micro-batch-size", "4"],
     "multiples of --micro-batch-size x data-parallel size (4)"),
    (["--rampup-batch-size", "8", "x", "100"], "three integers"),
    (["--train-samples", "100", "--train-iters", "5"], "--train-samples and --train-iters exclude each other"),
    (["--train-samples", "100", "--lr-warmup-iters", "5"], "--lr-warmup-iters counts iterations"),
    (["--lr-decay-samples", "100"], "--lr-decay-samples counts samples: it needs --train-samples"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], "--lr-warmup-fraction and --lr-warmup-iters"),
])
def test_bad_schedule_flags_are_one_line(argv, words):
    with pytest.raises(ConfigError, match=None) as e:
        validate(parse_args(MOCK + argv), 1)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_async_methods_refuse_the_ramp():
    cfg = parse_args(MOCK + ["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights",
                             "--pipeline-method", "pipeoptim", "--micro-batch-size", "1", "--global-batch-size", "8",
                             "--rampup-batch-size", "4", "2", "50"])
    with pytest.raises(ConfigError, match="--rampup-batch-size changes the micro-batches per iteration"):
        validate(cfg, 2)


def test_pipedream_2bw_defaults_update_interval_to_depth():
    from megatron_po.config import update_interval
    cfg = parse_args(MOCK + ["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights",
                             "--pipeline-method", "pipedream-2bw", "--global-batch-size", "8"])
    validate(cfg, 2)
    assert update_interval(cfg) == 2
    cfg.parallel.pipeline_method = "pipeoptim"
    assert update_interval(cfg) == 1
    assert TrainingConfig().train_samples is None


def _ramp_run(tmp_path, name, world, extra):
    from dist_harness import run_distributed
    from test_pretrain_gpt import read_metrics, run_pretrain
    out = tmp_path / name
    argv = MOCK + ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                   "--micro-batch-size", "2", "--global-batch-size", "12", "--rampup-batch-size", "4", "4", "20",
                   "--train-iters", "8", "--lr", "3e-3", "--lr-warmup-fraction", "0.2", "--hidden-dropout", "0",
                   "--attention-dropout", "0", "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1",
                   "--make-vocab-size-divisible-by", "4", "--metrics-file", str(out / "m.jsonl")] + extra
    assert run_distributed(run_pretrain, world, args=(argv,), timeout=300) == [0] * world
    return read_metrics(out / "m.jsonl")


def test_rampup_run_tp2_pp2_equals_one_process(tmp_path):
    """TP=2 x PP=2 1F1B and interleaved PP=2 x 2 chunks with a ramp (2, 4, then 6 micro-batches per iteration:
    batches 4, 8, 12) = one process (fp32, 2e-4)."""
    layers4 = ["--num-layers", "4"]
    one = _ramp_run(tmp_path, "one", 1, layers4)
    four = _ramp_run(tmp_path, "four", 4, layers4 + ["--tensor-model-parallel-size", "2",
                                                     "--pipeline-model-parallel-size", "2"])
    interleaved = _ramp_run(tmp_path, "vpp", 2, layers4 + ["--pipeline-model-parallel-size", "2",
                                                           "--num-layers-per-virtual-pipeline-stage", "1"])
    cfg = parse_args(MOCK + ["--micro-batch-size", "2", "--global-batch-size", "12", "--rampup-batch-size", "4", "4",
                             "20", "--train-iters", "8", "--lr", "3e-3", "--lr-warmup-fraction", "0.2"])
    s = SampleSchedule(cfg, 1)
    assert [s.batch(i) for i in range(8)] == [4, 4, 4, 8, 12, 12, 12, 12]
    for rec in (one, four, interleaved):
        train = [r for r in rec if "lm_loss" in r]
        assert [r["consumed_samples"] for r in train] == [s.consumed_before(i + 1) for i in range(8)]
        assert [r["lr"] for r in train] == pytest.approx([s.lr_at(i) for i in range(8)], rel=1e-12)
    a = [r["lm_loss"] for r in one if "lm_loss" in r]
    for run in (four, interleaved):
        assert [r["lm_loss"] for r in run if "lm_loss" in r] == pytest.approx(a, abs=2e-4)
