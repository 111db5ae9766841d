"""The Python API's bad input (README "Python API"): the same one-line ``SinkflowError`` as the CLI, raised
before any work, never a raw KeyError or a sample taken at a step count the caller did not ask for."""

from __future__ import annotations

import copy
import logging
import re
import shutil

import numpy as np
import pytest
import torch

import sinkflow
from sinkflow import methods
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
    # a numpy seed is the same seed (np.int64(3) overflowed in the stream's hash, np.int32 too)
    assert torch.equal(run.sample(4, seed=np.int64(3)), run.sample(4, seed=3))
    assert torch.equal(run.sample(4, seed=np.int32(5)), run.sample(4, seed=5))
    assert not torch.equal(run.sample(4, seed=3), run.sample(4, seed=5))


@pytest.mark.parametrize("kwargs, needle", [
    ({"seed": 1.5}, r"seed=1\.5 must be a whole number; e\.g\. seed=0"),
    ({"seed": "a"}, r"seed='a' must be a whole number"), ({"seed": True}, r"seed=True must be a whole number"),
    ({"seed": -1}, r"^seed=-1 must be in \[0, 9223372036854775807\]; e\.g\. seed=0"),  # drew seed 2**63 - 1's samples
    ({"seed": 2**63}, r"^seed=9223372036854775808 must be in \[0, "),  # drew seed 0's samples
    ({"qmc": "yes"}, r"qmc='yes' must be True, False or None"),
    ({"n": 10**13}, r"^n 10000000000000 needs about .* of memory for its samples .*; use a smaller n$"),
    ({"steps": 10**9}, r"^steps=1000000000 is more than 100,000; use steps=100,000 or fewer$"),
    ({"x0": torch.tensor([[1e300, 0.0]], dtype=torch.float64), "n": None}, r"^x0 holds 1 value\(s\) beyond float32's")])
def test_sample_refuses_a_bad_seed_qmc_or_n_in_one_line(tiny_run, kwargs, needle):
    """Each was a torch or numpy error from inside the seeded draw (or an allocator's 'you tried to allocate
    80000000000000 bytes'); "yes" was taken as true."""
    with pytest.raises(SinkflowError, match=needle) as e:
        sinkflow.open_run(tiny_run).sample(**{"n": 4, **kwargs})
    _one_line(e)


@pytest.mark.parametrize("steps", [0, -1, 1.5, True])
def test_euler_refuses_fewer_than_one_step(steps):
    """``euler(steps=0)`` used to return its input unmoved, as if it were a sample."""
    calls = []
    with pytest.raises(SinkflowError, match="steps must be a positive integer.*; use at least one Euler step") as e:
        sinkflow.euler(lambda x, t: calls.append(1) or x, torch.ones(3, 2), 0.0, 1.0, steps=steps)
    _one_line(e)
    assert not calls  # refused before any network call


def test_euler_refuses_a_bad_warp_or_times_in_one_line_and_builds_no_step_list():
    """warp=0 was a plain ValueError, a t0 of the wrong length torch's broadcasting error, and the grid of every step
    was built before the first (10^9 steps filled 23 GB before any network call)."""
    x = torch.ones(3, 2)
    for kwargs, needle in (({"warp": 0.0}, r"time warp must be > 0, got 0\.0; e\.g\. sample\.time_warp=1"),
                           ({"t0": torch.zeros(5)}, r"t0 has shape \(5,\) but x holds 3 samples; pass t0 as a number")):
        with pytest.raises(SinkflowError, match=needle) as e:
            sinkflow.euler(lambda x, t: x, x, **{"t0": 0.0, "t1": 1.0, "steps": 2, **kwargs})
        _one_line(e)
    calls = []

    def stop_at_once(x, t):
        calls.append(1)
        raise KeyboardInterrupt  # the first step runs before the grid of the next 10^9 exists

    with pytest.raises(KeyboardInterrupt):
        sinkflow.euler(stop_at_once, x, 0.0, 1.0, steps=10**9)
    assert calls == [1]


def test_schema_caps_every_euler_step_count():
    """`sample sample.steps=1000000000` and `train --resume RUN 'eval.steps=[1000000000]'` passed the command's
    --steps cap and ran out of memory; the keys share it."""
    from sinkflow import config

    for key in ("sample.steps=1000000000", "eval.steps=[10,1000000000]", "sample.nsf_steps=1000000000"):
        with pytest.raises(SinkflowError, match=r"in \[1, 100000\]"):
            config.resolve("moons" if "nsf" not in key else "digits", [key], {"method": "nsgfpp"} if "nsf" in key else {})


def test_euler_integrates_with_one_step_and_more():
    x = torch.ones(3, 2)
    one, _ = sinkflow.euler(lambda x, t: x, x, 0.0, 1.0, steps=1)
    two, path = sinkflow.euler(lambda x, t: x, x, 0.0, 1.0, steps=2, record=True)
    torch.testing.assert_close(one, 2 * x)
    torch.testing.assert_close(two, 2.25 * x)
    assert len(path) == 3


# ---- Run.sample(x0=...): any floating tensor or numpy array of the run's shape, else one line naming it ----------

@pytest.fixture(scope="module")
def otcfm_run(tmp_path_factory):
    """A finished tiny moons OT-CFM run: its sampler is ``euler`` on the velocity network alone, as FM's."""
    from helpers import tiny_2d, train_in

    runs = train_in(tmp_path_factory.mktemp("otcfm"),
                    ["moons", *tiny_2d("otcfm"), "--method", "otcfm", "--name", "otcfm", "--no-report"])
    return runs / "otcfm"


@pytest.fixture(params=["nsgf", "otcfm"])
def any_run(request):
    return sinkflow.open_run(request.getfixturevalue("tiny_run" if request.param == "nsgf" else "otcfm_run"))


