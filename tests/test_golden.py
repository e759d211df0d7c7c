"""Golden loss curves: today's numbers equal the pinned ones (tools/golden.py, tests/golden/*.json).

Every configuration of tools/golden.py is rerun (one test id each) and compared with its curve: the loss
and grad norm at every iteration (fp16: the loss scale too; emulator: every micro-batch's loss and the
loss stage's grad norm at each step). The comparison is bitwise: on one CPU thread per rank every
configuration repeats its bits exactly (`tools/golden.py update` runs each twice and refuses to write a
curve that moved in between), fp32, bf16 and fp16 alike, so no tolerance is declared. A failure names
the first iteration that moved, both values and the command that reproduces it. A change of numbers
made on purpose regenerates the curve: `python tools/golden.py update --reason "..." NAME`.

The whole set took 79.6 s wall and 26.9 s of CPU on 2 cores at load average 15-20 (tests/golden/README.md).
"""

import math
import os

import pytest

from tools import golden

NAMES = [g.name for g in golden.CONFIGS]


@pytest.fixture(scope="module")
def golden_data(tmp_path_factory):
    """The corpora of the real-data and NMT configurations (~1 s: tokenizer, .bin/.idx, NMT slice)."""
    return golden.prepare_data(str(tmp_path_factory.mktemp("golden_data")))


@pytest.mark.parametrize("name", NAMES)
def test_curve_matches_its_golden(name, tmp_path, request):
    g = golden.BY_NAME[name]
    data = request.getfixturevalue("golden_data") if g.needs_data else None
    problem, _ = golden.check(g, str(tmp_path), data)
    assert problem is None, problem


def test_every_curve_has_a_configuration_and_an_index_entry():
    files = sorted(f[:-len(".json")] for f in os.listdir(golden.GOLDEN_DIR) if f.endswith(".json"))
    assert files == sorted(NAMES)  # no orphan curve, no configuration without one
    with open(os.path.join(golden.GOLDEN_DIR, "README.md")) as f:
        index = f.read()
    for name in NAMES:
        assert f"`{name}`" in index, f"tests/golden/README.md does not list {name}"
        doc = golden.load(name)
        assert doc["history"] and doc["history"][-1]["commit"] == doc["commit"], name
        assert len(doc["loss"]) == len(doc["iteration"]) >= 10, name


def test_a_moved_value_is_reported_where_it_moved():
    g = golden.BY_NAME["fp16_loss_scaling"]
    pinned = golden.load(g.name)
    here = pinned["machine"]  # the machine the curve was made on: bitwise
    assert golden.compare(g, pinned, pinned, here) is None
    moved = {k: list(v) if isinstance(v, list) else v for k, v in pinned.items()}
    moved["grad_norm"][7] = math.nextafter(moved["grad_norm"][7], math.inf)  # one ulp at iteration 8
    moved["loss"][12] += 1.0  # later moves are not the first
    message = golden.compare(g, pinned, moved, here)
    assert "moved at iteration 8 (bitwise" in message
    assert f"golden {pinned['grad_norm'][7]!r}  now {moved['grad_norm'][7]!r}" in message
    assert "python tools/golden.py check fp16_loss_scaling" in message and golden.command(g) in message

    skipped = dict(pinned, grad_norm=[1.0] + pinned["grad_norm"][1:])  # a skipped step that was applied
    assert "moved at iteration 1 " in golden.compare(g, pinned, skipped, here)
    short = dict(pinned, loss=pinned["loss"][:15])  # a run that ended early
    assert "moved at iteration 16 " in golden.compare(g, pinned, short, here)
    assert "(none: the run ended)" in golden.compare(g, pinned, short, here)

    # Elsewhere the rounding may differ: one ulp passes, a move beyond rtol_elsewhere does not.
    elsewhere = dict(here, kernels="DEFAULT")
    assert golden.compare(g, pinned, dict(moved, loss=pinned["loss"]), elsewhere) is None
    assert "moved at iteration 13 (rtol 0.01" in golden.compare(g, pinned, moved, elsewhere)


def test_a_changed_configuration_is_reported():
    g = golden.BY_NAME["muon"]
    pinned = dict(golden.load(g.name), command=golden.command(g).replace("--lr 0.002", "--lr 0.003"))
    message = golden.compare(g, pinned, pinned)
    assert "configuration changed" in message and "update" in message


def test_the_mtp_loss_is_a_series_of_its_own():
    """A run with --mtp-num-layers logs `mtp_loss` apart from the LM loss: its curve pins it as a series of its own
    (absent from runs without MTP), and a move in it alone is reported."""
    records = [{"iteration": i, "lm_loss": 5.0 - i, "grad_norm": 1.0, "mtp_loss": 6.0 - i} for i in (1, 2, 3)]
    curve = golden._curve(records)
    assert curve["mtp_loss"] == [5.0, 4.0, 3.0] and curve["loss"] == [4.0, 3.0, 2.0] and "loss_scale" not in curve
    assert "mtp_loss" not in golden._curve([{k: v for k, v in r.items() if k != "mtp_loss"} for r in records])
    g = golden.BY_NAME["muon"]
    pinned = dict(golden.load(g.name), command=golden.command(g))
    pinned["mtp_loss"] = [2.0 * x for x in pinned["loss"]]
    moved = dict(pinned, mtp_loss=pinned["mtp_loss"][:2] + [pinned["mtp_loss"][2] + 1e-3] + pinned["mtp_loss"][3:])
    message = golden.compare(g, pinned, moved, pinned["machine"])
    assert "moved at iteration 3 (bitwise" in message and f"mtp loss:  golden {pinned['mtp_loss'][2]!r}" in message
    assert golden.compare(g, pinned, pinned, pinned["machine"]) is None
    assert golden.largest_deviation(pinned, moved) > 0
