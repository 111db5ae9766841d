"""Extending sinkflow as docs/architecture.md says: a method is its file plus one registry entry, a network its
file plus one schema entry; the CLI and the API share one engine entry point; the tensor-level pieces work on
plain tensors; the callback protocol carries state, exceptions and stop requests."""

from __future__ import annotations

import contextlib
import json
import sys
import types

import numpy as np
import pytest
import torch

import sinkflow
from sinkflow import config
from sinkflow.cli import main
from sinkflow.config import schema
from sinkflow.errors import SinkflowError
from sinkflow.methods.base import Method, TrainingStep
from sinkflow.methods.ode import count_nfe, euler
from sinkflow.runtime.callbacks import Callback

TINY_FM = ["--train-iters", "6", "--batch-size", "16", "train.velocity.ckpt_every=3", "train.velocity.log_every=2",
           "eval.n=32", "eval.seeds=1", "eval.steps=[2]", "sample.steps=2", "--device", "cpu"]


# ---- a new method: I-CFM with a sigma key, added through the registry alone ---------------------------------

class ICFMStep(TrainingStep):
    """I-CFM (Tong et al.): x_t = t x1 + (1 - t) x0 + sigma * eps, target x1 - x0."""

    def __init__(self, source, target, sigma):
        super().__init__("velocity")
        self.source, self.target, self.sigma = source, target, sigma

    def batch(self, generator, n, device):
        x0, x1 = self.source.sample(n, generator, "cpu"), self.target.sample(n, generator, "cpu")
        t = torch.rand(n, generator=generator)
        xt, ut = sinkflow.straight_path(x0, x1, t)
        xt = xt + self.sigma * torch.randn(xt.shape, generator=generator)
        return xt.to(device), t.to(device), ut.to(device)

    def loss(self, model, batch):
        return sinkflow.velocity_loss(model, batch)


class ICFM(Method):
    name = "icfm"

    def phases(self, cfg, source, target):
        return [ICFMStep(source, target, cfg["icfm"]["sigma"])]

    def sample_nets(self, nets, cfg, x0, steps=None, record=False):
        with count_nfe(nets["velocity"]) as nfe:
            x, path = euler(nets["velocity"], x0, 0.0, 1.0, steps or self.default_steps(cfg), record)
        return x, {"nfe": nfe.count, "path": path}


ICFM_SPEC = schema.MethodSpec(
    "sinkflow_toy.icfm:METHOD", ("velocity",), reads=("sample.steps", "sample.time_warp", "eval.steps"),
    keys={"icfm": {"sigma": schema.Key(0.1, schema.NONNEG_FLOAT, "I-CFM path noise")}},
    section_docs={"icfm": "I-CFM (a toy method added by a test)"}, doc="I-CFM, a toy method added by a test")


@pytest.fixture
def icfm(monkeypatch):
    module = types.ModuleType("sinkflow_toy.icfm")
    module.METHOD = ICFM()
    monkeypatch.setitem(sys.modules, "sinkflow_toy.icfm", module)
    schema.register_method("icfm", ICFM_SPEC)
    yield module.METHOD
    schema.unregister_method("icfm")


@contextlib.contextmanager
def toy_method(monkeypatch, name: str, method, phases=("velocity",), reads=schema.EULER_READS):
    """``method`` registered as the docs say (its module, one METHOD_REGISTRY entry) for the block, then removed."""
    module = types.ModuleType(f"sinkflow_toy.{name}")
    module.METHOD = method
    monkeypatch.setitem(sys.modules, module.__name__, module)
    schema.register_method(name, schema.MethodSpec(f"{module.__name__}:METHOD", tuple(phases), reads))
    try:
        yield method
    finally:
        schema.unregister_method(name)