X0 = torch.randn(5, 2, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("convert, same_as", [
    (lambda x: x.double(), lambda x: x),  # was "mat1 and mat2 must have the same dtype" (NSGF, FM, OT-CFM)
    (lambda x: x.half(), lambda x: x.half().float()),
    (lambda x: x.numpy(), lambda x: x),  # was "'numpy.ndarray' object has no attribute 'to'"
    (lambda x: x.double().numpy(), lambda x: x),
    (lambda x: x.numpy()[::-1], lambda x: x.flip(0)),  # negative strides: torch.from_numpy alone refuses them
], ids=["float64", "half", "numpy", "numpy-float64", "numpy-reversed"])
def test_sample_takes_x0_of_any_float_dtype_or_a_numpy_array(any_run, convert, same_as):
    out = any_run.sample(5, steps=2, x0=convert(X0))
    assert out.dtype == torch.float32 and out.shape == (5, 2)
    torch.testing.assert_close(out, any_run.sample(5, steps=2, x0=same_as(X0)))


def test_sample_with_x0_alone_draws_one_sample_per_row(tiny_run):
    """``n`` may be left out when ``x0`` is given (it is ``len(x0)``); an x0 that requires grad or is a
    non-contiguous view is fine."""
    run = sinkflow.open_run(tiny_run)
    view = X0.t().contiguous().t().requires_grad_()  # same values, transposed strides
    assert not view.is_contiguous()
    torch.testing.assert_close(run.sample(x0=view, steps=2), run.sample(5, steps=2, x0=X0))
    with pytest.raises(SinkflowError, match=r"^sample\(\) needs n or x0; e\.g\. run\.sample\(1024\)") as e:
        run.sample()
    _one_line(e)



def test_sample_with_x0_runs_in_chunks_of_the_sample_batch_size(tiny_run, monkeypatch):
    """A large x0 went to the device as one batch (the seeded draw is chunked by sample.batch_size): now both are,
    and the chunks give the samples one batch gives."""
    from sinkflow import methods

    run = sinkflow.open_run(tiny_run)
    x0 = torch.randn(7, 2, generator=torch.Generator().manual_seed(3))
    whole = run.sample(x0=x0, steps=2)
    sizes, real = [], methods.of(run.cfg).sample
    monkeypatch.setattr(type(methods.of(run.cfg)), "sample",
                        lambda self, r, x, steps=None, record=False: (sizes.append(len(x)), real(r, x, steps, record))[1])
    monkeypatch.setitem(run.cfg["sample"], "batch_size", 3)
    torch.testing.assert_close(run.sample(x0=x0, steps=2), whole)
    assert sizes == [3, 3, 1]

@pytest.mark.parametrize("n, x0, expected", [
    (3, torch.zeros(3, 5), r"x0 has shape \(3, 5\) but this run samples from \(3, 2\); pass x0 shaped \(3, 2\)"),
    (None, torch.zeros(3), r"x0 has shape \(3,\) but this run samples from \(n, 2\); pass x0 shaped \(n, 2\)"),
    (None, torch.zeros(3, 2, 1), r"x0 has shape \(3, 2, 1\) but this run samples from \(n, 2\)"),
    (5, torch.zeros(2, 2), r"sample\(n=5\) but x0 holds 2 samples; pass x0 shaped \(5, 2\), or leave n out"),
    (None, torch.zeros(0, 2), r"x0 holds no samples; pass x0 shaped \(n, 2\) with at least one row"),
    (3, torch.zeros(3, 2, dtype=torch.long), r"x0 has non-floating dtype torch.int64; convert x0 to float"),
    (3, np.zeros((3, 2), np.int32), r"x0 has non-floating dtype int32; convert x0 to a float array"),
    (3, [[0.0, 0.0]] * 3, r"x0 must be a torch.Tensor or a numpy array, got list"),
    (2, torch.tensor([[0.0, float("nan")], [0.0, float("inf")]]), r"x0 holds 2 NaN or infinite value\(s\)"),
], ids=["features", "1d", "extra-dim", "n-vs-rows", "empty", "long", "numpy-int", "list", "nan"])
def test_sample_refuses_a_bad_x0_in_one_line_before_any_network_runs(tiny_run, monkeypatch, n, x0, expected):
    """These were raw reshape / matmul / dtype errors from inside the network, and ``sample(5, x0=<2 rows>)``
    silently returned 2 samples."""
    run = sinkflow.open_run(tiny_run)
    monkeypatch.setattr(type(methods.of(run.cfg)), "sample", lambda *a, **k: pytest.fail("the sampler ran"))
    with pytest.raises(SinkflowError, match=expected) as e:
        run.sample(n, x0=x0)
    _one_line(e)


# ---- the parts: float64 / half / numpy / requires_grad batches, as sinkhorn_velocity and w2 take them -----------

class _Net(torch.nn.Module):
    """A velocity network of the usual float32 kind: a plain lambda would take any dtype."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        torch.nn.init.eye_(self.lin.weight)
        torch.nn.init.constant_(self.lin.bias, 0.5)

    def forward(self, x, t):
        return self.lin(x) * t.view(-1, 1)


@pytest.mark.parametrize("convert, same_as", [
    (lambda x: x.double(), lambda x: x),  # was "mat1 and mat2 must have the same dtype"
    (lambda x: x.half(), lambda x: x.half().float()),
    (lambda x: x.numpy(), lambda x: x),  # was "'numpy.ndarray' object has no attribute 'device'"
], ids=["float64", "half", "numpy"])
def test_euler_casts_the_state_to_the_networks_dtype(convert, same_as):
    net = _Net()
    x, _ = sinkflow.euler(net, convert(X0), 0.0, 1.0, steps=3)
    assert x.dtype == torch.float32
    torch.testing.assert_close(x, sinkflow.euler(net, same_as(X0), 0.0, 1.0, steps=3)[0])


def test_euler_integrates_a_float64_network_in_float64():
    net = _Net().double()
    x, _ = sinkflow.euler(net, X0, 0.0, 1.0, steps=3)  # a float32 batch was a raw dtype error
    assert x.dtype == torch.float64
    torch.testing.assert_close(x, sinkflow.euler(net, X0.double(), 0.0, 1.0, steps=3)[0])


class _TimedNet(torch.nn.Module):
    """A network that embeds t through a layer, as the UNets and MLPs do: its dtype must match the weights'."""

    def __init__(self):
        super().__init__()
        self.lin, self.time = torch.nn.Linear(2, 2), torch.nn.Linear(1, 2)

    def forward(self, x, t):
        return self.lin(x) + self.time(t.view(-1, 1))


def test_a_float64_network_gets_float64_times_from_euler_and_the_velocity_loss():
    """euler built t in float32 and velocity_loss passed the batch's float32 t: "mat1 and mat2 must have the same
    dtype" from the float64 network's time layer."""
    net = _TimedNet().double()
    x, _ = sinkflow.euler(net, X0, 0.0, 1.0, steps=3)
    assert x.dtype == torch.float64
    batch = (X0, torch.linspace(0.1, 0.9, 5), X0 + 1)
    loss = sinkflow.velocity_loss(net, batch)
    torch.testing.assert_close(loss, sinkflow.velocity_loss(copy.deepcopy(net).float(), batch))


@pytest.mark.parametrize("call", [lambda net: sinkflow.euler(net, X0, 0.0, 1.0, steps=2),
                                  lambda net: sinkflow.velocity_loss(net, (X0, torch.full((5,), 0.5), X0))],
                         ids=["euler", "velocity_loss"])
def test_a_batch_on_another_device_than_the_network_is_one_line(call):
    """torch's own error ("Expected all tensors to be on the same device") names neither the argument nor the fix.
    A network on the meta device stands for a GPU one here: the check reads devices, it runs nothing."""
    with pytest.raises(SinkflowError, match=r"is on cpu but the network is on meta; move it there first") as e:
        call(_TimedNet().to("meta"))
    _one_line(e)


@pytest.mark.parametrize("method", ["FM", "OTCFM"])
@pytest.mark.parametrize("convert", [lambda x: x.double(), lambda x: x.numpy()], ids=["float64", "numpy"])
def test_flow_matching_loss_takes_float64_and_numpy_batches(method, convert):
    fm, net = getattr(sinkflow, method), _Net()
    x0, x1, t = X0, X0.flip(0) + 2, torch.linspace(0.1, 0.9, 5)
    loss = fm.loss(net, convert(x0), convert(x1), t=t)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, fm.loss(net, x0, x1, t=t))


