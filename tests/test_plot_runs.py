"""tools/plot_runs.py: several runs' metrics files into one PNG; bad input gives one error line."""

import json

import matplotlib.image
import pytest

from tools import plot_runs


def write_metrics(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def gpt_run(path, start):
    return write_metrics(path, [{"iteration": i, "lm_loss": start - 0.1 * i, "consumed_samples": 16 * i,
                                 **({"val_loss": start - 0.1 * i + 0.05} if i % 4 == 0 else {})}
                                for i in range(1, 9)])


def test_two_runs_into_one_png(tmp_path, capsys):
    a = gpt_run(tmp_path / "1f1b" / "metrics.jsonl", 8.0)
    b = gpt_run(tmp_path / "pipeoptim" / "metrics.jsonl", 7.9)
    out = tmp_path / "plots" / "loss.png"
    assert plot_runs.main([str(a), f"PipeOptim={b}", "--out", str(out), "--title", "two runs"]) == 0
    assert "wrote" in capsys.readouterr().out
    img = matplotlib.image.imread(out)
    assert img.shape[:2] == (540, 840)  # one panel: 7 x 4.5 inches at 120 dpi
    assert img[..., :3].std() > 0.05  # something was drawn


def test_bleu_adds_a_panel_and_resumed_iterations_keep_the_last_record(tmp_path):
    nmt = write_metrics(tmp_path / "nmt" / "metrics.jsonl",
                        [{"iteration": 2, "lm_loss": 5.0}, {"iteration": 4, "lm_loss": 4.0, "val_bleu": 3.0},
                         {"iteration": 4, "lm_loss": 3.5, "val_bleu": 4.0},  # re-logged after a resume
                         {"iteration": 6, "lm_loss": 3.0, "val_loss": 3.1, "val_bleu": 6.5}])
    assert [r["lm_loss"] for r in plot_runs.read_run(str(nmt))] == [5.0, 3.5, 3.0]
    out = tmp_path / "bleu.png"
    assert plot_runs.main([str(nmt), str(gpt_run(tmp_path / "gpt" / "metrics.jsonl", 8.0)), "--out", str(out)]) == 0
    assert matplotlib.image.imread(out).shape[:2] == (540, 1440)  # loss and BLEU panels, 12 inches wide


@pytest.mark.parametrize("content, message", [
    (None, "no such metrics file"),
    ('{"iteration": 1, "lm_loss": 3.0}\nnot json\n', "line 2: not a JSON object"),
    ('{"lm_loss": 3.0}\n', "line 1: a metrics record needs an 'iteration'"),
    ('{"iteration": 1, "lr": 0.1}\n', "no loss records"),
], ids=["missing", "not-json", "no-iteration", "no-loss"])
def test_bad_metrics_file_gives_one_error_line(tmp_path, capsys, content, message):
    path = tmp_path / "metrics.jsonl"
    if content is not None:
        path.write_text(content)
    assert plot_runs.main([str(path), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "x.png").exists()
