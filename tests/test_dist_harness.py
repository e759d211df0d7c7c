"""tests/dist_harness.py itself: a failure of its own process-group set-up is tried once more on a new port (a
port or a gloo connection lost to another test's socket is not the code's fault), a set-up that fails twice fails
the test with both tracebacks, and whatever the function under test raises fails it at once, untried."""

import os

import pytest
from dist_harness import run_distributed

from megatron_po import parallel_state as ps


def _rank():
    import torch.distributed as dist
    return dist.get_rank()


def _count_launch(marks):
    """In a forked rank: note this launch (one file per rank and launch)."""
    os.makedirs(marks, exist_ok=True)
    n = len(os.listdir(marks))
    open(os.path.join(marks, f"{n}-{os.getpid()}"), "w").close()


def test_a_set_up_that_fails_once_is_tried_again(tmp_path, monkeypatch):
    real = ps.initialize_model_parallel
    flag = tmp_path / "failed_once"

    def flaky(*args, **kwargs):
        _count_launch(str(tmp_path / "launches"))
        if not flag.exists():
            flag.touch()
            raise RuntimeError("Gloo connectFullMesh failed with ... Connection closed by peer (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(ps, "initialize_model_parallel", flaky)  # the forked ranks inherit it
    assert run_distributed(_rank, 2, timeout=60) == [0, 1]
    assert len(os.listdir(tmp_path / "launches")) >= 3  # the failing rank, then both ranks again


def test_a_set_up_that_fails_twice_fails_the_test(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no groups today (simulated)")

    monkeypatch.setattr(ps, "initialize_model_parallel", broken)
    with pytest.raises(AssertionError, match="could not be set up, twice") as failed:
        run_distributed(_rank, 2, timeout=60)
    assert str(failed.value).count("--- rank") == 2  # a failing rank's traceback from each launch


def _fail_and_count(marks):
    _count_launch(marks)
    raise ValueError("the code under test failed")


def test_what_the_function_raises_fails_at_once(tmp_path):
    with pytest.raises(AssertionError, match="a rank failed(.|\n)*the code under test failed"):
        run_distributed(_fail_and_count, 2, args=(str(tmp_path / "launches"),), timeout=60)
    assert len(os.listdir(tmp_path / "launches")) <= 2  # one launch: not tried again