def test_ot_cfm_loss_keeps_the_gradient_of_a_source_that_requires_grad():
    """The exact plan read the batch with ``.numpy()``: "Can't call numpy() on Tensor that requires grad"."""
    x0 = X0.clone().requires_grad_()
    sinkflow.OTCFM.loss(_Net(), x0, X0 + 2, t=torch.full((5,), 0.5)).backward()
    assert x0.grad is not None and x0.grad.abs().sum() > 0


@pytest.mark.parametrize("t", [0.25, np.float64(0.25), np.float32(0.25), 1], ids=["float", "np.float64",
                                                                                   "np.float32", "int"])
def test_straight_path_takes_one_time_for_the_whole_batch(t):
    """A Python or numpy number was "'float' object has no attribute 'view'"."""
    xt, ut = sinkflow.straight_path(X0, X0 + 1, t)
    want_xt, want_ut = sinkflow.straight_path(X0, X0 + 1, torch.full((5,), float(t)))
    torch.testing.assert_close(xt, want_xt)
    torch.testing.assert_close(ut, want_ut)


@pytest.mark.parametrize("convert", [lambda x: x.numpy(), lambda x: x.clone().requires_grad_(),
                                     lambda x: x.double().numpy()], ids=["numpy", "requires-grad", "numpy-float64"])
def test_ot_permutation_takes_numpy_and_requires_grad_batches(convert):
    y = X0.flip(0) + 0.1
    perm = sinkflow.ot_permutation(convert(X0), convert(y))
    assert perm.dtype == torch.int64 and perm.device.type == "cpu"
    assert torch.equal(perm, sinkflow.ot_permutation(X0, y))


@pytest.mark.parametrize("x0, x1, expected", [
    (X0[:, 0], X0[:, 1], r"pairs batches shaped \(N, \*\) of one sample shape; got \(5,\) and \(5,\); add a feature"),
    (X0, torch.zeros(5, 3), r"pairs batches shaped \(N, \*\) of one sample shape; got \(5, 2\) and \(5, 3\)"),
    (X0.long(), X0, "x0 has non-floating dtype torch.int64; convert x0 to float"),
    (X0.tolist(), X0, "x0 must be a torch.Tensor or a numpy array, got list"),
], ids=["1d", "shapes", "long", "list"])
def test_ot_permutation_refuses_what_it_cannot_pair_in_one_line(x0, x1, expected):
    with pytest.raises(SinkflowError, match=expected) as e:
        sinkflow.ot_permutation(x0, x1)
    _one_line(e)


def test_sinkhorn_velocity_takes_numpy_clouds_as_w2_does():
    """It refused numpy clouds ("must be a torch.Tensor") where ``w2`` and now every other part takes them."""
    y = X0.flip(0) + 1
    v = sinkflow.sinkhorn_velocity(X0.double().numpy(), y.numpy(), blur=0.5)
    torch.testing.assert_close(v, sinkflow.sinkhorn_velocity(X0, y, blur=0.5))


# ---- numpy scalars: numbers.Integral / numbers.Real everywhere (one rule: sinkflow.config.checks) --------------

def _flow():
    return sinkflow.build_flow({"levels": 1, "depth_per_level": 1, "hidden_channels": 4}, (2,))


Y0 = X0.flip(0) + 1
NUMPY_SCALARS = {  # each was refused: "must be a positive int, got np.int64(2)", "positive number, got np.float32"
    "Run.sample-n": lambda run: run.sample(np.int64(2), steps=np.int64(1)),
    "Distribution.sample": lambda run: sinkflow.build_distribution("moons").sample(np.int64(2), torch.Generator()),
    "sinkhorn_velocity-blur": lambda run: sinkflow.sinkhorn_velocity(X0, Y0, blur=np.float32(0.5)),
    "sinkhorn_velocity-scaling-diameter": lambda run: sinkflow.sinkhorn_velocity(
        X0, Y0, blur=0.5, scaling=np.float32(0.8), diameter=np.float64(10.0)),
    "simulate-steps-eta": lambda run: sinkflow.simulate_sinkhorn_flow(
        X0, Y0, steps=np.int64(2), eta=np.float32(0.5), blur=np.float64(0.5))[0],
    "simulate-eta_growth": lambda run: sinkflow.simulate_sinkhorn_flow(
        X0, Y0, steps=2, eta=0.5, blur=0.5, eta_growth=np.float32(4.0))[0],
}


@pytest.mark.parametrize("call", NUMPY_SCALARS.values(), ids=NUMPY_SCALARS.keys())
def test_numpy_scalars_are_taken_as_the_numbers_they_are(tiny_run, call):
    out = call(sinkflow.open_run(tiny_run))
    assert isinstance(out, torch.Tensor) and out.shape[-1] == 2 and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("call, expected", [
    (lambda: sinkflow.sinkhorn_velocity(X0, Y0, blur=True), "Sinkhorn blur must be a positive number, got True"),
    (lambda: sinkflow.simulate_sinkhorn_flow(X0, Y0, steps=True, eta=0.5, blur=0.5),
     "steps must be a positive integer, got True"),
    (lambda: sinkflow.simulate_sinkhorn_flow(X0, Y0, steps=torch.ones(2, 2), eta=0.5, blur=0.5),
     r"steps must be a positive integer, got a Tensor of shape \(2, 2\); use at least one Euler step"),
    (lambda: sinkflow.build_distribution("moons").sample(torch.ones(2, 2), torch.Generator()),
     r"sample size must be a positive int, got a Tensor of shape \(2, 2\); pass n >= 1"),
], ids=["blur-bool", "steps-bool", "steps-tensor", "n-tensor"])
def test_bools_and_tensors_are_refused_in_one_line(call, expected):
    """True is not a count nor a blur (``blur=True`` was taken as 1), and a tensor's repr spans lines."""
    with pytest.raises(SinkflowError, match=expected) as e:
        call()
    _one_line(e)


