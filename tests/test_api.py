"""The Python API's bad input (README "Python API"): the same one-line ``SinkflowError`` as the CLI, raised
before any work, never a raw KeyError or a sample taken at a step count the caller did not ask for."""

from __future__ import annotations

import shutil

import pytest
import torch

import sinkflow
from sinkflow.errors import SinkflowError


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("phase, expected", [
    ("pool", "phase 'pool' of method nsgf trains no network; its networks: velocity"),  # was a raw KeyError
    ("nsf", "method nsgf has no network phase 'nsf'; its networks: velocity"),  # NSGF++'s, not NSGF's
    ("bogus", "method nsgf has no network phase 'bogus'; its networks: velocity"),
    ("", "method nsgf has no network phase ''; its networks: velocity"),
])
def test_model_of_a_phase_that_has_no_network_names_the_networks(tiny_run, phase, expected):
    run = sinkflow.open_run(tiny_run)
    with pytest.raises(SinkflowError) as excinfo:
        run.model(phase)
    assert _one_line(excinfo) == expected
    assert "has not finished" not in expected


def test_model_of_a_real_unfinished_phase_still_says_so(tiny_run, tmp_path):
    run = sinkflow.open_run(tiny_run)
    assert isinstance(run.model("velocity"), torch.nn.Module)
    default = run.model()  # None: the method's first network
    assert all(torch.equal(a, b) for a, b in zip(default.state_dict().values(), run.model("velocity").state_dict().values()))
    copy = tmp_path / "unfinished"
    shutil.copytree(tiny_run, copy)
    (copy / "checkpoints" / "velocity" / "final.pt").unlink()
    with pytest.raises(SinkflowError, match="phase 'velocity' of .* has not finished; finish it with"):
        sinkflow.open_run(copy).model("velocity")


@pytest.mark.parametrize("steps", [0, -1, 2.0, True, "3"])
def test_sample_refuses_steps_the_cli_refuses(tiny_run, steps):
    """``steps=0`` used to sample at the default step count (``steps or default``) where `sample --steps 0`
    is an error; with ``x0`` too."""
    run = sinkflow.open_run(tiny_run)
    for x0 in (None, torch.zeros(4, 2)):
        with pytest.raises(SinkflowError, match=r"steps=.* must be a whole number >= 1; e\.g\. steps=10") as e:
            run.sample(4, steps=steps, x0=x0)
        _one_line(e)


def test_sample_takes_none_as_the_default_and_a_whole_number_as_asked(tiny_run):
    run = sinkflow.open_run(tiny_run)
    assert run.sample(4).shape == (4, 2)
    assert run.sample(4, steps=None).shape == (4, 2)
    assert run.sample(4, steps=1).shape == (4, 2)


@pytest.mark.parametrize("steps", [0, -1, 1.5, True])
def test_euler_refuses_fewer_than_one_step(steps):
    """``euler(steps=0)`` used to return its input unmoved, as if it were a sample."""
    calls = []
    with pytest.raises(SinkflowError, match="steps must be a positive integer.*; use at least one Euler step") as e:
        sinkflow.euler(lambda x, t: calls.append(1) or x, torch.ones(3, 2), 0.0, 1.0, steps=steps)
    _one_line(e)
    assert not calls  # refused before any network call


def test_euler_integrates_with_one_step_and_more():
    x = torch.ones(3, 2)
    one, _ = sinkflow.euler(lambda x, t: x, x, 0.0, 1.0, steps=1)
    two, path = sinkflow.euler(lambda x, t: x, x, 0.0, 1.0, steps=2, record=True)
    torch.testing.assert_close(one, 2 * x)
    torch.testing.assert_close(two, 2.25 * x)
    assert len(path) == 3