def test_a_new_method_is_its_file_plus_one_registry_entry(icfm, runs_dir, capsys):
    cfg = config.resolve("moons", ["icfm.sigma=0.2"], {"method": "icfm"})
    assert cfg["icfm"]["sigma"] == 0.2 and "icfm.sigma" in schema.used(cfg)
    # the schema follows: `sinkflow config` shows what icfm reads (sample.steps), hides the pool
    assert main(["config", "moons", "--method", "icfm"]) == 0
    out = capsys.readouterr().out
    assert "sigma: 0.1" in out and "steps: 100" in out and "pool:" not in out
    # docs/config.md's method table lists it from its MethodSpec (experiment.method's doc named the five built-ins)
    from sinkflow.config import render
    assert "| `icfm` | `velocity` | I-CFM, a toy method added by a test |" in render.doc_markdown()
    # its key is an error on another method, naming the method that reads it
    with pytest.raises(SinkflowError, match="'icfm.sigma' is not read by method nsgf.*--method icfm"):
        config.resolve("moons", ["icfm.sigma=0.2"])
    with pytest.raises(SinkflowError, match="must be >= 0"):
        config.resolve("moons", ["icfm.sigma=-1"], {"method": "icfm"})
    # and it trains 20 steps through the same engine entry point as the CLI, then samples
    run = sinkflow.train("moons", method="icfm", train_iters=20, batch_size=32, device="cpu", name="icfm",
                         runs_dir=runs_dir, **{"icfm.sigma": 0.05, "train.velocity.log_every": 10})
    assert (run.dir / "checkpoints" / "velocity" / "final.pt").is_file()
    meta = json.loads((run.dir / "meta.json").read_text())  # the call, beside the process's argv (pytest's here)
    assert meta["call"] == (f"sinkflow.train('moons', runs_dir={str(runs_dir)!r}, name='icfm', device='cpu', "
                            "method='icfm', train_iters=20, batch_size=32, **{'icfm.sigma': 0.05, "
                            "'train.velocity.log_every': 10})")
    steps = [r for r in (run.dir / "metrics.jsonl").read_text().splitlines() if '"velocity"' in r]
    assert len(steps) == 2
    x = run.sample(64, steps=3)
    assert x.shape == (64, 2) and torch.isfinite(x).all()
    assert "icfm" not in schema.METHODS or schema.METHOD_REGISTRY["icfm"] is ICFM_SPEC
    # a process that has not registered it (the CLI after a notebook's plugin) says so, not "edit that file
    # (e.g. method: nsgf)"
    schema.unregister_method("icfm")
    with pytest.raises(SinkflowError, match="trained by method 'icfm', which is not registered here.*register it "
                                            "first"):
        sinkflow.open_run(run.dir)
    assert main(["eval", str(run.dir)]) == 2
    assert "edit that file" not in capsys.readouterr().err


def test_a_new_euler_method_is_tunable_without_naming_it(icfm):
    """`sinkflow tune` asks the method for its sampler's knobs: a new method that reads sample.steps and
    sample.time_warp gets the Euler grid's candidates and the report's hint (tools/tune.py listed four methods by
    name and refused any other: "sinkflow tune chooses the sampler of nsgfpp, fm, otcfm, flow runs")."""
    from sinkflow.tools import tune

    cfg = config.resolve("digits", ["data.val_fraction=0.1", "sample.steps=7"], {"method": "icfm", "device": "cpu"})
    assert tune.candidates(cfg, 5) == [{"steps": 5, "time_warp": w} for w in tune.WARPS]
    assert tune.current(cfg) == (7, {"steps": 7, "time_warp": 1.0})
    assert "sinkflow tune {run} (at its own 7 network evaluations" in tune.hint(cfg)
    with pytest.raises(SinkflowError, match="this run's method is nsgf"):  # NSGF's sampler follows its pool's grid
        tune.candidates(config.resolve("moons", [], {"device": "cpu"}), 10)