# ---- FlowModel.sample(n < 1): the samplers' one line, not "cannot reshape tensor of 0 elements" ----------------

def test_flow_model_sample_refuses_fewer_than_one_sample_as_every_sampler_does():
    flow = _flow()
    for n in (0, -1, 2.0, np.int64(0)):
        with pytest.raises(SinkflowError, match=r"^sample size must be a positive int, got .*; pass n >= 1$") as e:
            flow.sample(n)
        _one_line(e)
    assert flow.sample(np.int32(2)).shape == (2, 2)  # the check takes a numpy count, as the other samplers
    for temperature in (float("nan"), -0.5, "0.7"):
        with pytest.raises(SinkflowError, match=r"^temperature must be a number >= 0") as e:
            flow.sample(2, temperature)
        _one_line(e)
    assert flow.sample(2, np.float32(0.7)).shape == (2, 2)


def test_train_takes_paths_and_numpy_numbers_as_dotted_overrides(runs_dir, tmp_path, monkeypatch):
    """`sinkflow.train(**{"data.target": Path(...), "data.test_rows": np.int64(50)})` was a yaml RepresenterError
    traceback, not a config; anything a config cannot hold is one line naming the key."""
    import pathlib

    from sinkflow.engine import experiment

    np.save(tmp_path / "p.npy", np.random.default_rng(0).normal(size=(300, 2)).astype(np.float32))
    seen = {}
    monkeypatch.setattr(experiment, "train_run", lambda cfg, **kw: seen.setdefault("cfg", cfg) and 1 / 0)
    with pytest.raises(ZeroDivisionError):  # resolved: the engine was reached with the config
        sinkflow.train("moons", method="fm", device="cpu", runs_dir=runs_dir, **{
            "data.target": pathlib.Path(tmp_path / "p.npy"), "data.test_rows": np.int64(50), "eval.n": np.int32(50),
            "eval.steps": (np.int64(2), 4), "train.velocity.lr": np.float32(0.5)}, train_iters=np.int64(7),
            batch_size=torch.tensor(16))  # shorthands too: "expects int ... but got int64"
    cfg = seen["cfg"]
    assert (cfg["train"]["velocity"]["iters"], cfg["train"]["velocity"]["batch_size"]) == (7, 16)
    assert (cfg["data"]["target"], cfg["data"]["test_rows"], cfg["eval"]["n"]) == (str(tmp_path / "p.npy"), 50, 50)
    assert cfg["eval"]["steps"] == [2, 4] and cfg["train"]["velocity"]["lr"] == 0.5
    with pytest.raises(SinkflowError, match=r"override pool.eta is of type object, which a config cannot hold; pass a") as e:
        sinkflow.train("moons", runs_dir=runs_dir, **{"pool.eta": object()})
    _one_line(e)


def test_train_and_resume_take_a_torch_device(runs_dir, tiny_run, monkeypatch):
    """`device=torch.device("cpu")`, as a PyTorch user passes it, was refused: "--device cpu: config key
    'experiment.device' expects str (default 'auto') but got device device(type='cpu')"."""
    from sinkflow.engine import experiment

    seen = []
    monkeypatch.setattr(experiment, "train_run", lambda cfg=None, **kw: seen.append((cfg, kw)) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        sinkflow.train("moons", device=torch.device("cpu"), runs_dir=runs_dir, train_iters=2)
    with pytest.raises(ZeroDivisionError):
        sinkflow.resume(tiny_run, device=torch.device("cpu"))
    (cfg, kw), (_, resumed) = seen
    assert cfg["experiment"]["device"] == kw["device"] == "cpu" and "device='cpu'" in kw["call"]
    assert resumed["device"] == "cpu" and resumed["shorthands"]["device"] == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the run's device must be one this machine lacks")
def test_a_run_trained_on_cuda_samples_on_a_machine_without_it(tiny_run, tmp_path, capsys):
    """A run trained with device="cuda" (a Colab GPU), opened on a laptop: "experiment.device=cuda but CUDA is not
    available here; use --device cpu", which neither open_run nor `sinkflow sample` / `eval` took (the way round,
    `train --resume --device cpu`, rewrote config.yaml and needs the data, which sampling does not)."""
    import shutil

    from helpers import run_main

    folder = shutil.copytree(tiny_run, tmp_path / "cuda-run")
    config = (folder / "config.yaml").read_text()
    (folder / "config.yaml").write_text(re.sub(r"(?m)^(  device: ).*$", r"\1cuda", config))
    with pytest.raises(SinkflowError, match="experiment.device=cuda but CUDA is not available here; use --device cpu"):
        sinkflow.open_run(folder)
    for device in ("cpu", torch.device("cpu")):
        assert sinkflow.open_run(folder, device=device).sample(4, steps=2).shape == (4, 2)
    assert run_main(capsys, "sample", str(folder), "--n", "4", "--out", str(tmp_path / "s.npy"), "--device", "cpu")[0] == 0
    assert np.load(tmp_path / "s.npy").shape == (4, 2)
    assert run_main(capsys, "eval", str(folder), "--n", "16", "--seeds", "1", "--device", "cpu")[0] == 0
    assert "device: cuda" in (folder / "config.yaml").read_text()  # for this call only


@pytest.mark.parametrize("kwargs, needle", [({"seeds": 0}, r"seeds=0 must be a whole number >= 1"),  # the default
                                            ({"seeds": 2.5}, r"seeds=2.5 must be a whole number"),  # a TypeError
                                            ({"n": -3}, r"n=-3 must be a whole number"),
                                            ({"n": 10**9}, r"n 1000000000 needs about .* use a smaller n")])
def test_evaluate_checks_its_counts_as_the_command_does(otcfm_run, kwargs, needle):
    """`sinkflow eval --seeds 0` is refused; Run.evaluate(seeds=0) used the default in silence, n=10**7 ground for
    10 minutes to 7.7 GB (the command says at once it cannot fit)."""
    with pytest.raises(SinkflowError, match=needle):
        sinkflow.open_run(otcfm_run).evaluate(**kwargs)


def test_scores_are_the_latest_evaluations_numbers(otcfm_run, tmp_path):
    """Run.evaluate() returns the printed table; a notebook wants numbers: Run.scores() is the last eval record."""
    import shutil

    run = sinkflow.open_run(shutil.copytree(otcfm_run, tmp_path / "r"))
    assert run.scores() == {}  # trained with --no-report: nothing evaluated yet
    table = run.evaluate(seeds=2, n=64)
    got = run.scores()
    steps = run.cfg["eval"]["steps"]
    assert got["n"] == 64 and got["seeds"] == 2 and all(f"w2_{s}" in got and f"w2_std_{s}" in got for s in steps)
    assert f"{got[f'w2_{steps[0]}']:.3f}" in table  # the same numbers the table prints
    run.evaluate(seeds=2, n=32)
    assert run.scores()["n"] == 32  # the latest one


def test_evaluate_ends_its_tensorboard_writer_and_scores_a_folder_it_cannot_write(otcfm_run, tmp_path, caplog):
    """Each Run.evaluate() left TensorBoard's writer thread running, its events unflushed until the notebook's kernel
    exited; on a read-only run folder (a Kaggle input) it raised PermissionError after the whole evaluation, where
    `sinkflow eval` prints the scores and says the record was skipped."""
    import shutil
    import threading

    from helpers import read_only

    def writers():  # TensorBoard's event-writer threads alive
        return {t for t in threading.enumerate() if type(t).__name__ == "_AsyncWriterThread"}

    folder = shutil.copytree(otcfm_run, tmp_path / "r")
    before = writers()
    for _ in range(2):
        assert "W2" in sinkflow.open_run(folder).evaluate(seeds=1, n=16)
    assert writers() <= before
    assert len(sinkflow.open_run(folder).scores()) > 0
    undo = read_only(folder, recursive=True)
    if undo is None:
        pytest.skip("cannot make a folder read-only here")
    try:
        with caplog.at_level(logging.WARNING, logger="sinkflow"):
            assert "W2" in sinkflow.open_run(folder).evaluate(seeds=1, n=16)
    finally:
        undo()
    (said,) = [r.getMessage() for r in caplog.records if "could not record" in r.getMessage()]
    assert said.startswith(f"could not record the scores in {folder.resolve() / 'metrics.jsonl'} (")


def test_a_notebook_default_dtype_of_float64_trains_and_samples_in_float32_and_is_kept(tiny_run, runs_dir):
    """Under torch.set_default_dtype(torch.float64) the networks were trained in float64 (a float32 session refused
    their final.pt), and a float32 run could not be sampled: its final.pt "is not what this run expects; delete it"."""
    torch.set_default_dtype(torch.float64)
    try:
        run = sinkflow.open_run(tiny_run)
        assert run.sample(4, steps=2).dtype == torch.float32
        assert next(run.model().parameters()).dtype == torch.float32
        trained = sinkflow.train("moons", method="otcfm", device="cpu", runs_dir=runs_dir, name="f64", train_iters=2)
        assert torch.get_default_dtype() == torch.float64  # the caller's, after every call
    finally:
        torch.set_default_dtype(torch.float32)
    state = torch.load(trained.dir / "checkpoints" / "velocity" / "final.pt", weights_only=True)
    assert {t.dtype for t in state["model"].values()} == {torch.float32}
    assert sinkflow.open_run(trained.dir).sample(4, steps=2).shape == (4, 2)  # in a float32 session


@pytest.mark.parametrize("mode", [lambda: torch.no_grad(), lambda: torch.inference_mode()], ids=["no_grad", "inference"])
def test_training_from_a_notebook_with_autograd_off_trains(runs_dir, mode):
    """A notebook's torch.set_grad_enabled(False) left training to fail at its first backward, after the run folder
    was made; the caller's mode is its own again after the call."""
    with mode():
        run = sinkflow.train("moons", method="otcfm", device="cpu", runs_dir=runs_dir, name="nograd", train_iters=2)
        assert not torch.is_grad_enabled()
    assert sinkflow.open_run(run.dir).sample(2, steps=2).shape == (2, 2)


@pytest.mark.parametrize("call, needle", [
    (lambda: sinkflow.train(5), "preset=5 is int, not a path or name"),
    (lambda: sinkflow.open_run(5), "path=5 is int, not a path or name"),
    (lambda: sinkflow.open_run(None), "path=None is NoneType, not a path or name"),
    (lambda: sinkflow.resume(5), "path=5 is int"),
    (lambda: sinkflow.build_flow({}, 64), "build_flow's sample_shape is 64, not a tuple of sizes"),
    (lambda: sinkflow.build_flow(None, (1, 8, 8)), "build_flow's config is NoneType, not a dict"),
    # points have nothing to squeeze: the fix named squeeze=true, which was set (and is ignored for vectors)
    (lambda: sinkflow.build_flow({"levels": 2, "squeeze": True}, (2,)), "coupling needs >= 2; use 1 level\\(s\\)$")])
def test_the_api_refuses_arguments_of_the_wrong_type_in_one_line(call, needle):
    """Each was a raw AttributeError / TypeError from inside (os.fspath, the preset lookup, a shape unpacking)."""
    with pytest.raises(SinkflowError, match=needle) as e:
        call()
    _one_line(e)


def test_build_flow_takes_numpy_integers_as_the_api_does():
    """``levels=np.int64(1)`` was refused ("expects int ... but got int64") where sinkflow.train takes numpy numbers."""
    model = sinkflow.build_flow({"levels": np.int64(1), "depth_per_level": np.int32(1), "hidden_channels": 8},
                                (np.int64(2),))
    assert model.log_prob(torch.zeros(3, 2)).shape == (3,)


def test_a_run_survives_a_chdir_and_leaves_the_callers_rng_as_it_was(otcfm_run, tmp_path, monkeypatch):
    """A notebook: `open_run("runs/x")` then `os.chdir(...)` gave "phase 'velocity' has not finished" from every call
    (the folder was kept relative); evaluate (and train) reseeded the caller's global RNG streams."""
    import random

    monkeypatch.chdir(otcfm_run.parent)
    run = sinkflow.open_run(otcfm_run.name)
    monkeypatch.chdir(tmp_path)
    assert run.dir == otcfm_run.resolve() and run.sample(4, steps=2).shape == (4, 2)

    def draws():
        return torch.rand(3), np.random.rand(3), random.random()

    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    ref = draws()
    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    run.evaluate(seeds=1, n=16)
    got = draws()
    assert torch.equal(got[0], ref[0]) and np.array_equal(got[1], ref[1]) and got[2] == ref[2]


def test_build_distribution_takes_a_path(tmp_path):
    from pathlib import Path

    np.save(tmp_path / "pts.npy", np.random.default_rng(0).normal(size=(64, 2)).astype(np.float32))
    assert sinkflow.build_distribution(Path(tmp_path / "pts.npy")).shape == (2,)  # "must be a name or a .npy path"


def test_run_sample_takes_sampling_settings_for_one_call(tiny_run, tmp_path, capsys):
    """A flow's temperature (or any sample.* key) from Python meant run.model().sample() and the decoding by hand:
    Run.sample(settings=...) samples as `sinkflow sample RUN sample.key=value` does, the run's config unchanged,
    and refuses what the command refuses."""
    import numpy as np

    import sinkflow
    from sinkflow.cli import main

    run = sinkflow.open_run(tiny_run)
    before = (tiny_run / "config.yaml").read_bytes()
    warped = run.sample(16, steps=4, seed=1, settings={"time_warp": 0.5})
    assert main(["sample", str(tiny_run), "--n", "16", "--steps", "4", "--seed", "1", "sample.time_warp=0.5",
                 "--out", str(tmp_path / "s.npy")]) == 0
    assert torch.equal(warped, torch.from_numpy(np.load(tmp_path / "s.npy")))
    assert not torch.equal(warped, run.sample(16, steps=4, seed=1))
    assert (tiny_run / "config.yaml").read_bytes() == before and run.cfg["sample"]["time_warp"] != 0.5
    with pytest.raises(SinkflowError, match=r"unknown config key 'sample.time_wrap'; did you mean 'sample.time_warp'"):
        run.sample(4, settings={"time_wrap": 0.5})
    with pytest.raises(SinkflowError, match=r"'sample.temperature' is not read by method"):
        run.sample(4, settings={"temperature": 0.7})


def test_scores_of_an_evaluation_by_an_older_version_keep_a_flows_bits_per_dim(tmp_path):
    """An older `sinkflow eval` of a flow wrote val_bpd, test_bpd and the sample scores in three records at step 0:
    scores() returned the last alone. Records of one evaluation (one step, keys apart) are one dict; two evaluations
    (the same keys) stay two, and a new evaluation (its own step) is read alone."""
    import json
    from types import SimpleNamespace

    from sinkflow.api import Run

    rows = [{"phase": "eval", "step": 0, "time": 1.0, "val_bpd": 2.1},
            {"phase": "eval", "step": 0, "time": 2.0, "test_bpd": 2.2, "test_bpd_std": 0.01},
            {"phase": "eval", "step": 0, "time": 3.0, "fd_cnn_1": 17.0, "n": 128}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = Run(SimpleNamespace(dir=tmp_path))  # scores() reads metrics.jsonl alone
    assert run.scores() == {"val_bpd": 2.1, "test_bpd": 2.2, "test_bpd_std": 0.01, "fd_cnn_1": 17.0, "n": 128}
    with open(tmp_path / "metrics.jsonl", "a") as f:  # a second old evaluation: its own keys again
        f.write(json.dumps({"phase": "eval", "step": 0, "time": 4.0, "fd_cnn_1": 16.0, "n": 128}) + "\n")
    assert run.scores() == {"fd_cnn_1": 16.0, "n": 128}
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"phase": "eval", "step": 5, "time": 5.0, "test_bpd": 2.0}) + "\n")
    assert run.scores() == {"test_bpd": 2.0}