def test_bench_advises_a_new_methods_pool_by_its_phases(monkeypatch, runs_dir, capsys):
    """bench --profile's pool lever followed the method's name (nsgf, nsgfpp): an NSGF variant added as its own
    method trained the same pool and was not told to hold it in RAM."""
    from sinkflow.methods.nsgf import NSGF

    spec = schema.METHOD_REGISTRY["nsgf"]
    with toy_method(monkeypatch, "nsgf2", type("NSGF2", (NSGF,), {"name": "nsgf2"})(), spec.phases, spec.reads):
        assert main(["bench", "--profile", "moons", "--method", "nsgf2", "pool.steps=2", "pool.batches=2",
                     "pool.batch_size=16", "pool.storage=disk", "--batch-size", "16", "--steps", "1", "--warmup",
                     "0", "--device", "cpu"]) == 0
        assert "set pool.storage=memory" in capsys.readouterr().out


def test_a_method_named_other_than_its_registry_key_is_one_line(monkeypatch, capsys, tmp_path):
    """Method.name is how callers find its phases and reads (schema.METHOD_PHASES[method.name]): a new method that
    forgot it (the base's "") or spelled it otherwise stopped `sinkflow train` with a KeyError traceback."""
    with toy_method(monkeypatch, "unnamed", type("Unnamed", (ICFM,), {"name": ""})()):
        with pytest.raises(SinkflowError, match="named '', not its registry key 'unnamed'.*name = 'unnamed'"):
            sinkflow.get_method("unnamed")
        assert main(["train", "moons", "--method", "unnamed", *TINY_FM]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "named '', not its registry key 'unnamed'" in err[0]
        # a typo in the entry's "module:attribute" is one line too, not importlib's traceback
        for where, missing in [("sinkflow_toy.unamed:METHOD", "no module sinkflow_toy.unamed"),
                               ("sinkflow_toy.unnamed:METHD", "no METHD in sinkflow_toy.unnamed")]:
            schema.register_method("unnamed", schema.MethodSpec(where, ("velocity",)))
            with pytest.raises(SinkflowError, match=f"names '{where}', but there is {missing}"):
                sinkflow.get_method("unnamed")
        # an AttributeError raised while the method's own module runs is that error, not "no METHOD in it"
        (tmp_path / "sinkflow_toyb").mkdir()
        (tmp_path / "sinkflow_toyb" / "__init__.py").write_text("")
        (tmp_path / "sinkflow_toyb" / "broken.py").write_text("import os\nos.typo()\nMETHOD = None\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        schema.register_method("unnamed", schema.MethodSpec("sinkflow_toyb.broken:METHOD", ("velocity",)))
        with pytest.raises(AttributeError, match="no attribute 'typo'"):
            sinkflow.get_method("unnamed")


def test_phases_named_otherwise_than_the_registry_entry_are_one_line(monkeypatch, capsys):
    """A method's tasks must carry the names its MethodSpec declares (the train / model sections, checkpoints,
    status and the memory plan follow them): one named otherwise was a KeyError traceback in the Trainer, and in
    preflight's length check."""
    class Misnamed(ICFM):
        def phases(self, cfg, source, target):
            step = ICFMStep(source, target, 0.0)
            step.name = step.model_key = "vel"
            return [step]

    with toy_method(monkeypatch, "misnamed", type("M", (Misnamed,), {"name": "misnamed"})()):
        cfg = config.resolve("moons", [], {"method": "misnamed"})
        with pytest.raises(SinkflowError, match=r"built the phases \(vel\), but its METHOD_REGISTRY entry declares "
                                                r"\(velocity\)"):
            sinkflow.methods.phases(cfg, *sinkflow.methods.distributions(cfg))
        assert main(["preflight", "moons", "--method", "misnamed"]) == 1
        assert "FAIL  config  phases build             method 'misnamed' built the phases (vel)" in \
            capsys.readouterr().out


def test_a_new_network_is_its_file_plus_one_schema_entry(monkeypatch):
    """One entry in MODEL_KINDS (with its role): every phase of that role offers it; build_model finds the file."""
    module = types.ModuleType("sinkflow.models.tinynet")
    module.build = lambda c, shape: torch.nn.Linear(shape[0] + 1, shape[0])
    monkeypatch.setitem(sys.modules, "sinkflow.models.tinynet", module)
    monkeypatch.setitem(schema.MODEL_KINDS, "tinynet", schema.Network("velocity", {
        "width": schema.Key(4, schema.POS_INT, "units")}))
    schema._assemble()
    try:
        assert "tinynet" in schema.MODEL["velocity"].kinds and "tinynet" in schema.MODEL["nsf"].kinds
        assert "tinynet" not in schema.MODEL["time"].kinds
        cfg = config.resolve("moons", ["model.velocity.kind=tinynet", "model.velocity.width=8"])
        assert cfg["model"]["velocity"] == {"kind": "tinynet", "width": 8}
    finally:
        monkeypatch.undo()
        schema._assemble()
    assert "tinynet" not in schema.MODEL["velocity"].kinds


# ---- keys a run does not read --------------------------------------------------------------------------

@pytest.mark.parametrize("preset,override,method", [
    ("moons", "train.nsf.ema=0.5", "nsgfpp"),
    ("moons", "nsgf.nsf_pairs=ot", "nsgfpp"),
    ("digits", "eval.steps=[5]", "nsgf"),  # NSGF++ evaluates at its sample.nsf_steps
    ("flow-digits", "pool.batches=4", "nsgf"),
])
def test_an_override_the_run_does_not_read_is_an_error(preset, override, method):
    with pytest.raises(SinkflowError, match=f"'{override.split('=')[0]}' is not read by method .*--method {method}"):
        config.resolve(preset, [override, "data.download=false"] if preset != "moons" else [override])


def test_a_preset_may_set_keys_for_another_method():
    """digits sets NSGF++'s phases; --method fm on it is allowed and the unread keys are listed (a warning)."""
    cfg = config.resolve("digits", [], {"method": "fm"})
    unread = config.unread_preset_keys(cfg)
    assert any(k.startswith("model.nsf.") for k in unread) and "model.velocity.channels" not in unread
    # digits' own method (NSGF++) reads all but the Euler steps it sets for the FM / OT-CFM baselines
    assert config.unread_preset_keys(config.resolve("digits")) == ["sample.steps", "eval.steps"]
    # both are read by another method (a note, not a warning); a key no method reads would be a warning
    assert config.read_by_other_methods(config.resolve("digits"), ["sample.steps", "eval.steps"])
    assert config.read_by_other_methods(cfg, unread)
    assert not config.read_by_other_methods(config.resolve("moons"), ["data.flip"])  # images only: no method on points


def test_config_shows_what_nsgfpp_reads():
    shown = schema.used(config.resolve("digits"))
    assert "eval.steps" not in shown and "sample.nsf_steps" in shown
    assert "model.time.channels" in shown and "model.time.hidden" not in shown  # the MLP-only keys: points
    assert "model.time.hidden" in schema.used(config.resolve("moons", [], {"method": "nsgfpp"}))
    assert "eval.class_n" in schema.used(config.resolve("flow-digits"))  # flows' image metrics read it


# ---- paper numbers belong to their method -----------------------------------------------------------------

def test_the_paper_column_stands_only_beside_a_w2_on_the_papers_1024_points(tiny_run):
    """Table 1's W2 is on 1024 test points; `sinkflow eval RUN --n 64` printed its W2 beside the paper's 0.077 on
    moons, where two perfect draws of 64 points are already 0.156 apart: the model looked twice as far off as it
    was. Below 1024 points the column is left out and a line says why; at 1024 it is there."""
    from sinkflow.eval.points import PAPER_N, format_table, w2_table

    run = sinkflow.open_run(tiny_run)._run  # moons, NSGF: the paper's task
    small = w2_table(run, n=64, seeds=1, steps_list=[10])
    assert small[0]["paper"] is None
    text = format_table(small, "nsgf", "moons", "NSGF")
    assert "0.077" not in text and f"no paper NSGF column: its W2 is on {PAPER_N} test points, QMC source draws; " \
        "this one is on 64, larger for the sample size alone" in text
    full = w2_table(run, n=PAPER_N, seeds=1, steps_list=[10])
    assert full[0]["paper"] == 0.077
    text = format_table(full, "nsgf", "moons", "NSGF")
    assert "paper NSGF" in text and "0.077" in text and "no paper" not in text


def test_the_paper_column_is_left_out_under_the_iid_protocol(tiny_run):
    """eval.protocol=iid scores i.i.d. source draws against an i.i.d. test draw, whose floor (moons 0.218 at 1024
    points, docs/data.md) is above every paper number: its W2 stood beside the paper's 0.077 all the same."""
    from sinkflow.eval.points import PAPER_N, format_table, w2_table

    rows = w2_table(sinkflow.open_run(tiny_run)._run, n=PAPER_N, seeds=1, steps_list=[10], protocol="iid")
    assert rows[0]["paper"] is None
    text = format_table(rows, "nsgf", "moons", "NSGF", "iid")
    assert "0.077" not in text and "this one is under eval.protocol=iid" in text


def test_paper_numbers_belong_to_the_method_and_a_task_without_them_reports_none(monkeypatch):
    from sinkflow import methods
    from sinkflow.data.toy2d import TOY2D, Moons
    from sinkflow.eval import floor
    from sinkflow.eval.points import format_table

    assert methods.get("nsgf").paper_w2("moons", 10) == 0.077
    assert methods.get("otcfm").paper_w2("moons", 10) == 0.088
    assert methods.get("flow").paper_w2("moons", 10) is None and methods.get("nsgf").paper_w2("spiral", 10) is None
    rows = [{"steps": 10, "nfe": 10, "w2_mean": 0.1, "w2_std": 0.01, "paper": methods.get("fm").paper_w2("moons", 10)}]
    text = format_table(rows, "fm", "moons", methods.get("fm").paper_label)
    assert "paper FM" in text and "0.111" in text and "NSGF" not in text
    none = format_table([{**rows[0], "paper": None}], "fm", "spiral", "FM")
    assert "paper" not in none
    monkeypatch.setitem(TOY2D, "moons-again", Moons)  # a 2D data set the paper never used
    table = {r["name"]: r for r in floor.floor_table(n=32, pairs=2)}
    assert table["moons-again"]["paper"] is None and table["moons"]["paper"] == (0.077, 0.067)


# ---- one sampling default; tensor-level pieces ----------------------------------------------------------

def test_cli_and_api_sample_iid_by_default_and_qmc_on_request(runs_dir, capsys):
    assert main(["train", "moons", "--method", "fm", *TINY_FM, "--name", "s", "--no-report"]) == 0
    run = sinkflow.open_run(runs_dir / "s")
    assert main(["sample", str(run.dir), "--n", "40", "--steps", "2", "--out", "iid.npy"]) == 0
    assert "from an i.i.d. source draw" in capsys.readouterr().out
    assert main(["sample", str(run.dir), "--n", "40", "--steps", "2", "--qmc", "--out", "qmc.npy"]) == 0
    iid, qmc = np.load("iid.npy"), np.load("qmc.npy")
    assert not np.allclose(iid, qmc)
    np.testing.assert_allclose(run.sample(40, steps=2).numpy(), iid, rtol=1e-6, atol=1e-6)  # one default
    np.testing.assert_allclose(run.sample(40, steps=2, qmc=True).numpy(), qmc, rtol=1e-6, atol=1e-6)
    figures = {p.name: p.stat().st_mtime_ns for p in run.dir.glob("*.png")}
    report = run.evaluate()
    assert "QMC source draws" in report and "eval.protocol=qmc" in report
    assert {p.name: p.stat().st_mtime_ns for p in run.dir.glob("*.png")} == figures  # it rewrote them
    assert "4 samples per seed, one seed (no spread)" in run.evaluate(seeds=1, n=4)
    record = json.loads((run.dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert (record["phase"], record["n"], record["seeds"], record["protocol"]) == ("eval", 4, 1, "qmc")


def test_flow_matching_on_plain_tensors_matches_the_training_phase():
    """FM / OT-CFM's (t, x_t, u_t) on plain tensors is the batch its training phase draws (torchcfm's API)."""
    from sinkflow.data import build_distribution
    from sinkflow.methods.flow_matching import OTCFM, interpolant_batch

    src, tgt = build_distribution("8gaussians"), build_distribution("moons")
    xt, t, ut = interpolant_batch(src, tgt, torch.Generator().manual_seed(3), 64, "cpu", ot_pairs=True)
    g = torch.Generator().manual_seed(3)
    x0, x1 = src.sample(64, g, "cpu"), tgt.sample(64, g, "cpu")
    t2, xt2, ut2 = OTCFM.sample_location_and_conditional_flow(x0, x1, generator=g)
    assert torch.equal(t, t2) and torch.equal(xt, xt2) and torch.equal(ut, ut2)
    net = sinkflow.build_model("mlp", {"hidden": 8, "depth": 1}, (2,))
    assert torch.isclose(OTCFM.loss(net, x0, x1, t=t2), sinkflow.velocity_loss(net, (xt, t, ut)))


def test_pool_batch_on_plain_tensors_follows_the_grid():
    """x_k + u eta_k v_k at network time times[k] + u steps[k], target scale[k] v_k (fraction time: T eta_k)."""
    etas = torch.tensor([0.25, 1 / 3, 0.5, 1.0])
    grid = sinkflow.PoolGrid.of(etas, "fraction")
    x, v = torch.zeros(2, 2), torch.ones(2, 2)
    k, u = torch.tensor([0, 3]), torch.tensor([0.0, 0.5])
    xb, tb, target = sinkflow.pool_batch(x, v, k, u, grid)
    assert torch.allclose(xb[1], torch.full((2,), 0.5)) and torch.allclose(xb[0], torch.zeros(2))
    assert torch.allclose(tb, torch.tensor([0.0, 0.875])) and torch.allclose(target[1], torch.full((2,), 4.0))
    xs, vs = torch.randn(4, 10, 2), torch.randn(4, 10, 2)
    batch = sinkflow.sample_pool(xs, vs, 8, grid, segment=0.0, generator=torch.Generator().manual_seed(0))
    assert batch[0].shape == (8, 2) and all(float(t) in grid.times[:-1].tolist() for t in batch[1])


# ---- the callback protocol --------------------------------------------------------------------------------

class Counter(Callback):
    """Counts optimizer steps across a resume (its state rides in the step checkpoints)."""

    def __init__(self, stop_at=None):
        self.seen, self.stop_at, self.errors = 0, stop_at, []

    def on_train_batch_end(self, trainer, batch, outputs):
        self.seen += 1
        if self.stop_at is not None and trainer.step == self.stop_at:
            trainer.request_stop()

    def on_exception(self, trainer, exception):
        self.errors.append(type(exception).__name__)

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


def test_callback_state_is_checkpointed_and_exceptions_reach_callbacks(runs_dir):
    from sinkflow.engine.experiment import train_run
    from sinkflow.runtime.signals import Interrupted

    cfg = config.resolve("moons", ["train.velocity.ckpt_every=100", "experiment.name=cb"],
                         {"method": "fm", "train_iters": 6, "batch_size": 8, "device": "cpu"})
    first = Counter(stop_at=4)
    with pytest.raises(Interrupted) as stopped:
        train_run(cfg, callbacks=[first])
    assert first.errors == ["Interrupted"] and stopped.value.run_dir.resolve() == runs_dir / "cb"
    # the callback's own stop, named so ("stopped by signal 15" sent a user looking for who sent SIGTERM), with a
    # SIGTERM's exit status as before
    assert "stopped by trainer.request_stop() in phase 'velocity' at step 4" in str(stopped.value)
    assert stopped.value.exit_status == 128 + 15
    second = Counter()
    train_run(resume=runs_dir / "cb", callbacks=[second])
    assert second.seen == 6  # 4 restored from the checkpoint + 2 steps after the resume


def test_callback_state_survives_a_stop_between_two_phases(monkeypatch, runs_dir):
    """A stop at a phase's last step ends that phase (final.pt) and stops the run before the next: the callbacks'
    state was in that final.pt alone, and the resumed next phase, with no step checkpoint, handed none back."""
    from sinkflow.engine.experiment import train_run
    from sinkflow.methods.flow_matching import FM, InterpolantStep
    from sinkflow.runtime.signals import Interrupted

    class Two(Method):
        name = "two"

        def phases(self, cfg, source, target):
            return [InterpolantStep("velocity", source, target), InterpolantStep("nsf", source, target)]

        def sample_nets(self, nets, cfg, x0, steps=None, record=False):
            return FM.sample_nets(nets, cfg, x0, steps, record)

    with toy_method(monkeypatch, "two", Two(), ("velocity", "nsf")):
        cfg = config.resolve("moons", ["experiment.name=two", "train.velocity.iters=3", "train.nsf.iters=2"],
                             {"method": "two", "batch_size": 8, "device": "cpu"})
        first = Counter(stop_at=3)  # velocity's last step
        with pytest.raises(Interrupted):
            train_run(cfg, callbacks=[first])
        assert (runs_dir / "two" / "checkpoints" / "velocity" / "final.pt").is_file()
        second = Counter()
        train_run(resume=runs_dir / "two", callbacks=[second])
        assert second.seen == 5  # 3 from velocity's final.pt + nsf's 2


def test_a_callback_state_a_checkpoint_cannot_load_back_is_refused_when_saved(runs_dir):
    """A numpy number in a callback's state (np.mean of its losses) was saved in every step checkpoint, and every
    resume then refused the run's own checkpoints as 'holds objects other than tensors ... could run code'."""
    from sinkflow.engine.experiment import train_run

    class Best(Counter):
        def state_dict(self):
            return {"seen": self.seen, "best": np.float64(0.5)}

    cfg = config.resolve("moons", ["train.velocity.ckpt_every=3", "experiment.name=np"],
                         {"method": "fm", "train_iters": 6, "batch_size": 8, "device": "cpu"})
    with pytest.raises(SinkflowError, match=r"callback .*Best's state_dict\(\) holds a numpy.*scalar, which a step "
                                            r"checkpoint cannot load back.*float\(x\) for a numpy number"):
        train_run(cfg, callbacks=[Best()])
    assert not list((runs_dir / "np" / "checkpoints" / "velocity").glob("step_*.pt"))


def test_a_callback_state_a_checkpoint_cannot_write_is_one_line():
    """A lambda or a local class in a callback's state failed in torch.save, outside the check: pickle's
    AttributeError traceback from the middle of a step checkpoint, not the one line a numpy number gets."""
    from sinkflow.runtime.callbacks import checkpointable_state

    class Local:
        pass

    for value in (lambda x: x, Local()):
        class Odd(Callback):
            def state_dict(self, value=value):
                return {"odd": value}

        with pytest.raises(SinkflowError, match=r"callback .*Odd's state_dict\(\) holds an object a step checkpoint "
                                                r"cannot write \(.*pickle.*float\(x\) for a numpy number"):
            checkpointable_state(Odd())


def test_the_apis_callbacks_are_checked_before_a_run_folder_is_made(runs_dir):
    """callbacks=cb (one callback, not in a list) was "'C' object is not iterable" and callbacks=[object()] "'object'
    object has no attribute 'teardown'": tracebacks from inside the engine, with the new run folder already written."""
    for value, needle in [(Counter(), r"is not a list of callbacks.*callbacks=\[cb\]"),
                          ([object()], r"not a sinkflow.runtime.callbacks.Callback")]:
        with pytest.raises(SinkflowError, match=needle):
            sinkflow.train("moons", method="fm", train_iters=2, batch_size=8, device="cpu", name="bad-cb",
                           runs_dir=runs_dir, callbacks=value)
        with pytest.raises(SinkflowError, match=needle):
            sinkflow.resume(runs_dir / "nowhere", callbacks=value)
    assert not (runs_dir / "bad-cb").exists()


def test_the_apis_callbacks_none_is_no_callbacks(runs_dir):
    """callbacks=None (a wrapper's ``def fit(callbacks=None)`` passed on) was refused as "not a list of callbacks",
    where every other optional argument of the API takes None as its default."""
    run = sinkflow.train("moons", method="fm", train_iters=2, batch_size=8, device="cpu", name="none-cb",
                         runs_dir=runs_dir, callbacks=None)
    assert sinkflow.resume(run.dir, callbacks=None).dir == run.dir


def test_the_api_takes_your_own_callbacks(runs_dir):
    """sinkflow.train / resume pass callbacks to the engine (they answered "unknown override 'callbacks'": a
    callback needed config.resolve + engine.experiment.train_run, which the README's API never names)."""
    class Logged(Counter):
        def on_log(self, trainer, metrics):
            metrics["seen"] = self.seen

    with pytest.raises(sinkflow.Interrupted) as stopped:
        sinkflow.train("moons", method="fm", train_iters=6, batch_size=8, device="cpu", name="api-cb",
                       runs_dir=runs_dir, callbacks=[Logged(stop_at=4)], **{"train.velocity.log_every": 2})
    again = Logged()
    run = sinkflow.resume(stopped.value.run_dir, callbacks=[again])
    assert again.seen == 6  # 4 restored + 2
    logged = [json.loads(r) for r in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["seen"] for r in logged if r["phase"] == "velocity"] == [2, 4, 6]
    assert "callbacks" not in json.loads((run.dir / "meta.json").read_text())["call"]


def test_stop_ends_a_phase_before_its_step_writing_nothing(runs_dir):
    from sinkflow.runtime.run_folder import RunFolder
    from sinkflow.tools.phases import ready_trainer

    cfg = config.resolve("moons", ["experiment.name=stop"], {"method": "fm", "train_iters": 5, "device": "cpu"})
    run = RunFolder.create(cfg)
    phase = sinkflow.get_method("fm").phases(cfg, *sinkflow.methods.distributions(cfg))[0]
    trainer = ready_trainer(run, phase)
    assert trainer.stopped and trainer.step == 0 and trainer.batch is not None
    assert not (run.dir / "checkpoints" / "velocity" / "final.pt").exists()


def test_a_callbacks_stop_inside_a_run_stops_the_run_not_marks_it_finished(runs_dir):
    """trainer.stop() writes nothing: run_phases went on to the next phase (or the report) and status.json said
    finished, with no final.pt (status: INCOMPLETE)."""
    from sinkflow.engine.experiment import train_run

    class StopAt3(Callback):
        def on_train_batch_end(self, trainer, batch, outputs):
            if trainer.step == 3:
                trainer.stop()

    cfg = config.resolve("moons", ["experiment.name=halt"], {"method": "fm", "train_iters": 6, "batch_size": 8,
                                                             "device": "cpu"})
    with pytest.raises(SinkflowError,
                       match=r"ended phase 'velocity' at step 3 with trainer.stop\(\).*request_stop") as err:
        train_run(cfg, callbacks=[StopAt3()])
    assert err.value.every_rank  # under torchrun rank 0 alone prints it (each rank printed its own line)
    status = json.loads((runs_dir / "halt" / "status.json").read_text())
    assert status["state"] == "failed" and not (runs_dir / "halt" / "checkpoints" / "velocity" / "final.pt").exists()