def test_time_loss_refuses_a_predictor_that_returns_a_column():
    """A predictor of one's own returning (N, 1) broadcast against t (N,) to an (N, N) table: the loss was
    mean_ij (t_phi(x_i) - t_j)^2, minimised by the batch's mean time for every sample, without a word."""
    x, t = torch.randn(8, 2), torch.rand(8)
    column = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.Sigmoid())
    with pytest.raises(SinkflowError) as excinfo:
        sinkflow.time_loss(column, (x, t))
    assert _one_line(excinfo) == ("the time predictor returned shape (8, 1) for 8 samples, not (8,); return one time "
                                  "per sample, e.g. model(x).squeeze(-1)")
    exact = lambda x: t  # noqa: E731  the true time: zero loss
    assert sinkflow.time_loss(exact, (x, t)).item() == 0.0


def test_velocity_loss_refuses_a_velocity_not_shaped_like_the_target():
    """1-D points (N, 1) and a network returning (N,): the squared error broadcast to an (N, N) table, silently."""
    x0, x1 = torch.randn(6, 1), torch.randn(6, 1) + 2
    flat = lambda x, t: (x1 - x0)[:, 0]  # noqa: E731
    with pytest.raises(SinkflowError) as excinfo:
        sinkflow.FM.loss(flat, x0, x1)
    assert _one_line(excinfo) == ("the velocity network returned shape (6,) for a batch shaped (6, 1), not the "
                                  "target's (6, 1); return one velocity per sample, shaped like x")
    assert sinkflow.FM.loss(lambda x, t: x1 - x0, x0, x1).item() == 0.0  # the true conditional velocity


@pytest.mark.parametrize("call", ["resume", "open_run"])
def test_an_empty_run_path_is_named_empty_not_read_as_the_working_folder(call, tmp_path, monkeypatch):
    """`sinkflow.resume(os.environ.get("RUN", ""))` said "`.` is not a sinkflow run folder": "" is the working folder
    to a path, which the user never named."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SinkflowError, match=r"^path is empty \(an unset variable\?\); pass path, e.g. 'runs/NAME'"):
        getattr(sinkflow, call)("")


def test_a_second_run_in_one_process_trains_on_the_images_the_folder_holds_now(runs_dir, tmp_path):
    """A notebook that added images to its folder between two sinkflow.train calls trained the second run on the
    first run's images (this process's cached arrays) and recorded their hashes as its data: a new process then
    refused its eval and resume as "its data changed"."""
    import json

    from PIL import Image
    from test_data import make_folder

    folder = make_folder(tmp_path / "imgs", n=12, size=(8, 8))
    tiny = {"data.root": str(tmp_path / "data"), "data.path": str(folder), "data.image_size": 8,
            "model.velocity.channels": 8, "model.velocity.res_blocks": 1, "eval.n": 2, "eval.seeds": 1}
    methods._distributions.cache_clear()
    try:
        first = sinkflow.train("folder", method="fm", device="cpu", runs_dir=runs_dir, name="a", train_iters=1,
                               batch_size=2, **tiny)
        held = methods._distributions.cache_info().currsize
        for i in range(10):
            Image.fromarray(np.full((8, 8, 3), 10 * i, np.uint8)).save(folder / f"new{i}.png")
        second = sinkflow.train("folder", method="fm", device="cpu", runs_dir=runs_dir, name="b", train_iters=1,
                                batch_size=2, **tiny)
        # the first run's arrays dropped, not kept beside the second's (a key per call kept up to 8 data sets)
        assert methods._distributions.cache_info().currsize == held
    finally:
        methods._distributions.cache_clear()
    counts = [json.loads((run.dir / "data_split.json").read_text())["n_train"] for run in (first, second)]
    assert counts == [12, 21]  # 13, then 23 images, every tenth held out


@pytest.mark.parametrize("call", [lambda run: run.sample(4, steps=2), lambda run: run.model(),
                                  lambda run: run.sample(x0=np.zeros((3, 2)), steps=2),
                                  lambda run: run.sample(4, steps=2, settings={"time_warp": 0.5})],
                         ids=["sample", "model", "x0", "settings"])
def test_sampling_a_reopened_run_leaves_the_callers_rng_as_it_was(tiny_run, call):
    """The first Run.sample or Run.model of an open_run built its networks from the caller's torch stream (their init,
    replaced by the saved weights): a notebook's `torch.manual_seed(0); run.sample(...); torch.randn(3)` drew other
    numbers than without the sample. Its samples are seeded by ``seed`` alone, as before."""
    import random

    def draws():
        return torch.randn(3), np.random.rand(), random.random()

    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    expected = draws()
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    call(sinkflow.open_run(tiny_run))
    got = draws()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


@pytest.mark.parametrize("convert", [lambda p: p, torch.from_numpy, lambda p: p.tolist()],
                         ids=["numpy", "torch", "list"])
@pytest.mark.parametrize("key", ["data.target", "data.source"])
def test_points_given_as_the_data_are_refused_with_how_to_pass_them(runs_dir, convert, key):
    """A notebook's own points passed as data.target: an array was "a config cannot hold ...; pass ... a list of
    them", and the list of rows then became a spec named by its text, an OSError "File name too long" quoting every
    number; build_distribution(points) put the array's whole repr, many lines, in its message."""
    points = convert(np.random.default_rng(0).normal(size=(200, 2)))
    with pytest.raises(SinkflowError, match=f"{key}=a .* holds points, .* numpy.save\\('points.npy', points\\)") as e:
        sinkflow.train("moons", device="cpu", runs_dir=runs_dir, train_iters=2, **{key: points})
    assert len(_one_line(e)) < 300 and not runs_dir.exists()
    with pytest.raises(SinkflowError, match="got a .* save the points first") as e:
        sinkflow.build_distribution(points)
    assert len(_one_line(e)) < 300


def test_a_notebooks_interrupt_kernel_saves_a_checkpoint_and_names_the_call_that_continues(runs_dir):
    """Jupyter's "interrupt kernel" is a SIGINT to the kernel's main thread, which runs the cell: the phase stops with
    a checkpoint, the kernel's own Ctrl+C handler is back after the call, and the message names the call that
    continues the run (it said "checkpoint saved" alone; the command's line names its --resume)."""
    import os
    import signal

    from sinkflow.runtime.callbacks import Callback

    class Interrupt(Callback):
        def on_train_batch_end(self, trainer, batch, outputs):
            if trainer.name == "velocity" and trainer.step == 2:
                os.kill(os.getpid(), signal.SIGINT)

    handler = signal.getsignal(signal.SIGINT)
    tiny = {"pool.batches": 2, "pool.batch_size": 32, "pool.chunk": 1}
    with pytest.raises(sinkflow.Interrupted) as e:
        sinkflow.train("moons", device="cpu", runs_dir=runs_dir, name="k", train_iters=6, callbacks=[Interrupt()],
                       **tiny)
    assert signal.getsignal(signal.SIGINT) is handler
    assert str(e.value) == (f"stopped by signal 2 in phase 'velocity' at step 2; checkpoint saved; continue it with "
                            f"sinkflow.resume('{runs_dir.resolve() / 'k'}')")
    assert (runs_dir / "k" / "checkpoints" / "velocity" / "step_00000002.pt").is_file()
    run = sinkflow.resume(e.value.run_dir)
    assert torch.load(run.dir / "checkpoints" / "velocity" / "final.pt", weights_only=True)["step"] == 6


def test_a_run_folder_that_exists_is_refused_with_the_call_that_continues_it(tiny_run, tmp_path):
    """sinkflow.train(name=...) of a folder a notebook's earlier cell made: the fix named the command `sinkflow train
    --resume` and experiment.name, neither of which a notebook calls; the CLI keeps its own."""
    shutil.copytree(tiny_run, tmp_path / "runs" / "base")
    with pytest.raises(SinkflowError) as e:
        sinkflow.train("moons", device="cpu", runs_dir=tmp_path / "runs", name="base", train_iters=2)
    assert _one_line(e) == (f"run folder {tmp_path / 'runs' / 'base'} already exists; continue it with "
                            f"sinkflow.resume('{(tmp_path / 'runs' / 'base').resolve()}') or pick another name=")


def test_out_of_memory_in_training_is_one_line_and_lets_go_of_the_failed_phase(runs_dir):
    """A notebook keeps the last error (sys.last_value, for %debug) and, through its traceback's frames, the failed
    phase's network, optimizer and batches: after a CUDA out-of-memory error the retry with the fix found the card
    still holding them. The error was torch's own message, where the CLI prints one line with the fix; it is that line
    now, naming the call that continues the run, and the phase's objects are gone while the error is kept. A bug's
    error keeps its frames (%debug reads them)."""
    import gc
    import weakref

    from sinkflow.runtime.callbacks import Callback

    class OutOfMemory(Callback):
        def __init__(self, error):
            self.error, self.model = error, None

        def on_train_batch_end(self, trainer, batch, outputs):
            self.model = weakref.ref(trainer.model)
            if trainer.step == 4:
                raise self.error

    kept = {}
    for name, error in (("oom", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")),
                        ("bug", ValueError("a bug in a callback"))):
        callback = OutOfMemory(error)
        with pytest.raises((SinkflowError, ValueError)) as e:
            sinkflow.train("moons", method="otcfm", device="cpu", runs_dir=runs_dir, name=name, train_iters=6,
                           callbacks=[callback], **{"train.velocity.ckpt_every": 3})
        gc.collect()
        kept[name] = (e.value, callback.model() is not None)  # the error held, as a notebook holds it
    error, alive = kept["oom"]
    run = (runs_dir / "oom").resolve()
    assert isinstance(error, SinkflowError) and "\n" not in str(error) and not alive
    assert str(error).startswith("CUDA out of memory in velocity at step 5 (the planner estimates ")
    assert str(error).endswith(f"(`sinkflow.resume('{run}', **{{'train.velocity.accum': 2}})`)")
    assert "step_00000003.pt" in str(error) and "Tried to allocate" not in str(error)
    assert isinstance(kept["bug"][0], ValueError) and kept["bug"][1]
    assert sinkflow.resume(run, **{"train.velocity.accum": 2}).cfg["train"]["velocity"]["accum"] == 2


@pytest.mark.parametrize("call", [lambda run: run.sample(4, steps=2), lambda run: run.evaluate(seeds=1, n=8)],
                         ids=["sample", "evaluate"])
def test_out_of_memory_while_sampling_is_one_line_naming_the_sampling_batch(otcfm_run, monkeypatch, call):
    """As `sinkflow sample` and `eval` say it (tests/test_run_folder_trust.py): it was torch's own message."""
    from sinkflow.methods.flow_matching import FlowMatching

    def sample(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(FlowMatching, "sample_nets", sample)
    with pytest.raises(SinkflowError, match=r"^CUDA out of memory in (sample|eval) .*lower sample.batch_size") as e:
        call(sinkflow.open_run(otcfm_run))
    assert "Tried to allocate" not in _one_line(e)


def test_evaluate_shows_its_table_as_lines_in_a_notebook(otcfm_run, tmp_path):
    """A notebook shows a cell's last value by IPython's pretty printer: `run.evaluate()` there was the string's repr,
    the whole table on one quoted line with its line breaks as \\n. It is still a str."""
    run = sinkflow.open_run(shutil.copytree(otcfm_run, tmp_path / "r"))
    text = run.evaluate(seeds=1, n=8)
    shown = []

    class Printer:  # the two methods of IPython.lib.pretty.RepresentationPrinter a multi-line value uses
        def text(self, part):
            shown.append(part)

        def break_(self):
            shown.append("\n")

    assert isinstance(text, str) and text.count("\n") >= 2
    text._repr_pretty_(Printer(), False)
    assert "".join(shown) == text.rstrip("\n")
    pretty = pytest.importorskip("IPython.lib.pretty")
    assert pretty.pretty(text) == text.rstrip("\n")


@pytest.mark.parametrize("how", ["set_default_device", "with"])
def test_a_notebooks_default_device_is_not_where_a_run_puts_its_tensors(runs_dir, how):
    """Under a notebook's torch.set_default_device("cuda") (or inside `with torch.device(...)`) the tensors sinkflow
    makes without naming a device went there, beside its CPU generators and data: training and sampling failed in torch.
    The meta device stands in for a card here (the same mechanism; "Tensor.item() cannot be called on meta tensors").
    The caller's default is its own again after each call."""
    import contextlib

    if how == "with":
        scope = torch.device("meta")
    else:
        torch.set_default_device("meta")
        scope = contextlib.nullcontext()
    try:
        with scope:
            run = sinkflow.train("moons", method="otcfm", device="cpu", runs_dir=runs_dir, name="d", train_iters=2)
            assert torch.empty(0).device.type == "meta"
            assert run.sample(4, steps=2).device.type == "cpu"
            assert next(run.model().parameters()).device.type == "cpu"
            assert run.evaluate(seeds=1, n=8).startswith("W2 on moons")
            assert torch.empty(0).device.type == "meta"
    finally:
        _clear_default_device()


def _clear_default_device() -> None:
    """``torch.set_default_device(None)``, without the None it leaves behind, on which torch 2.4 / 2.5's
    ``get_default_device`` fails (torchmetrics' FID calls it: a later test's evaluation in the same worker)."""
    torch.set_default_device(None)
    del torch._GLOBAL_DEVICE_CONTEXT.device_context


def test_a_default_device_cleared_for_a_call_leaves_torchs_own_query_working():
    """sinkflow clears a notebook's ``torch.set_default_device`` for its call with ``set_default_device(None)``, and
    on torch 2.4 / 2.5 the None that leaves behind failed ``torch.get_default_device`` ("'NoneType' object has no
    attribute 'device'"), which torchmetrics' FID calls: an image run's evaluation failed inside the call. What that
    torch reads is checked here (this torch's own query works either way)."""
    from sinkflow.api import _cpu_default_device

    torch.set_default_device("meta")
    try:
        with _cpu_default_device():
            assert torch.empty(0).device.type == "cpu"
            assert getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", "unset") is not None
            assert torch.get_default_device().type == "cpu"
        assert torch.empty(0).device.type == "meta"
    finally:
        _clear_default_device()


def test_a_second_interrupt_stops_at_once_and_says_so(runs_dir):
    """A notebook's "interrupt kernel" pressed twice: the run stops at once, as the command does, but the cell showed a
    bare KeyboardInterrupt from inside the engine; it says what the command says, naming the call that continues."""
    import os
    import signal

    from sinkflow.runtime.callbacks import Callback
    from sinkflow.runtime.signals import StopNow

    class Twice(Callback):
        def on_train_batch_end(self, trainer, batch, outputs):
            if trainer.step == 4:
                os.kill(os.getpid(), signal.SIGINT)  # the handler runs before the next call: the stop is asked
                os.kill(os.getpid(), signal.SIGINT)  # and this one stops at once

    with pytest.raises(StopNow) as e:
        sinkflow.train("moons", method="otcfm", device="cpu", runs_dir=runs_dir, name="k", train_iters=8,
                       callbacks=[Twice()], **{"train.velocity.ckpt_every": 3})
    assert str(e.value) == ("stopped at once by a second signal: the checkpoints written before are intact; continue "
                            f"it with sinkflow.resume('{(runs_dir / 'k').resolve()}')")
    assert isinstance(e.value, KeyboardInterrupt) and e.value.signum == signal.SIGINT
    assert sinkflow.resume(e.value.args[0].split("'")[1]).dir == (runs_dir / "k").resolve()


def test_a_runs_error_leaves_the_frames_of_the_error_the_caller_was_handling(tmp_path):
    """A run's error drops its own frames' variables (``_released``: the failed phase's GPU tensors), walking the
    errors it chains. A call made inside the caller's ``except`` block chains the caller's error as its context,
    and the walk cleared that error's frames too: a notebook's own function's variables, which ``%debug`` of the
    error it had kept showed empty."""
    def callers_function():
        mine = "the caller's variable"  # noqa: F841  (read back through the traceback)
        raise ValueError("the caller's own error")

    try:
        callers_function()
    except ValueError as own:
        kept = own
        with pytest.raises(SinkflowError) as e:
            sinkflow.resume(tmp_path / "no-run-here")
    assert e.value.__context__ is kept
    tb = kept.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_locals.get("mine") == "the caller's variable"
