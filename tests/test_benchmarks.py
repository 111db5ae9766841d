"""The benchmark scripts: a smoke test per script that runs its real main path at tiny sizes on the CPU and checks
what it prints and writes (so a benchmark can never break unnoticed), a meta-test that every script in
benchmarks/ has one, and the logic inside the scripts that decides what a table says (the digits benchmark's
choice rules, the 8gaussians mode-count measurement).

Scripts run in this process (``main(argv)``), not in a subprocess: a fresh interpreter spends seconds importing
torch, and the whole file must stay fast. Every run writes under ``tmp_path`` (never benchmarks/ or docs/).
"""

import importlib.util
import json
import math
import os
import pickle
import re
import sys
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import yaml

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# every script in benchmarks/ with its smoke test below (test_smoke_<name>); the meta-test keeps this list and the
# folder equal, so a new script cannot be added without one
SMOKE_TESTED = ("digits", "flow_bpd", "flow_digits_ablation", "flow_memory", "gpu_checks", "memory_estimate",
                "nsgf_2d", "ot_memory", "pool_build", "preset_throughput", "sampling", "sinkhorn_solver",
                "train_throughput", "w2_mode_counts", "mnist", "mnist_probes", "nsgf_suite",
                "pool_convergence", "cpu_step", "loss_curve", "ot_coupling", "gpu_session", "sample_precision")
# modules the scripts import (no command line of their own), each with its own test here: test_helper_<name>
HELPERS = ("suite2d", "results_md", "scoring", "_args", "_dist")


def load(name):
    """Import benchmarks/<name>.py as a module (registered, so its functions pickle as a process pool needs)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class InProcessPool:
    """Stands in for a script's ProcessPoolExecutor: each job runs here, in order, after its function and arguments
    went through pickle as they would to a worker process. (Forking a test worker that holds threads can hang, and
    the pool only runs seeds side by side.)"""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args):
        fn, args = pickle.loads(pickle.dumps((fn, args)))
        future = Future()
        future.set_result(fn(*args))
        return future

    def map(self, fn, *iterables):
        return [self.submit(fn, *args).result() for args in zip(*iterables)]


def numbers(text):
    """Every number in a line of a table (commas and x suffixes allowed), as floats."""
    return [float(v.replace(",", "")) for v in re.findall(r"-?(?:\d[\d,]*\.?\d*(?:e[-+]?\d+)?|nan|inf)", text)]


def rows(out, start):
    """The lines of ``out`` that start with ``start``."""
    return [line for line in out.splitlines() if line.startswith(start)]


@pytest.fixture
def quiet(tmp_path, monkeypatch):
    """Run in an empty folder (runs/, data/ are relative to it) and never renice the test worker."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "nice", lambda inc: 0)
    return tmp_path


def test_every_benchmark_script_has_a_smoke_test():
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")}
    assert scripts == set(SMOKE_TESTED) | set(HELPERS), (
        f"benchmarks/ without a smoke test here: {sorted(scripts - set(SMOKE_TESTED) - set(HELPERS))}; "
        f"listed but missing: {sorted((set(SMOKE_TESTED) | set(HELPERS)) - scripts)}")
    here = globals()
    assert [n for n in SMOKE_TESTED if not callable(here.get(f"test_smoke_{n}"))] == []
    assert [n for n in HELPERS if not callable(here.get(f"test_helper_{n}"))] == []


@pytest.fixture(scope="module")
def bench():
    return load("digits")


def test_rank_choice_takes_the_best_mean_rank_and_breaks_ties_by_w2(bench):
    # columns (W2, TV, -confidence), lower is better in each
    val = {1: (3.0, 0.10, -0.80), 2: (3.1, 0.09, -0.90), 3: (3.2, 0.11, -0.85)}
    assert bench.rank_choice(val) == 2  # ranks 1: 0+1+2, 2: 1+0+0, 3: 2+2+1
    tie = {3: (3.2, 0.11, -0.90), 2: (3.1, 0.10, -0.80), 1: (3.0, 0.12, -0.85)}  # every rank sum is 3
    assert bench.rank_choice(tie) == 1  # the lowest W2, wherever it sits in the dict


def test_split_candidates_leave_one_predictor_call_and_one_nsf_step(bench):
    assert bench.split_candidates(6) == [1, 2, 3, 4]
    assert all(k + 1 + 1 <= 13 for k in bench.split_candidates(13))


def test_wins_and_verdict_count_per_metric_direction(bench):
    pp = {"w2": 3.1, "tv": 0.06, "conf": 0.91}
    ot = {"w2": 3.2, "tv": 0.05, "conf": 0.90}
    assert bench.wins(pp, ot) == ["w2", "conf"]  # lower W2 and TV win, higher confidence wins
    per_seed = [{"scores": {"NSGF++": {6: pp}, "OT-CFM": {6: ot}, "OT-CFM warped": {6: pp}}}]
    lines = bench.verdict(per_seed, [6]).splitlines()
    assert "on 2 of 3 (w2, conf)" in lines[0] and "on 0 of 3 (none)" in lines[1]


def test_results_are_written_as_plain_json(bench):
    res = {"warp": {("OT-CFM", 6): 0.5}, "val": {6: {1: (3.0, 0.1, -0.9)}}}
    assert json.loads(json.dumps(bench.plain(res))) == {"warp": {"OT-CFM 6": 0.5}, "val": {"6": {"1": [3.0, 0.1, -0.9]}}}


def test_mode_count_samples_move_exactly_the_asked_points_and_cost_w2():
    import torch

    from sinkflow import config, data
    from sinkflow.ot import w2

    counts = load("w2_mode_counts")
    gen = torch.Generator().manual_seed(0)
    moved = counts.labels_with_moves(1024, 8, gen)
    assert int((moved != torch.arange(1024) % 8).sum()) == 8  # each moved point lands on another mode
    _, target = data.distributions(config.resolve("8gaussians"))
    test = target.test_set(1024, seed=2000)
    exact_x = counts.exact_sample(target, torch.arange(1024) % 8, torch.Generator().manual_seed(1))
    iid_x = counts.exact_sample(target, torch.randint(0, 8, (1024,), generator=gen), torch.Generator().manual_seed(1))
    assert counts.imbalance(target, exact_x) <= 4 < 20 < counts.imbalance(target, iid_x)  # nearest-centre counts
    assert w2(exact_x, test) < 0.2 < 0.4 < w2(iid_x, test)  # the floor (~0.14) vs multinomial mode counts (~0.7)


# ---- smoke tests: each script's main path at tiny sizes on the CPU ---------------------------------------------


def test_smoke_digits(quiet, capsys, monkeypatch):
    bench = load("digits")
    monkeypatch.setattr(bench, "ProcessPoolExecutor", InProcessPool)
    out_dir = quiet / "bench-digits"
    bench.main(["--smoke", "--train-seeds", "0", "--seeds", "1", "--nfe", "3", "--baselines", "otcfm",
                "--out", str(out_dir)])
    out = capsys.readouterr().out
    assert "## digits benchmark (smoke)" in out and "| method | NFE | pixel W2 ↓ |" in out
    nsgf = rows(out, "| NSGF++ (1 NSGF + 1 t̂ + rest NSF) | 3 |")  # the preset's split (1 + 1 + 1) is the budget
    ref = rows(out, "| OT-CFM (Euler 4) | 4 |")  # --smoke's reference row (100 steps in a real run)
    assert len(nsgf) == 1 and len(ref) == 1 and len(rows(out, "| OT-CFM (Euler 3, time_warp ")) == 1
    w2, tv, conf = (float(cell.split("±")[0]) for cell in nsgf[0].split("|")[3:6])
    assert 0 < w2 < 50 and 0 <= tv <= 1 and 0 < conf <= 1
    assert re.search(r"NFE 3: NSGF\+\+ better than OT-CFM \(uniform Euler\) on [0-3] of 3", out)
    saved = json.loads((out_dir / "results.json").read_text())
    assert saved["train_seeds"] == [0] and set(saved["per_seed"][0]["scores"]["OT-CFM"]) == {"3", "4"}
    assert all((out_dir / "seed0" / f"{m}_grid.png").stat().st_size > 0 for m in ("nsgfpp", "otcfm"))


def test_smoke_flow_bpd(quiet, capsys):
    bench = load("flow_bpd")
    bench.main_cli(["--iters", "2", "--ckpt-every", "1", "--runs-dir", str(quiet / "runs"), "--json",
                    str(quiet / "bpd.json"), "--samples", str(quiet / "samples.png"), "model.flow.depth_per_level=1",
                    "model.flow.hidden_channels=8", "train.flow.batch_size=8"])
    out = capsys.readouterr().out
    row = rows(out, "| flow-digits, memory standard |")
    assert len(row) == 1 and "| 2 (8) |" in row[0]
    uniform = rows(out, "| uniform density |")[0]
    assert f"**{math.log2(17):.3f}**" in uniform  # 17 levels per pixel: log2(17) bits/dim, a check on the table
    result = json.loads((quiet / "bpd.json").read_text())["results"][0]
    assert result["selected_step"] in (1, 2) and [c["step"] for c in result["val_curve"]] == [1, 2]
    assert 0 < result["test_bpd"] < 2 * math.log2(17) and math.isfinite(result["val_bpd"])
    assert (quiet / "samples.png").stat().st_size > 0


def test_smoke_flow_digits_ablation(quiet, capsys):
    bench = load("flow_digits_ablation")
    best = bench.main(['{"name": "tiny", "steps": 2, "every": 1, "hidden": 8, "depth": 1, "warm": 1, "bs": 8}'])
    step, train_bpd, val_bpd = best["tiny"]
    assert step in (1, 2) and math.isfinite(train_bpd) and 0 < val_bpd < 10
    assert rows(capsys.readouterr().out, "RESULT tiny best ")
    with pytest.raises(SystemExit) as exc:  # --help was parsed as a JSON spec: a JSONDecodeError traceback
        bench.main(["--help"])
    assert exc.value.code == 0 and "JSON run spec" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        bench.main(['{"name": "a"}', "steps=3"])  # checked before the first run trains
    assert exc.value.code == 2 and "is not a JSON run spec" in capsys.readouterr().err


def test_smoke_flow_memory(quiet, capsys):
    bench = load("flow_memory")
    args = ["--depths", "1", "2", "--shape", "1", "8", "8", "--batch", "2", "--hidden", "4", "--levels", "1",
            "--repeats", "1", "--no-memcnn", "--clock", "cpu", "--device", "cpu"]
    bench.main([*args, "--out", str(quiet / "mem.png"), "--json", str(quiet / "mem.json")])
    out = capsys.readouterr().out
    saved = {(r["depth"], r["mode"]): r["saved_bytes"] for r in json.loads((quiet / "mem.json").read_text())["rows"]}
    assert set(saved) == {(d, m) for d in (1, 2) for m in ("standard", "checkpoint", "invertible")}
    assert saved[2, "invertible"] < saved[2, "standard"]  # what the benchmark shows: recomputation saves memory
    assert "| depth | mode | saved MiB |" in out and len(rows(out, "| 2 | ")) == 3
    assert rows(out, "depth 2: step time vs standard: invertible ")
    bench.main(["--from-json", str(quiet / "mem.json"), "--out", str(quiet / "again.png")])  # redraw only
    assert rows(capsys.readouterr().out, "| 2 | invertible |") == rows(out, "| 2 | invertible |")
    assert (quiet / "mem.png").stat().st_size > 0 and (quiet / "again.png").stat().st_size > 0


def test_smoke_gpu_checks(quiet, capsys):
    """The checks' code on the CPU (device_generator is the CPU generator there, fused Adam torch's CPU kernel)."""
    load("gpu_checks").main(["--device", "cpu", "--smoke"])
    out = capsys.readouterr().out
    dx, dv = (float(v) for v in re.search(r"max\|dx\| (\S+)  max\|dv\| (\S+)", out).groups())
    assert dx <= 1e-6 and dv <= 1e-5  # one pool batch at a time or all in flight: the same pool
    assert "device noise reproducible from the CPU state: True" in out
    assert float(re.search(r"Adam, 3 steps: max\|dw\| (\S+)", out).group(1)) < 1e-5
    assert float(re.search(r"drawn ahead vs inline, 6 steps: max\|dw\| ([0-9.e+-]+)", out).group(1)) == 0.0
    assert re.search(r"same permutation 3/3, max matched-cost difference 0.00e\+00", out)
    graphs = re.findall(r"step graph vs plain step, (.+?), 6 steps: max\|dw\| (\S+?)[;,]", out)
    assert [g[0] for g in graphs] == ["moons otcfm fp32 +prefetch +ema", "mnist-shaped fm bf16 UNet",
                                  "mnist-shaped fm fp16 UNet"]
    assert all(float(dw) == 0.0 for _, dw in graphs)  # on the CPU the graph's path runs eagerly: the same step
    assert re.search(r"2 captured phases in one process with batches drawn ahead: all finished, 0 replays; plain "
                     r"streams equal to a capture stream: 0", out)  # CPU: nothing captured
    assert "allocated after each phase's release: not measured on the CPU" in out
    fresh, loop = (float(v) for v in re.search(r"fresh copy \|dnll\| (\S+), fused vs for-loop \|dnll\| (\S+)", out).groups())
    assert fresh < 1e-5 and loop < 1e-3  # with the old version-keyed W cache: 0.17 apart on both
    # graph=auto is the plain step on a CPU: nothing captured, nothing to fall back from (tests/test_step_graph.py)
    assert "a host read in the forward under graph=auto, 6 fp16 steps: ended on the plain step; 0 fall-back " \
           "warning(s); weights finite: True; max|dw| vs graph=none 0.00e+00" in out
    # a torchrun job's split step, in a group of one: on the CPU both paths run eagerly, the same step
    assert "split step (backward graph, all-reduce, update graph) vs one graph, 6 fp16 steps in a process group of " \
           "one: max|dw| 0.00e+00; replays 0 (one graph: 0); gradients all-reduced: True" in out


def test_gpu_checks_runs_only_the_named_checks(quiet, capsys):
    """A short device call names the checks it needs: the others do not run."""
    load("gpu_checks").main(["--device", "cpu", "--smoke", "--checks", "noise", "ot_plan"])
    out = capsys.readouterr().out
    assert "device noise reproducible" in out and "same permutation" in out
    assert "pool in_flight" not in out and "step graph" not in out and "invertible Glow" not in out


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="the CUDA half of gpu_checks needs a GPU")
def test_smoke_gpu_checks_on_cuda(quiet, capsys):
    load("gpu_checks").main(["--device", "cuda", "--smoke"])
    out = capsys.readouterr().out
    assert "device noise reproducible from the CPU state: True" in out
    assert "with host syncs made errors" in out
    assert float(re.search(r"max\|dv\| (\S+)", out).group(1)) < 1e-3
    # the capture of a forward with a host read fails; graph=auto trains on without the graph, saying so once
    assert re.search(r"under graph=auto, 6 fp16 steps: ended on the plain step; 1 fall-back warning\(s\): .*"
                     r"weights finite: True", out), out


def test_smoke_memory_estimate(quiet, capsys):
    bench = load("memory_estimate")
    bench.main(["--presets", "mnist", "--out", str(quiet / "estimate.md")])
    out = capsys.readouterr().out
    phases = rows(out, "| mnist | ")
    assert {line.split("|")[2].strip() for line in phases} >= {"pool", "velocity", "nsf"}
    assert all("pending (GPU)" in line for line in phases)  # CPU: estimates only, no measured column
    assert (quiet / "estimate.md").read_text().count("| mnist | ") == len(phases) // 2  # printed as it goes + table
    # the plan names its card and precision: with none named `auto` trains fp32, about twice a half-precision plan's
    # activations (the velocity phase 955 MiB vs 523 MiB for an H100; once printed with no precision at all)
    title = rows(out, "Memory estimate vs measured peak on CPU (estimates only)")[0]
    assert "planned for no named card" in title and "(fp32; the precision column)" in title
    assert "| preset | phase | precision | estimate |" in out

    def planned(text):
        cells = (line.split("|") for line in rows(text, "| mnist | "))
        return {c[2].strip(): (c[3].strip(), numbers(c[4])[0]) for c in cells}

    bench.main(["--presets", "mnist", "--gpu", "H100"])  # the card preflight --gpu H100 plans for
    h100 = capsys.readouterr().out
    assert "planned for H100-80GB" in h100 and "(fp16 where the network has a half-precision path" in h100
    fp32, fp16 = planned(out)["velocity"], planned(h100)["velocity"]
    assert fp32[0] == "fp32" and fp16[0] == "fp16" and fp16[1] < 0.6 * fp32[1]  # both in MiB
    with pytest.raises(SystemExit):
        bench.main(["--presets", "mnist", "--gpu", "V100"])  # not a card the planner knows
    assert "--gpu: unknown GPU 'V100'; use one of T4," in capsys.readouterr().err


def test_memory_estimate_measures_a_phase_above_what_was_there_and_through_its_capture(quiet, monkeypatch):
    """A training row is the phase's own peak: above what the scratch run's earlier phases left allocated (on an H200
    the nsf row read 130 MiB over the velocity row of the same network, the time row 312 MiB) and over a window that
    holds the step graph's capture, the one step whose activations the allocator sees (a replay allocates nothing:
    a window of replays read the mnist velocity phase at 150 MiB, its weights, moments and workspaces). The CUDA
    counters are stubbed by a meter: 1000 bytes left by earlier phases, 7 for the trainer, 20 of transients an eager
    step frees, 50 allocated in the capture's pool; the real train_step runs on the CPU."""
    import torch

    from sinkflow import config
    from sinkflow.engine.step_graph import WARMUP
    from sinkflow.engine.trainer import Trainer
    from sinkflow.tools import phases

    bench = load("memory_estimate")
    meter = {"now": 1000, "peak": 1000, "steps": 0}

    def rise(n):
        meter["peak"] = max(meter["peak"], meter["now"] + n)

    real_ready, real_step = phases.ready_trainer, Trainer.train_step

    def ready(run, task):
        trainer = real_ready(run, task)
        meter["now"] += 7
        rise(0)
        return trainer

    def train_step(self, batch):
        out = real_step(self, batch)
        meter["steps"] += 1
        rise(50 if meter["steps"] == WARMUP + 1 else 20 if meter["steps"] <= WARMUP else 0)
        return out

    monkeypatch.setattr(phases, "ready_trainer", ready)
    monkeypatch.setattr(Trainer, "train_step", train_step)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: meter["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: meter["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: meter.update(peak=meter["now"]))
    cfg = config.resolve("digits", ["experiment.method=fm", "train.velocity.batch_size=8"], {"device": "cpu"})
    assert bench.measure_train(cfg, "velocity", torch.device("cpu"), quiet / "scratch") == 7 + 50
    assert meter["steps"] == WARMUP + 4


def test_memory_estimate_measures_every_phase_kind_the_planner_gives(quiet, capsys, monkeypatch):
    """On a CUDA card the pool row is measured: the planner calls the pool kind "chunked", and a test of
    ``kind == "pool"`` left it "not measured" on every GPU run. The measuring functions and the card are stubbed, so
    the dispatch runs here; a kind the script does not know stops it rather than leaving a row unmeasured."""
    import torch

    from sinkflow.tools.memory_plan import PhaseMemory

    bench = load("memory_estimate")
    measured = []

    def fake(cfg, phase, *rest):
        measured.append(phase)
        return 100 * 2**20

    monkeypatch.setattr(bench, "measure_pool", fake)
    monkeypatch.setattr(bench, "measure_train", fake)
    monkeypatch.setattr(bench, "bf16_tensor_cores", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a stubbed card")
    monkeypatch.setattr(bench, "checked_device", torch.device)  # the card is stubbed: --device cuda passes its check
    bench.main(["--device", "cuda", "--presets", "mnist"])
    out = capsys.readouterr().out
    assert measured == ["pool", "velocity", "nsf", "time"]
    pool, sample = rows(out, "| mnist | pool |"), rows(out, "| mnist | sample+eval |")  # each printed, then tabled
    assert len(pool) == len(sample) == 2 and all("| 100.00 MiB |" in line for line in pool)
    assert all("| not measured |" in line for line in sample)  # the sampling estimate is not validated
    assert all("| sample+eval | fp16 |" in line for line in sample)  # the sampler's precision on the card, as planned
    assert "on a stubbed card" in out and "planned for this card" in out
    for pm in (PhaseMemory("warp", "mystery"), PhaseMemory("cache", "chunked")):  # a new kind, a new chunked task
        with pytest.raises(SystemExit, match=f"phase {pm.phase} has kind {pm.kind}, which this script cannot measure"):
            bench.measurer(pm)


def small_energy(mp, bench) -> None:
    """The energy column at a smoke test's size: 2 draws of 256 points a model (the protocol's 20 of 4,096, and the
    floor's 12 of 4,096, were 60 of the suite's seconds in nsgf_2d's and nsgf_suite's smoke tests). Set where the
    scripts read it: their own names and ``scoring``'s (which counts the draws a kept result needs)."""
    for module in (bench, bench.scoring):
        mp.setattr(module, "ENERGY_N", 256)
        mp.setattr(module, "ENERGY_SEEDS", 2)


@pytest.fixture(scope="module")
def runs_2d(tmp_path_factory):
    """nsgf_2d at a tiny budget (NSGF and OT-CFM on 8gaussians): its output, and the run folders it keeps."""
    import contextlib
    import io

    folder = tmp_path_factory.mktemp("nsgf2d")
    bench = load("nsgf_2d")
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        small_energy(mp, bench)
        mp.chdir(folder)
        mp.setattr(bench, "ProcessPoolExecutor", InProcessPool)
        bench.main(["--tasks", "8gaussians", "--methods", "nsgf", "otcfm", "--seeds", "1", "--iters", "2",
                    "--eval-seeds", "1", "--iid-seeds", "2", "--eval-n", "64", "--runs-dir", str(folder / "runs"), "pool.batches=1",
                    "pool.batch_size=64", "model.velocity.hidden=16", "train.velocity.batch_size=16"])
    return bench, folder / "runs", out.getvalue()


def test_smoke_nsgf_2d(runs_2d, quiet, capsys, monkeypatch):
    bench, runs, out = runs_2d
    small_energy(monkeypatch, bench)  # as the fixture scored: the kept runs are scored again below
    assert ("| target | steps | W2 iid floor (one draw) | NSGF (W2 iid) | OT-CFM (W2 iid) | energy iid floor (one draw) "
            "| NSGF (energy iid) | OT-CFM (energy iid) | W2 qmc floor (one draw) | NSGF (W2 qmc) | OT-CFM (W2 qmc) | "
            "paper NSGF (W2 qmc) | NSGF pool + train s (mean) |") in out
    for steps in (10, 100):
        cells = [c.replace("*", "").replace("†", "").split() for c in rows(out, f"| 8gaussians | {steps} |")[0].split("|")]
        w2_cells = [float(c[0]) for c in cells[3:6] + cells[9:13]]  # floors, NSGF, OT-CFM, paper
        assert all(0 < v < 20 for v in w2_cells) and abs(float(cells[7][0])) < 20
    for label in ("W2 iid", "energy iid", "W2 qmc"):
        assert f"{label}: NSGF <= OT-CFM (means) on " in out
    kept = json.loads((runs / "8gaussians-nsgf-s0" / "bench.json").read_text())
    assert kept["eval_n"] == 64 and len(kept["scores"]["iid"]["100"]) == 2 and len(kept["scores"]["qmc"]["10"]) == 1
    assert kept["w2_10"] == kept["scores"]["qmc"]["10"][0]
    del kept["scores"]["energy"]  # a result file of an older version of the script: scored again, not retrained
    (runs / "8gaussians-nsgf-s0" / "bench.json").write_text(json.dumps(kept))
    results = quiet / "RESULTS.md"  # --write, into a copy: never benchmarks/RESULTS.md
    results.write_text("# Benchmark results\n\nbefore\n<!-- nsgf_2d:begin -->\nstale table\n<!-- nsgf_2d:end -->\nafter\n")
    monkeypatch.setattr(bench, "RESULTS", results)
    monkeypatch.setattr(bench, "ProcessPoolExecutor", InProcessPool)
    kept_dir = quiet / "scores"
    bench.main(["--tasks", "8gaussians", "--methods", "nsgf", "otcfm", "--seeds", "1", "--eval-seeds", "1",
                "--iid-seeds", "2", "--eval-n", "64", "--runs-dir", str(runs), "--collect", "--write", "--keep", str(kept_dir)])
    again = capsys.readouterr().out  # --collect: nothing retrained, the kept results tabulated again
    assert rows(again, "| 8gaussians | ") == rows(out, "| 8gaussians | ")
    # the protocol line names what the runs were trained with (their config.yaml), not this command's --iters
    # default: it read "20000 steps, batch 256" for these 2-step, batch-16 runs
    assert "Protocol: training seeds [0], 2 steps, batch 16." in again
    # --keep: the scores alone (no checkpoints, no pool) make the same table once the run folders are gone
    assert sorted(p.relative_to(kept_dir).as_posix() for p in kept_dir.rglob("*") if p.is_file()) == [
        f"8gaussians-{m}-s0/{f}" for m in ("nsgf", "otcfm") for f in ("bench.json", "config.yaml", "meta.json")]
    bench.main(["--tasks", "8gaussians", "--methods", "nsgf", "otcfm", "--seeds", "1", "--eval-seeds", "1",
                "--iid-seeds", "2", "--eval-n", "64", "--runs-dir", str(kept_dir), "--collect"])
    assert rows(capsys.readouterr().out, "| 8gaussians | ") == rows(out, "| 8gaussians | ")
    # a new machine (no run folders) given the same --keep trains nothing that is kept, and says so if it is asked
    # for draws the kept scores lack (their model is not there to score again)
    fresh = quiet / "new-machine"
    bench.main(["--tasks", "8gaussians", "--methods", "nsgf", "otcfm", "--seeds", "1", "--eval-seeds", "1",
                "--iid-seeds", "2", "--eval-n", "64", "--runs-dir", str(fresh), "--keep", str(kept_dir)])
    assert rows(capsys.readouterr().out, "| 8gaussians | ") == rows(out, "| 8gaussians | ")
    assert not list(fresh.rglob("*.pt")) and not list(fresh.glob("*/checkpoints"))
    with pytest.raises(RuntimeError, match="kept scores lack .* and its model is not in"):
        bench.main(["--tasks", "8gaussians", "--methods", "nsgf", "--seeds", "1", "--eval-seeds", "2",
                    "--iid-seeds", "2", "--eval-n", "64", "--runs-dir", str(fresh), "--keep", str(kept_dir)])
    text = results.read_text()
    assert "before" in text and "after" in text and "stale table" not in text and "| 8gaussians | 100 |" in text


def test_smoke_w2_mode_counts(runs_2d, quiet, capsys):
    _, runs, _ = runs_2d
    load("w2_mode_counts").main(["--n", "64", "--draws", "2", "--runs", str(runs / "8gaussians-nsgf-s0")])
    out = capsys.readouterr().out
    assert rows(out, "| moved 0 | 0.0 |")  # a stratified draw of the exact target has no imbalance
    assert len(rows(out, "| moved ")) == 5 and len(rows(out, "| multinomial |")) == 1
    trained = [line for line in out.splitlines() if "8gaussians-nsgf-s0 |" in line]
    assert [line.split("|")[2].strip() for line in trained] == ["10", "100"]
    assert all(len(line.split("|")[3].split(",")) == 3 for line in trained)  # one imbalance per sampling seed


def test_smoke_ot_memory(quiet, capsys):
    load("ot_memory").main(["--cases", "1,16,2", "1,32,784"])
    table = rows(capsys.readouterr().out, "| cpu |")
    assert len(table) == 2
    assert all(0 < float(line.split("|")[-2]) <= 1 for line in table)  # measured peak never above the estimate


def test_smoke_pool_build(quiet, capsys):
    load("pool_build").main(["--device", "cpu", "--batches", "2", "--ref-batches", "1", "--steps", "2", "--n2d", "16",
                             "--nimg", "8", "--repeats", "1"])
    out_rows = rows(capsys.readouterr().out, ("| 2d |", "| mnist-shaped |"))
    assert len(out_rows) == 2
    for line in out_rows:
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert float(cells[10].rstrip("x")) > 0 and float(cells[11]) <= 1e-4 * float(cells[12])  # same velocities


def test_smoke_sampling(quiet, capsys):
    load("sampling").main(["--smoke", "--device", "cpu", "--batches", "2", "--nfe", "3"])
    out = capsys.readouterr().out
    assert " batch  NFE  fp32 img/s   bf16   fp16  bf16+CL" in out and "cudnn.benchmark off" in out
    batch, nfe, bf16, fp16, channels_last = numbers(rows(out, "     2 ")[0])
    assert (batch, nfe) == (2, 3) and bf16 > 0 and fp16 > 0 and channels_last > 0  # NFE as counted by the hooks


def test_smoke_sinkhorn_solver(quiet, capsys):
    bench = load("sinkhorn_solver")
    bench.main(["--batches", "1", "--n", "16", "--progress", "0.5", "--blur", "0.5"])
    table = rows(capsys.readouterr().out, "| 50% |")
    assert len(table) == len(bench.ROWS)
    rel = [float(line.split("|")[5]) for line in table]
    assert all(math.isfinite(r) for r in rel) and rel[-1] < min(0.01, rel[0])  # converged beats one GeomLoss pass


def test_sinkhorn_solver_times_each_row_after_a_first_call(quiet, capsys, monkeypatch):
    """Each row was one cold call: a slow first call (GeomLoss's, the first row's) was in its entries/s."""
    import time as clock

    bench = load("sinkhorn_solver")
    calls, real = [], bench._velocity_flat

    def first_call_slow(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            clock.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "_velocity_flat", first_call_slow)
    bench.main(["--batches", "1", "--n", "16", "--progress", "0.5", "--blur", "0.5"])
    first = rows(capsys.readouterr().out, "| 50% |")[0]
    assert "GeomLoss, scaling 0.9" in first and float(first.split("|")[6].replace(",", "")) > 100  # 16 a second


def test_smoke_loss_curve(quiet, capsys):
    """On a CPU `auto` resolves to fp32 eager, so the default's curve is fp32 seed 0's own: inside at every step,
    paired difference 0. fp16 (CPU autocast) is judged beside it. The band test itself: a value outside the
    widened band is flagged; the paired view subtracts fp32's run at the same seed."""
    bench = load("loss_curve")
    saved = quiet / "curves.jsonl"
    bench.main(["--smoke", "--device", "cpu", "--steps", "8", "--log-every", "4", "--candidates", "default", "fp16",
                "--candidate-seeds", "2", "--save", str(saved)])
    out = capsys.readouterr().out
    table = [line.split() for line in out.splitlines() if line.strip().split(" ")[0].isdigit()]
    assert [int(r[0]) for r in table] == [4, 8] and all(r[4] == "yes" for r in table)
    assert all(float(r[1]) <= float(r[3]) <= float(r[2]) for r in table)  # seed 0 is one of the band's seeds
    assert "default: inside the fp32 band (widened by half its width): 2 of 2 log steps" in out
    assert "default: per seed +0.00000 +0.00000, mean +0.00000" in out
    assert re.search(r"fp16: per seed [+-]\S+ [+-]\S+, mean [+-]\S+; fp32 over 2 seeds", out)
    # the saved runs judged again (as two device calls' runs are): the same table and paired view
    bench.main(["--load", str(saved)])
    again = capsys.readouterr().out
    def judged(text):  # the table and the paired view: below the header line, above the timings
        return text.split("loss_curve:", 1)[1].split("\n", 1)[1].split("seconds per run")[0]

    assert "runs of" in again and judged(again) == judged(out)
    ref = [[(1, 1.0), (2, 0.5)], [(1, 1.2), (2, 0.6)]]
    rows = bench.compare(ref, [(1, 1.25), (2, 0.7)])
    assert [r["inside"] for r in rows] == [True, False]  # 1.25 <= 1.2 + 0.1; 0.7 > 0.6 + 0.05
    p = bench.paired(ref, {1: [(1, 1.3), (2, 0.7)]}, late=1)  # seed 1 is paired with fp32 seed 1
    assert p["diffs"] == pytest.approx([0.1]) and p["ref_range"] == pytest.approx(0.1)
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--device", "cpu", "--seeds", "2", "--candidate-seeds", "3"])


def test_smoke_train_throughput(quiet, capsys):
    import torch

    bench = load("train_throughput")
    bench.main(["--smoke", "--device", "cpu", "--batch", "2", "--steps", "1", "--warmup", "1", "--profile", "fast"])
    out = capsys.readouterr().out
    ref = "" if "torchcfm not importable" in out else "  vs torchcfm"  # without torchcfm: no row, no column
    assert f"{'path':<29}     params   images/s  vs fp32-eager{ref}  % bf16 peak" in out
    assert "cudnn.benchmark off" in out  # as sinkflow's runner: the measured step is the user's
    base, fast, cl = rows(out, "fp32-eager "), rows(out, "fast "), rows(out, "fast+CL ")
    graph = rows(out, "fast+stepgraph ")
    assert len(base) == 1 and len(fast) == 1 and len(cl) == 1 and len(graph) == 1 and base[0].split()[-3] == "1.00x"
    assert all(float(r[0].split()[-3].rstrip("x")) > 0 for r in (fast, cl, graph))
    # a smoke run is labelled as no measurement (1 warm-up step: its ratios move with the warm-up alone), and a CPU
    # has no bf16 peak: no row shows a share of one (they once read 27-52 % of a peak printed as 0 TFLOP/s)
    assert "SMOKE CHECK, not a measurement" in out
    assert "% bf16 peak n/a: no measured bf16 matrix-product peak, none off CUDA" in out and "TFLOP/s" not in out
    torchcfm = rows(out, "torchcfm ")
    assert all(r.split()[-1] == "n/a" for r in (*base, *fast, *cl, *graph, *torchcfm))
    assert (not torchcfm) if not ref else math.isfinite(float(torchcfm[0].split()[-3].rstrip("x")))
    # --profile: the kernels (here CPU ops) of the named path, convolutions among them
    assert "where the time of a fast step goes" in out and "conv" in out.split("where the time of")[1]
    cfg = bench.train_config(7, precision="bf16", channels_last=True, compile_=False)  # the schema's own keys
    assert cfg["train"]["velocity"]["iters"] == 7 and cfg["train"]["velocity"]["precision"] == "bf16"
    # --paths: the named paths beside the baseline (and torchcfm's step), no others; an unknown name is refused
    bench.main(["--smoke", "--device", "cpu", "--batch", "2", "--steps", "1", "--warmup", "1", "--paths", "fast+CL"])
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.split()[1:2] and
             line.split()[1].replace(",", "").isdigit()]
    assert names == ["fp32-eager", "fast+CL", *(["torchcfm"] if ref else [])]
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--device", "cpu", "--paths", "fast+CL+compile+stepgraph"])  # needs --compile
    # --repeats: every path timed again in turn after all warm-ups, the median shown with the range; cuDNN's timing
    # is a path's own setting (the +cudnn path: on, whatever --cudnn-benchmark says), set again before its windows
    flags = []
    real_time = bench.time_steps
    bench.time_steps = lambda *a: flags.append(torch.backends.cudnn.benchmark) or real_time(*a)
    try:
        bench.main(["--smoke", "--device", "cpu", "--batch", "2", "--steps", "1", "--warmup", "1", "--paths", "fast",
                    "--repeats", "3"])
    finally:
        bench.time_steps = real_time
    out = capsys.readouterr().out
    assert "the median of 3 windows a path taken in turn" in out and "  range" in out
    assert len(rows(out, "fast ")) == 1 and rows(out, "fast ")[0].endswith("(cpu)")
    assert len(flags) == 3 * (2 + bool(ref)) and not any(flags)  # fp32-eager, fast (and torchcfm), 3 windows each
    assert "fp16+compile+stepgraph+cudnn" in dict(bench.path_configs(True))
    assert dict(bench.path_configs(True))["fp16+compile+stepgraph+cudnn"]["cudnn"] is True


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="fused Adam's on-device skip needs a GPU")
def test_smoke_train_throughput_on_cuda(quiet, capsys):
    """On CUDA the Trainer's Adam is fused and skips non-finite steps on the device; the fp32-eager row swaps in a
    for-loop Adam, which must then be checked on the host (the CPU run never takes that path)."""
    load("train_throughput").main(["--smoke", "--device", "cuda", "--batch", "2", "--steps", "2", "--warmup", "1"])
    out = capsys.readouterr().out
    assert rows(out, "fp32-eager ")[0].split()[-3] == "1.00x" and math.isfinite(
        float(rows(out, "fast ")[0].split()[-3].rstrip("x")))


def test_smoke_preset_throughput(quiet, capsys):
    """OT-CFM (its exact OT pairs drawn on the prefetch thread) and NSGF++ (a row for each UNet phase); FM's row
    is OT-CFM's code path. The same seed gives both configs the same batches, so the timed loss must agree."""
    load("preset_throughput").main(["--smoke", "--device", "cpu", "--configs", "baseline", "+prefetch",
                                    "+stepgraph-nocompile", "--methods", "otcfm", "nsgfpp", "--steps", "2", "--warmup", "0",
                                    "--phases", "velocity", "nsf", "time",
                                    "--profiler-first"])  # the profiler opened (and closed) once first
    out = capsys.readouterr().out
    assert "method  phase     config                     steps/s  x base  wait %  busy %  % peak     loss  draw ms" in out
    table = {tuple(line.split()[:3]): line.split() for line in out.splitlines()
             if line.startswith(("otcfm ", "nsgfpp "))}
    assert set(table) == {(m, p, c) for m, p in [("otcfm", "velocity"), ("nsgfpp", "velocity"), ("nsgfpp", "nsf"),
                                                 ("nsgfpp", "time")] for c in ("baseline", "+prefetch",
                                                                               "+stepgraph-nocompile")}
    for (method, phase, name), cells in table.items():
        assert float(cells[3]) > 0 and float(cells[4].rstrip("x")) > 0
        assert name != "baseline" or cells[4] == "1.00x"  # ratios to the baseline of the same phase and run
        assert float(cells[-2]) == pytest.approx(float(table[method, phase, "baseline"][-2]), rel=1e-5)
        # the worker's draw time: only where batches are drawn ahead (prefetch auto: inline on a CPU)
        assert (cells[-1] == "-") == (name != "+prefetch") and (name != "+prefetch" or float(cells[-1]) > 0)


def test_preset_throughput_times_a_torchrun_jobs_split_step_in_a_group_of_one(quiet, capsys, monkeypatch):
    """``fp16+stepgraph+split`` runs the phase inside a process group of one, where the trainer averages the
    captured step's gradients between two graphs (grad_sync.py): the row trains what the one-graph row trains, the
    gradients went through the all-reduce, and the group is gone afterwards."""
    import torch.distributed as tdist

    from sinkflow.engine import grad_sync

    synced = []
    real = grad_sync.GradSync.__call__
    monkeypatch.setattr(grad_sync.GradSync, "__call__", lambda self, *loss: synced.append(1) or real(self, *loss))
    load("preset_throughput").main(["--smoke", "--device", "cpu", "--configs", "fp16+stepgraph", "fp16+stepgraph+split",
                                    "--methods", "fm", "--steps", "2", "--warmup", "0"])
    out = capsys.readouterr().out
    rows = {line.split()[2]: line.split() for line in out.splitlines() if line.startswith("fm ")}
    assert set(rows) == {"fp16+stepgraph", "fp16+stepgraph+split"}
    assert rows["fp16+stepgraph"][-2] == rows["fp16+stepgraph+split"][-2]  # the same loss: the same step
    assert len(synced) >= 2 and not tdist.is_initialized()


def test_preset_throughput_ratios_are_to_the_base_row_of_the_same_repeat(quiet, capsys, monkeypatch):
    """With --repeats the second repeat's rows were divided by the first repeat's base row (its own base row read
    1.25x here); each repeat's base row is 1.00x now, and the header names the row the ratios are to."""
    bench = load("preset_throughput")
    rate = iter([4.0, 8.0, 5.0, 10.0])  # repeat 1: base 4, candidate 8; repeat 2: base 5, candidate 10
    monkeypatch.setattr(bench, "measure", lambda *a, **k: [{"phase": "velocity", "steps_per_s": next(rate),
                                                            "wait_fraction": 0.0, "loss": 1.0}])
    bench.main(["--smoke", "--device", "cpu", "--methods", "fm", "--configs", "+prefetch", "baseline",
                "--repeats", "2"])
    out = capsys.readouterr().out
    assert "x base = steps/s over the +prefetch row of the same method, phase and repeat" in out
    timed = [line.split()[4] for line in out.splitlines() if line.startswith("fm ") and "(range" not in line]
    assert timed == ["1.00x", "2.00x"] * 2  # the old code: 1.00x, 2.00x, 1.25x, 2.50x


def test_preset_throughput_summary_takes_medians_of_interleaved_runs_and_otcfm_over_fm():
    bench = load("preset_throughput")
    text = bench.summary({("fm", "velocity", "default"): [90.0, 140.0, 100.0],
                          ("otcfm", "velocity", "default"): [80.0, 95.0, 104.0]})
    lines = text.splitlines()
    assert lines[0] == "median over 3 interleaved runs:"
    assert "100.00 steps/s (range 90.0-140.0)" in lines[1] and "otcfm / fm" not in lines[1]
    assert lines[2].split()[3] == "95.00" and lines[2].endswith("otcfm / fm 0.95")


def test_helper_suite2d(tmp_path):
    import numpy as np

    suite = load("suite2d")
    assert len(suite.FAMILIES) >= 8
    files = suite.write_suite(tmp_path, ["unequal", "8g-roll"])
    x = np.load(files["unequal"])
    assert x.shape == (suite.TRAIN_ROWS + suite.TEST_ROWS, 2) and x.dtype == np.float32
    assert np.array_equal(x, np.load(suite.write_suite(tmp_path / "again", ["unequal"])["unequal"]))
    # each training seed's own draw: another file of the same family, with its own finite-sample mode counts
    d1 = suite.write_suite(tmp_path, ["unequal"], draw=1)["unequal"]
    assert d1.name == "unequal-d1.npy" and np.array_equal(np.load(files["unequal"]), x)
    y = np.load(d1)
    assert y.shape == x.shape and not np.array_equal(x, y) and abs(x.mean() - y.mean()) < 0.1
    before = d1.stat().st_mtime_ns
    suite.write_suite(tmp_path, ["unequal"], draw=1)  # the same draw again is not rewritten (runs may be reading it)
    assert d1.stat().st_mtime_ns == before
    rng = np.random.default_rng(0)
    assert list(suite.counts([0.62, 0.31, 0.07], 1024, rng, stratified=True)) == [635, 317, 72]
    iid = [suite.counts([0.62, 0.31, 0.07], 1024, np.random.default_rng(s), False)[2] for s in range(20)]
    assert len(set(iid)) > 5 and abs(np.mean(iid) - 71.7) < 5  # multinomial: the small mode's count varies
    assert suite.FAMILIES["8g-roll"][0] == "8gaussians" and min(suite.FAMILIES["unequal"][1]) < 0.1
    # a file's own mode masses: one i.i.d. draw's, near the family's; a draw made with them has exactly those counts
    m = suite.file_masses("unequal", x[: suite.TRAIN_ROWS], reference=suite.labelled_reference("unequal", 20_000))
    assert abs(sum(m) - 1) < 1e-9 and max(abs(a - b) for a, b in zip(m, [0.62, 0.31, 0.07])) < 0.02
    _, lab = suite.sample_with_labels("unequal", 1000, seed=1, stratified=True, masses=[0.5, 0.25, 0.25])
    assert list(np.bincount(lab)) == [500, 250, 250]


@pytest.mark.slow
def test_smoke_nsgf_suite(tmp_path, monkeypatch):
    """One tiny NSGF and OT-CFM run of the suite's runner, scored under both protocols, and the verdict's counting."""
    monkeypatch.chdir(tmp_path)
    bench = load("nsgf_suite")
    small_energy(monkeypatch, bench)
    files = load("suite2d").write_suite(tmp_path / "suite", ["unequal"])
    tiny = ["pool.batches=2", "pool.batch_size=32", "pool.chunk=1", "eval.steps=[10, 100]"]
    results = [bench.one_run("unequal", str(files["unequal"]), m, 0, 4, str(tmp_path / "runs"), tiny, 1)
               for m in ("nsgf", "otcfm")]
    for r in results:
        assert set(r["scores"]) == {"iid", "qmc", "energy"}
        assert all(len(r["scores"][c]["10"]) == 1 for c in ("iid", "qmc", "energy"))
    done = tmp_path / "runs" / "unequal-nsgf-s0" / "bench.json"
    assert json.loads(done.read_text())["scores"] == results[0]["scores"]  # kept: a rerun is not retrained
    again = bench.one_run("unequal", str(files["unequal"]), "nsgf", 0, 4, str(tmp_path / "runs"), tiny, 1)
    assert again["train_s"] == results[0]["train_s"]
    # a result file missing a column (an older script's) is scored again, not retrained
    old = json.loads(done.read_text())
    del old["scores"]["energy"]
    done.write_text(json.dumps(old))
    rescored = bench.one_run("unequal", str(files["unequal"]), "nsgf", 0, 4, str(tmp_path / "runs"), tiny, 1)
    assert rescored["scores"] == results[0]["scores"] and rescored["train_s"] == results[0]["train_s"]
    # --keep on a new machine: the kept scores come back into the runs folder once, and are not trained again
    bench.scoring.keep(done, str(tmp_path / "kept"))
    elsewhere = tmp_path / "new-machine" / "unequal-nsgf-s0"
    assert bench.scoring.restore(elsewhere, str(tmp_path / "kept"))
    assert not bench.scoring.restore(elsewhere, str(tmp_path / "kept")) and not bench.scoring.restore(elsewhere, None)
    back = bench.one_run("unequal", str(files["unequal"]), "nsgf", 0, 4, str(elsewhere.parent), tiny, 1)
    assert back["scores"] == results[0]["scores"] and not (elsewhere / "checkpoints").exists()
    with pytest.raises(RuntimeError, match="kept scores lack"):  # other draws need the model, which is not there
        bench.one_run("unequal", str(files["unequal"]), "nsgf", 0, 4, str(elsewhere.parent), tiny, 2)
    rows = np.load(files["unequal"])
    fl = bench.floors("unequal", rows[-64:], pairs=2, train=rows[:200])
    assert fl["train_energy"][0] > -1 and fl["train_energy"] != fl["energy"]
    text = bench.table(results, ["unequal"], {"unequal": fl})
    assert "| unequal | 10 |" in text and "The training rows' own energy distance" in text
    assert "its training file's own mode masses" in text and fl["file_mass_qmc"][0] > 0
    d = bench.diagnose(tmp_path / "runs" / "unequal-nsgf-s0", "unequal", n=400, big_n=64)
    assert len(d[10]["mass"]) == len(d["true_mass"]) and abs(sum(d[100]["mass"]) - 1) < 1e-3 and 0 <= d[10]["off"] <= 1
    assert d["true_tail"][0] < d["true_tail"][1] and len(d[100]["tail"]) == 2 and d[10]["w2_4096"] > 0
    assert len(d[10]["beyond"]) == 2 and 1 >= d[10]["beyond"][0] >= d[10]["beyond"][1] >= 0
    # the model's training rows beside it: the file's own masses (one finite draw, near the family's)
    assert len(d["file_mass"]) == 3 and abs(sum(d["file_mass"]) - 1) < 1e-3 and d["file_mass"] != d["true_mass"]
    assert max(abs(a - b) for a, b in zip(d["file_mass"], d["true_mass"])) < 0.02 and len(d["file_beyond"]) == 2
    assert abs(d["true_spread"][0] - 0.6) < 0.01 and len(d[10]["spread"]) == 3
    pooled = bench.pooled([fl, {k: (v[0] + 1, v[1] + 1) for k, v in fl.items()}])
    assert pooled["iid"] == pytest.approx((fl["iid"][0] + 0.5, fl["iid"][1] + 0.5), rel=1e-12)  # (a + a + 1) / 2


def test_the_2d_tables_name_the_budget_their_runs_trained_with(tmp_path):
    """nsgf_2d's and nsgf_suite's protocol line: the steps and batch of the tabulated runs' config.yaml (one shared
    reader); the suite's printed its --iters (20000 by default, also under --collect) and a fixed batch 256."""
    import yaml

    budget = load("results_md").trained_budget
    for name, iters, batch in (("a", 4, 16), ("b", 4, 16), ("c", 8, 32)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text(yaml.safe_dump(
            {"train": {"velocity": {"iters": iters, "batch_size": batch}}}))
    assert budget([tmp_path / "a", tmp_path / "b"], 20000) == "4 steps, batch 16"
    assert budget([tmp_path / n for n in "abc"], 20000) == "steps / batch per run 4 / 16, 8 / 32"
    assert budget([tmp_path / "gone"], 20000) == "20000 steps (--iters; no config.yaml found), batch 256"


_RECORDED_RUNS: list = []


def _recorded_run(family, path, method, seed, iters, runs_dir, *rest):
    """Stands in for nsgf_suite.one_run (module level: InProcessPool pickles it): records the seed and the file it
    was given, and returns scores that differ by seed."""
    _RECORDED_RUNS.append((seed, Path(path).name))
    (Path(runs_dir) / f"{family}-{method}-s{seed}").mkdir(parents=True, exist_ok=True)
    cell = {"10": [0.1 + seed], "100": [0.2 + seed]}
    return {"family": family, "method": method, "seed": seed, "train_s": 1.0,
            "scores": {"iid": cell, "qmc": cell, "energy": cell}}


def test_nsgf_suite_gives_each_training_seed_its_own_draw(tmp_path, monkeypatch, capsys):
    """The suite's runner trains seed s on draw s of the family (the seed spread then includes the data's own noise),
    with ``--one-draw`` every seed on draw 0, and pools the floors over the draws it used. ``one_run`` (training and
    scoring, covered by test_smoke_nsgf_suite) is replaced by a recorder here."""
    monkeypatch.chdir(tmp_path)
    bench = load("nsgf_suite")
    monkeypatch.setattr(bench, "ProcessPoolExecutor", InProcessPool)
    floors, pooled, seen = bench.floors, [], _RECORDED_RUNS
    monkeypatch.setattr(bench, "floors", lambda *a, **k: floors(*a, **k, pairs=2))
    monkeypatch.setattr(bench, "pooled", lambda per_draw: pooled.append(len(per_draw)) or per_draw[0])

    monkeypatch.setattr(bench, "one_run", _recorded_run)
    for flag, seeds, files in (([], ["0", "1"], ["unequal.npy", "unequal-d1.npy"]),
                               (["--one-draw"], ["1"], ["unequal.npy"])):
        seen.clear(), pooled.clear()
        bench.main(["--families", "unequal", "--methods", "nsgf", "--seed-list", *seeds,
                    "--runs-dir", str(tmp_path / "runs"), *flag])
        out = capsys.readouterr().out
        assert seen == [(int(s), f) for s, f in zip(seeds, files)] and pooled == [len(set(files))]
        assert ("seed s on its own i.i.d. draw s" in out) == (not flag) and "| unequal | 100 |" in out
    # a run trained under the other protocol is refused before anything runs, not mixed into the table
    (tmp_path / "runs" / "unequal-nsgf-s1" / "config.yaml").write_text(
        yaml.safe_dump({"data": {"target": str(tmp_path / "runs" / "suite" / "unequal.npy")}}))
    seen.clear()
    with pytest.raises(SystemExit, match="unequal-nsgf-s1 was trained on unequal.npy, but this protocol gives its seed "
                                         "unequal-d1.npy"):
        bench.main(["--families", "unequal", "--methods", "nsgf", "--seed-list", "0", "1",
                    "--runs-dir", str(tmp_path / "runs")])
    assert seen == []


def test_helper_scoring():
    """The 2D tables' counting: wins on means, the largest gap, 100 steps worse than 10 beyond the seed spread, the
    floor marker only on W2 columns, and how many cells the exact distribution itself would win."""
    scoring = load("scoring")
    fake = [{"family": "a", "method": m, "seed": s, "scores": {"iid": {"10": [w10], "100": [w100]}}}
            for m, s, w10, w100 in [("nsgf", 0, 0.30, 0.33), ("nsgf", 1, 0.31, 0.34),
                                    ("otcfm", 0, 0.32, 0.31), ("otcfm", 1, 0.33, 0.32)]]
    v = scoring.verdict(fake, ["a"], "iid")
    assert v["wins"] == 1 and v["cells"] == 2 and abs(v["worst_gap"] - 0.02) < 1e-9 and v["finer_worse"] == ["a"]
    # 100 steps: NSGF 0.335 vs 0.315, behind by 0.02 against a standard error of 0.0071: a loss the seeds resolve
    assert v["behind_beyond_noise"] == ["a@100"]
    assert abs(scoring.standard_error([0.33, 0.34], [0.31, 0.32]) - 0.005 ** 0.5 / 10) < 1e-9
    noisy = [{**r, "scores": {"iid": {"10": r["scores"]["iid"]["10"], "100": [r["scores"]["iid"]["100"][0]
                                                                                 + (0.05 if r["seed"] else -0.05)]}}}
             for r in fake]  # the same means, a seed spread of 0.07: the 0.02 is inside the noise
    assert scoring.verdict(noisy, ["a"], "iid")["behind_beyond_noise"] == []
    assert scoring.standard_error([0.3], [0.2, 0.4]) == 0.0  # one seed: no estimate, every loss counts
    for r in fake:
        r["scores"]["qmc"] = r["scores"]["energy"] = r["scores"]["iid"]
    floors = {"a": {"iid": (0.315, 0.1), "qmc": (0.1, 0.01), "strat_vs_test": (0.2, 0.01), "energy": (0.4, 0.01)}}
    text = scoring.table(fake, ["a"], floors)
    rows = [line for line in text.splitlines() if line.startswith("| a |")]
    iid_nsgf, iid_otcfm = (rows[0].split("|")[4], rows[0].split("|")[5])  # 10 steps: 0.305 vs 0.325
    assert "†" in iid_nsgf and "†" not in iid_otcfm  # only the cell below the exact distribution's own score
    assert "†" not in rows[1].split("|")[4]  # NSGF at 100 steps: 0.335, above the floor
    assert "†" not in rows[0].split("|")[7]  # energy: 0 in expectation for the exact distribution, no marker
    # the exact distribution (floor 0.315) vs OT-CFM's 0.325 at 10 and 0.315 at 100 steps: <= on both
    assert scoring.exact_wins(fake, ["a"], floors, "iid") == {"wins": 2, "cells": 2}
    assert "would be <= OT-CFM on 2 of 2" in text and "(its expected score: the floor)" in text
    # scored on the models' own test draws where the floors have it: that one decides (0.32: loses at 100 steps)
    paired = {"a": {**floors["a"], "iid_paired": (0.32, 0.1)}}
    assert scoring.exact_wins(fake, ["a"], paired, "iid") == {"wins": 1, "cells": 2}
    assert "(scored on the models' own test draws) would be <= OT-CFM on 1 of 2" in scoring.table(fake, ["a"], paired)
    assert "standard error of the difference over training seeds on: a@100." in text
    # a kept result is re-scored only in the columns missing or drawn another number of times
    scores = {"iid": {"10": [0.1] * 3, "100": [0.1] * 3}, "energy": {"10": [0.0] * 5, "100": [0.0] * 5}}
    assert scoring.stale(scores, {"iid": 3, "energy": 20, "qmc": 3}) == ["energy", "qmc"]
    assert scoring.stale(scores, {"iid": 3, "energy": 5, "qmc": 3}) == ["qmc"]
    # both scripts ask scoring for the draws: a smoke run's few W2 draws cap the energy draws, a full one gets 20
    assert scoring.draws(3, 3, 3) == {"iid": 3, "qmc": 3, "energy": 3}
    assert scoring.draws(20, 3) == {"iid": 20, "qmc": 3, "energy": scoring.ENERGY_SEEDS}
    assert scoring.stale(scores, scoring.draws(3, 3, 5)) == ["qmc"]
    # nsgf_2d's results name their target "task"; a method missing from a cell prints "-"
    task = [{**{k: v for k, v in r.items() if k != "family"}, "task": r["family"]} for r in fake]
    text = scoring.table(task, ["a"], floors, methods=("nsgf", "fm", "otcfm"), extra=[("paper", lambda t, s: str(s))])
    row = [line for line in text.splitlines() if line.startswith("| a | 100 |")][0].split("|")
    assert row[4].strip() == "0.335 ± 0.007 (2 seeds)" and row[5].strip() == "-"  # NSGF (not <= OT-CFM), FM
    assert row[-2].strip() == "100"


def test_helper_results_md(tmp_path):
    """A script's section is appended once under its heading, then replaced in place; other text is kept; the
    machine line."""
    write_section = load("results_md").write_section
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\nhand-written\n<!-- other:begin -->\nkeep\n<!-- other:end -->\n")
    write_section("mine", "first\n", "Mine", path)
    write_section("mine", "second\n", "Mine", path)
    text = path.read_text()
    assert text.count("## Mine") == 1 and "first" not in text and "<!-- mine:begin -->\nsecond\n<!-- mine:end -->" in text
    assert "hand-written" in text and "<!-- other:begin -->\nkeep\n<!-- other:end -->" in text
    # every script names its machine the same way: the CPU model, threads and torch version (and the card on CUDA)
    line = load("results_md").machine("cpu")
    assert line.startswith("CPU ") and f"{__import__('torch').get_num_threads()} torch threads" in line
    assert line.endswith(f"torch {__import__('torch').__version__}")


# ------------------------------------------------------------------------------------ benchmarks/mnist.py

@pytest.fixture(scope="module")
def mnist_bench():
    return load("mnist")


def test_mnist_budget_gives_every_method_the_same_unet_steps(mnist_bench):
    for scale in mnist_bench.SCALES:
        b = mnist_bench.budget(scale, 0.1)
        assert mnist_bench.unet_budget(b) == b["velocity"] + b["nsf"]
    assert mnist_bench.unet_budget(mnist_bench.budget("cpu")) == 3200  # where NSGF++'s velocity network learns
    assert mnist_bench.unet_budget(mnist_bench.budget("cpu-short")) == 500  # the table until 2026-11-28
    gpu = mnist_bench.budget("gpu", 0.1)  # the mnist preset's iterations, scaled
    assert (gpu["velocity"], gpu["nsf"], gpu["time"]) == (5000, 10000, 4000)
    from sinkflow import config

    preset = config.resolve("mnist")  # PRESET is the preset's, not the paper's (App. E.2 gives no UNet iterations)
    assert mnist_bench.PRESET == {"velocity": preset["train"]["velocity"]["iters"],
                                  "nsf": preset["train"]["nsf"]["iters"], "time": preset["train"]["time"]["iters"],
                                  "pool": preset["pool"]["batches"]}
    for total in (3, 6, 13, 26, 60):
        assert all(1 <= k and k + 1 + 1 <= total for k in mnist_bench.split_candidates(total))
    assert mnist_bench.split_candidates(13) == [3, 6, 11]
    # the CPU scale's validation-chosen NSGF++ recipe reaches NSGF++'s run only (command-line overrides come after it)
    cpu = mnist_bench.budget("cpu")
    recipe = ["sinkhorn.blur=0.25", "nsgf.nsf_t_min=0.5", "train.time.lr=0.001"]
    assert mnist_bench.nsgfpp_overrides(mnist_bench.budget("cpu-short"))[-3:] == recipe
    # after the scales' shared segment 0.5; the NSF started from the velocity network (the paper's is a fresh init)
    assert mnist_bench.nsgfpp_overrides(cpu)[-5:] == [*recipe, "nsgf.segment=1.0", "nsgf.nsf_init=velocity"]
    assert not any(o.startswith(("sinkhorn.", "nsgf.")) for o in mnist_bench.common_overrides(cpu, Path("data"), 0, "cpu"))
    assert not {"nsgf.nsf_t_min=0.5", "train.time.lr=0.001"} & set(mnist_bench.nsgfpp_overrides(mnist_bench.budget("gpu", 0.1)))


def test_mnist_sampler_is_chosen_on_validation_never_on_test(mnist_bench, monkeypatch, tmp_path):
    """Validation FD ranks each method's samplers one way, test FD the opposite way: the reported sampler is
    validation's best, the test digits are scored only for it (and for the paper's sampler), and the result is
    what ``from_scores`` rebuilds from scores.json."""
    calls = []

    def fake_score(run, steps, n, split="test"):
        s = run.cfg["sample"]
        k, shift, warp = s["nsgf_steps"], s.get("t_shift", 0.0), s["time_warp"]
        calls.append((split, k, shift, warp))
        if k is None:  # a baseline: val best at warp 0.5
            fd = abs(warp - 0.5)
        else:  # NSGF++: val best k=3 with shift -0.2; among unshifted, k=6
            fd = abs(k - 3) + abs(shift + 0.2) if shift else 1 + abs(k - 6)
        return {"nfe": 13, "fd_cnn": fd if split == "val" else -fd, "w2": 0.0, "tv": 0.0, "conf": 0.0,
                "floor": 0.0, "real_conf": 0.0}

    class FakeRun:  # RunFolder's config and its sampling views (RunFolder.variant)
        def __init__(self, sample):
            self.cfg = {"sample": sample}

        def variant(self, sample=None):
            return FakeRun({**self.cfg["sample"], **(sample or {})})

    fake_run = FakeRun({"nsgf_steps": None, "t_shift": 0.0, "time_warp": 1.0})
    monkeypatch.setattr(mnist_bench, "train", lambda out, name, args: (fake_run, 0.0))
    monkeypatch.setattr(mnist_bench, "score", fake_score)
    monkeypatch.setattr(mnist_bench, "save_samples", lambda run, steps, path: None)
    b = mnist_bench.budget("quick")
    res = mnist_bench.bench_seed(tmp_path, 0, b, tmp_path, [13], "cpu")
    assert res["sampler"]["NSGF++"] == {13: "k3 t-0.2"} and res["sampler"]["NSGF++ (t̂ as predicted)"] == {13: "k6"}
    assert len(res["val"]["NSGF++"][13]) == 3 * len(mnist_bench.T_SHIFTS)
    assert {"k3", "k6 t-0.1", "k11 t-0.3"} <= set(res["val"]["NSGF++"][13])  # shift 0: the tag older files use
    nsgf = [c[1:3] for c in calls if c[1] is not None]
    assert [c[1:3] for c in calls if c[1] is not None and c[0] == "test"] == [(3, -0.2), (6, 0.0)]
    assert sorted(c for c in nsgf[:12]) == sorted((k, s) for k in (3, 6, 11) for s in mnist_bench.T_SHIFTS)
    for label in ("OT-CFM", "FM"):  # the uniform grid scored as before, the warp chosen on validation beside it
        assert res["sampler"][f"{label} (warped)"] == {13: "w0.5", 5: "w0.5"} and 13 in res["scores"][label]
        assert label not in res["sampler"]
    base = [c for c in calls if c[1] is None]
    assert sorted(c[3] for c in base if c[0] == "test") == [0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0]  # 2 methods x 2 NFE
    assert fake_run.cfg["sample"] == {"nsgf_steps": None, "t_shift": 0.0, "time_warp": 1.0}  # never changed
    assert res["scores"]["NSGF++"][13]["fd_cnn"] == -0.0 and res["scores"]["NSGF++ (t̂ as predicted)"][13]["fd_cnn"] == -1
    calls.clear()  # another invocation with other shifts: only they are scored, and the stored ones still compete
    res = mnist_bench.bench_seed(tmp_path, 0, b, tmp_path, [13], "cpu", ("nsgfpp",), shifts=(0.0, -0.4))
    assert sorted(c[1:3] for c in calls if c[0] == "val") == [(3, -0.4), (6, -0.4), (11, -0.4)]
    assert len(res["val"]["NSGF++"][13]) == 3 * (len(mnist_bench.T_SHIFTS) + 1)
    assert res["sampler"]["NSGF++"] == {13: "k3 t-0.2"} and not [c for c in calls if c[0] == "test"]
    assert mnist_bench.parse_sampler("k11 t-0.3") == (11, -0.3) and mnist_bench.parse_sampler("k6") == (6, 0.0)
    assert mnist_bench.choose_sampler({"k6 t-0.1": 1.0, "k3 t-0.2": 1.0, "k3 t-0.1": 1.0}) == "k3 t-0.1"  # ties
    assert mnist_bench.choose_warp({"w0.5": 2.0, "w0.75": 2.0, "w1": 3.0}) == "w0.75"
    table = mnist_bench.table([res], [13], ref=5)
    assert "| NSGF++ | 13 |" in table and "| k3 t-0.2 |" in table and "| OT-CFM (warped) | 5 |" in table
    assert any("samplers chosen on validation, NFE 13" in line for line in mnist_bench.verdict([res], [13]))


@pytest.fixture(scope="module")
def mnist_quick(mnist_bench, tmp_path_factory):
    """One tiny benchmark run on generated official-layout IDX files (real (N, 1, 28, 28) shapes)."""
    from test_data import make_mnist

    from sinkflow import methods

    tmp_path = tmp_path_factory.mktemp("mnist")
    make_mnist(tmp_path / "data", n_train=40, n_test=12)
    out = tmp_path / "out"
    argv = ["--scale", "quick", "--out", str(out), "--data-root", str(tmp_path / "data"), "--train-seeds", "0",
            "--nfe", "3", "--every", "model.velocity.norm_min_channels=1", "model.nsf.norm_min_channels=1"]
    methods._distributions.cache_clear()
    mnist_bench.main(argv)
    return out, argv


@pytest.mark.slow
def test_smoke_mnist(mnist_bench, mnist_quick):
    """Every method trains, is scored and gridded; a second invocation reuses every run and score."""
    from sinkflow.runtime.run_folder import read_config

    out, argv = mnist_quick
    res = json.loads((out / "results.json").read_text())
    scores = res["per_seed"][0]["scores"]
    # the baselines' reference budget beside --nfe: REF_NFE (100), 5 at the quick scale
    assert scores["NSGF++"]["3"]["nfe"] == 3 and set(scores["OT-CFM"]) == set(scores["FM"]) == {"3", "5"}
    assert all(s["fd_cnn"] >= 0 for m in scores.values() for s in m.values())
    chosen = res["per_seed"][0]["sampler"]  # a validation-chosen sampler names its samples' file
    assert set(chosen) == {"NSGF++", "NSGF++ (t̂ as predicted)", "OT-CFM (warped)", "FM (warped)"}
    for method, label, nfes in (("nsgfpp", "NSGF++", [3]), ("otcfm", "OT-CFM (warped)", [3, 5]),
                                ("fm", "FM (warped)", [3, 5])):
        for n in nfes:
            for tag in {chosen[label][str(n)], None} if method != "nsgfpp" else {chosen[label][str(n)]}:
                x = np.load(mnist_bench.samples_path(out / "seed0", method, n, tag), allow_pickle=False)
                assert x.shape == (64, 1, 28, 28) and x.dtype == np.uint8
    assert (out / "grids.png").is_file() and "| NSGF++ | 3 |" in (out / "table.md").read_text()
    assert "; sampled in fp32 (sample.precision=auto); " in (out / "table.md").read_text()  # a GPU's table: fp16
    cfgs = {m: read_config(out / "seed0" / m) for m in ("nsgfpp", "otcfm", "fm")}
    pp = cfgs["nsgfpp"]["train"]
    for m in ("otcfm", "fm"):  # equal UNet steps, batch and lr schedule
        t = cfgs[m]["train"]["velocity"]
        assert t["iters"] == pp["velocity"]["iters"] + pp["nsf"]["iters"]
        assert all(t[k] == pp["velocity"][k] == pp["nsf"][k] for k in ("batch_size", "lr", "warmup", "schedule", "ema"))
        assert cfgs[m]["model"]["velocity"] == cfgs["nsgfpp"]["model"]["velocity"]
        assert cfgs[m]["model"]["velocity"]["norm_min_channels"] == 1  # --every reaches every method's run
    assert cfgs["nsgfpp"]["model"]["nsf"]["norm_min_channels"] == 1
    assert json.loads((out / "seed0" / "nsgfpp" / "data_split.json").read_text())["layout"] == "official"

    finals = {p: p.stat().st_mtime_ns for p in out.rglob("final.pt")}
    saved = (out / "seed0" / "scores.json").read_text()
    mnist_bench.main(argv)  # resumable: nothing retrained or rescored
    assert {p: p.stat().st_mtime_ns for p in out.rglob("final.pt")} == finals
    assert (out / "seed0" / "scores.json").read_text() == saved
    # the grid has a row per method and a column per budget that has samples: NSGF++ alone is one row, no NFE 5
    import matplotlib.image

    full = mnist_bench.from_scores(out, 0, [3])
    alone = {**full, "sampler": {"NSGF++": full["sampler"]["NSGF++"]}}
    three = matplotlib.image.imread(mnist_bench.grids(out, 0, [3], full, ref=5)).shape
    one = matplotlib.image.imread(mnist_bench.grids(out, 0, [3], alone, ref=5)).shape
    assert one[0] < three[0] / 2 and one[1] < three[1]
    assert mnist_bench.grids(out, 7, [3], mnist_bench.from_scores(out, 7, [3]), ref=5) is None


@pytest.mark.slow
def test_smoke_mnist_a_baseline_alone(mnist_bench, mnist_quick, tmp_path):
    """A baseline-only invocation (a probe of OT-CFM's budget) writes its partial report: it read the data split from
    the NSGF++ run it did not train and stopped (FileNotFoundError) after training and scoring."""
    out, argv = mnist_quick
    data_root = argv[argv.index("--data-root") + 1]
    alone = tmp_path / "alone"
    mnist_bench.main(["--scale", "quick", "--out", str(alone), "--data-root", data_root, "--train-seeds", "0",
                      "--nfe", "3", "--methods", "fm"])
    table = (alone / "table-partial.md").read_text()
    assert "| FM (warped) | 3 |" in table and "NSGF++ | 3" not in table and not (alone / "seed0" / "nsgfpp").exists()


def test_mnist_scores_read_one_draw_of_each_split(mnist_bench, tmp_path):
    """Scores name their split and draw (``val@<n>``, ``test@<n>``): a larger validation draw chooses anew and its
    candidates are never mixed with a smaller one's, a larger test draw scores anew; without ``val_n`` / ``test_n``
    each budget reads the largest draw scored for it."""
    seed = tmp_path / "seed0"
    seed.mkdir()
    key = mnist_bench.score_key
    scores = {key("val", 100, "NSGF++", 13, "k3"): 1.0, key("val", 100, "NSGF++", 13, "k6"): 2.0,
              key("val", 800, "NSGF++", 13, "k6"): 1.5, key("val", 800, "NSGF++", 13, "k11"): 1.6,  # k3 not on 800
              key("val", 100, "NSGF++", 26, "k24"): 1.0, key("val", 100, "OT-CFM", 13, "w0.5"): 1.0,
              **{key("test", 200, "NSGF++", 13, t): {"fd_cnn": fd} for t, fd in (("k3", 30.0), ("k6", 20.0))},
              key("test", 200, "NSGF++", 26, "k24"): {"fd_cnn": 25.0}, key("test", 200, "OT-CFM", 13): {"fd_cnn": 24.0},
              key("test", 200, "OT-CFM", 13, "w0.5"): {"fd_cnn": 23.0}, key("test", 2000, "NSGF++", 13, "k6"): {"fd_cnn": 19.0}}
    assert key("test", 200, "OT-CFM", 13) == "test@200 OT-CFM 13" and key("val", 800, "FM", 6, "w1") == "val@800 FM 6 w1"
    (seed / "scores.json").write_text(json.dumps(scores))
    small, large, largest = (mnist_bench.from_scores(tmp_path, 0, [13, 26], n, 200) for n in (100, 800, None))
    assert small["sampler"]["NSGF++"] == {13: "k3", 26: "k24"} and small["scores"]["NSGF++"][13]["fd_cnn"] == 30
    assert large["sampler"]["NSGF++"] == {13: "k6"} and large["val"]["NSGF++"][13] == {"k6": 1.5, "k11": 1.6}
    assert "OT-CFM (warped)" not in large["sampler"] and large["scores"]["OT-CFM"][13]["fd_cnn"] == 24  # uniform
    assert largest["sampler"]["NSGF++"] == {13: "k6", 26: "k24"} and largest["sampler"]["OT-CFM (warped)"] == {13: "w0.5"}
    assert largest["val"]["NSGF++"][13] == large["val"]["NSGF++"][13]  # the 800 draw alone, no 100-draw k3 beside it
    assert large["scores"]["NSGF++"][13]["fd_cnn"] == 20  # the test draw asked for, not the larger one beside it
    on_2000 = mnist_bench.from_scores(tmp_path, 0, [13, 26], 800, 2000)
    assert on_2000["scores"] == {label: {13: {"fd_cnn": 19.0}} for label in ("NSGF++", "NSGF++ (t̂ as predicted)")}
    assert mnist_bench.from_scores(tmp_path, 0, [13, 26], 800)["scores"]["NSGF++"][13]["fd_cnn"] == 19  # the largest


@pytest.mark.parametrize("flag, asked, split, held", [("--val-n", 5, "validation", 4), ("--n", 13, "test", 12)])
def test_mnist_draw_beyond_its_split_is_refused_in_one_line(mnist_bench, tmp_path, capsys, flag, asked, split, held):
    """A validation or test draw larger than its split is refused before any training (held_out would cap it)."""
    from test_data import make_mnist

    make_mnist(tmp_path / "data", n_train=40, n_test=12)  # 4 validation digits, 12 test digits
    with pytest.raises(SystemExit):
        mnist_bench.main(["--scale", "quick", "--out", str(tmp_path / "out"), "--data-root", str(tmp_path / "data"),
                          flag, str(asked)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{flag} {asked}: the {split} split holds {held} digits" in err and f"use {flag} between 2 and {held}" in err
    assert not (tmp_path / "out" / "seed0").exists()


def test_mnist_report_only_without_a_scored_run_says_so_in_one_line(mnist_bench, tmp_path):
    (tmp_path / "MNIST" / "raw").mkdir(parents=True)
    with pytest.raises(SystemExit) as stop:
        mnist_bench.main(["--scale", "quick", "--out", str(tmp_path / "empty"), "--data-root", str(tmp_path),
                          "--train-seeds", "0", "--report-only"])
    assert str(stop.value).startswith("no scored run of seeds 0 under ") and "\n" not in str(stop.value)


@pytest.mark.slow
def test_smoke_mnist_probes(mnist_quick, capsys):
    out, _ = mnist_quick
    load("mnist_probes").main(["--out", str(out), "--seed", "0", "--nfe", "3", "--n", "6"])
    res = json.loads((out / "probes-seed0-nfe3.json").read_text())
    assert set(res["probes"]) == {"as benchmarked", "t̂ = batch mean", "t̂ − 0.15", "t̂ + 0.15"}
    assert res["k"] == 1 and "| as benchmarked |" in capsys.readouterr().out
    load("mnist_probes").main(["--out", str(out), "--seed", "0", "--nfe", "3", "--n", "4", "--fixed", "0.6",
                               "--split", "val"])  # every NSF started at 0.6, scored on the validation digits
    val = json.loads((out / "probes-seed0-nfe3-val.json").read_text())
    assert val["split"] == "val" and val["probes"]["t̂ = 0.6"]["t_hat"] == pytest.approx(0.6)
    assert val["probes"]["as benchmarked"]["fd_cnn"] != res["probes"]["as benchmarked"]["fd_cnn"]  # other digits
    load("mnist_probes").main(["--out", str(out), "--seed", "0", "--nfe", "3", "--n", "4", "--swap-from", "0",
                               "--swap-out", str(out), "--no-t-edits"])  # another's networks: here its own
    swapped = json.loads((out / "probes-seed0-nfe3.json").read_text())["probes"]
    assert set(swapped) == {"as benchmarked"} | {f"{p} from {out.name}'s seed 0" for p in ("velocity", "nsf", "time")}
    for phase in ("velocity", "nsf", "time"):
        assert swapped[f"{phase} from {out.name}'s seed 0"]["fd_cnn"] == swapped["as benchmarked"]["fd_cnn"]
    with pytest.raises(SystemExit):  # a donor benchmark without the seed to take from it
        load("mnist_probes").main(["--out", str(out), "--seed", "0", "--nfe", "3", "--swap-out", str(out)])
    assert "give the seed with --swap-from S" in capsys.readouterr().err
    load("mnist_probes").main(["--out", str(out), "--seed", "0", "--nfe", "3", "--n", "6", "--fixed", "0.6",
                               "--swap-from", "0", "--pool-states", "--nsf-steps", "1", "3", "--renoise", "0.7",
                               "--velocity-fit", "--trajectory-fit"])
    saved = json.loads((out / "probes-seed0-nfe3.json").read_text())
    probes = saved["probes"]
    for phase in ("velocity", "nsf", "time"):  # a seed's own networks swapped in: the benchmarked cell, exactly
        assert probes[f"{phase} from seed 0"]["fd_cnn"] == probes["as benchmarked"]["fd_cnn"]
    for who in ("pool", "network"):  # the Sinkhorn flow's own states, and the velocity network's from its x0
        rows = [probes[f"{who} states{s}"] for s in (" themselves", ", NSF from t̂", ", NSF from 0.6")]
        assert all(np.isfinite(r["fd_cnn"]) and r["n"] == 6 for r in rows) and rows[2]["t_hat"] == pytest.approx(0.6)
        assert rows[0]["fd_cnn"] != rows[1]["fd_cnn"]  # the NSF moved the states
    assert probes["pool states themselves"]["fd_cnn"] != probes["network states themselves"]["fd_cnn"]
    ceiling = probes["interpolant x_0.6, NSF from 0.6"]  # the NSF from its own training distribution at 0.6
    assert np.isfinite(ceiling["fd_cnn"]) and ceiling["n"] == 6 and ceiling["t_hat"] == pytest.approx(0.6)
    assert ceiling["fd_cnn"] not in (probes["pool states, NSF from 0.6"]["fd_cnn"],
                                     probes["network states, NSF from 0.6"]["fd_cnn"])
    assert probes["interpolant x_0.6, NSF from 0.6, 3 NSF steps"]["fd_cnn"] != ceiling["fd_cnn"]  # 3 steps, not 1
    assert set(probes) >= {f"{who} states, NSF from 0.6, 3 NSF steps" for who in ("pool", "network")}
    renoised = [probes[f"sampler's digits re-noised to 0.7, {s} NSF steps"] for s in (1, 3)]
    assert all(np.isfinite(r["fd_cnn"]) and r["t_hat"] == pytest.approx(0.7) for r in renoised)
    assert probes["sampler's digits"]["fd_cnn"] == pytest.approx(probes["as benchmarked"]["fd_cnn"])  # the same
    assert len({r["fd_cnn"] for r in renoised} | {probes["sampler's digits"]["fd_cnn"]}) == 3  # the NSF moved them
    fit = saved["velocity_fit"]  # a share of the target's variance per pool step, on its own pool and a fresh one
    drift = saved["trajectory_fit"]  # the network's path against two Sinkhorn flows from the same fresh sources
    assert fit["n"] == drift["n"] >= 6 and len(fit["train"]) == len(fit["fresh"]) == 5  # whole pool batches
    assert all(np.isfinite(v) and v > 0 for v in fit["train"] + fit["fresh"]) and fit["train"] != fit["fresh"]
    assert len(drift["network"]) == len(drift["flows"]) == len(drift["bias"]) == 5
    assert all(np.isfinite(v) and v > 0 for v in drift["network"] + drift["flows"])
    assert drift["bias"] == pytest.approx([d - f / 2 for d, f in zip(drift["network"], drift["flows"])])
    end = drift["sampler"]  # at 3 NFE the sampler takes one NSGF step over the pool's five steps' span
    assert end["steps"] == 1 and end["bias"] == pytest.approx(end["network"] - drift["flows"][-1] / 2)
    assert end["network"] != drift["network"][-1]  # another path to the same time
    fds = drift["state_fd"]  # x_T in FD-CNN's feature space, against the flow's and the held-out digits
    assert all(np.isfinite(v) and v >= 0 for v in fds.values()) and fds["network"] != end["state_fd"]["network"]
    printed = capsys.readouterr().out
    assert "| step | trained-on pool | fresh pool |" in printed and "| step | network to flow |" in printed
    assert "x_T in FD-CNN's feature space: network to flow" in printed


@pytest.mark.slow
def test_trajectory_fit_reads_a_standing_network_as_the_whole_displacement(mnist_quick):
    """A velocity network that outputs zero stays at x_0: its distance to the flow is the flow's whole displacement
    (share 1 at every step, whatever the flow), and the bias is that less half the flows' spread; its noise is
    rougher than the flow's states, more so as they move towards the digits."""
    import torch

    from sinkflow.methods.nsgf import make_simulator
    from sinkflow.runtime.run_folder import RunFolder

    class Standing(torch.nn.Module):
        def forward(self, x, t):
            return torch.zeros_like(x)

    out, _ = mnist_quick
    probes = load("mnist_probes")
    run = RunFolder.open(out / "seed0" / "nsgfpp").variant(models={"velocity": Standing()})
    drift = probes.trajectory_fit(run, 6, probes.fd_reference(run, 6, "test"))
    assert drift["network"] == pytest.approx([1.0] * 5, rel=1e-5)
    fds = drift["state_fd"]  # the source noise it stands on is farther from the digits than the flow's x_T is
    assert fds["network_to_digits"] > fds["flow_to_digits"] and fds["network"] > fds["flows"]
    sharp = drift["sharpness"]  # the source noise it stands on has rougher pixels than the flow's smoothing states
    assert sharp == sorted(sharp) and sharp[-1] > 1
    assert drift["bias"] == pytest.approx([1.0 - f / 2 for f in drift["flows"]], rel=1e-5)
    assert all(0 < f for f in drift["flows"]) and len(set(drift["flows"])) == 5  # the flows part as they move
    size = int(run.cfg["pool"]["batch_size"])
    assert probes.in_pool_batches(run.cfg, size + 1) == 2 * size
    x0, y = torch.randn(2 * size, 1, 28, 28, generator=torch.Generator().manual_seed(0)), torch.rand(2 * size, 1, 28, 28)
    xs, vs = probes.flow_in_pool_batches(run.cfg, x0, y)  # batch by batch, as the pool is built
    alone = make_simulator(run.cfg, None)(x0[size:], y[size:])  # the second batch on its own
    mixed = make_simulator(run.cfg, None)(x0, y)[1][:, size:]  # one problem of both batches: another flow (on real
    # MNIST at 256 points a batch, 36-39 % off the lone batch's velocities where the batched solve is 0.2-0.4 % off)
    off, mixed_off = ((v - alone[1]).norm() / alone[1].norm() for v in (vs[:, size:], mixed))
    assert off < 0.2 * mixed_off  # batched, each batch its own problem: the lone batch's to the solver's tolerance
    run = run.variant(sample={"nsgf_steps": 2})  # the sampler's own grid: its end stands at x_0 too
    end = probes.trajectory_fit(run, 6, probes.fd_reference(run, 6, "test"))["sampler"]
    assert end["steps"] == 2 and end["network"] == pytest.approx(1.0, rel=1e-5)
    assert end["sharpness"] == pytest.approx(sharp[-1], rel=1e-5)  # the same x_0 against the same x_T
    assert end["state_fd"] == pytest.approx({k: fds[k] for k in end["state_fd"]}, rel=1e-5)


def test_smoke_pool_convergence(tmp_path, monkeypatch, capsys):
    """Two targets (a preset task and a suite family), tiny batches: the table names each setting, a cap of 1
    iteration leaves end points off and the reference setting itself is exact."""
    bench = load("pool_convergence")
    monkeypatch.setattr(bench, "RESULTS", tmp_path / "RESULTS.md")
    bench.main(["--tasks", "moons", "spiral", "--batches", "1", "--n", "16", "--cap", "300", "--blur", "0.2:1",
                "0.2:300", "--write"])
    text = (tmp_path / "RESULTS.md").read_text()
    rows = {line.split("|")[1].strip(): line.split("|") for line in text.splitlines() if line.startswith("| moons")
            or line.startswith("| spiral")}
    assert set(rows) == {"moons", "spiral"}
    capped, converged = rows["moons"][3], rows["moons"][4]  # end-point error: cap 1, then the reference's own cap
    assert float(capped.split("/")[0]) > 1e-3 and float(converged.split("/")[0]) == 0.0
    landing = [float(c) for c in rows["spiral"][7:9]]  # W2 of the end points to their own target batch, per setting
    assert 0 < landing[1] < 1 and landing[0] > landing[1]  # stopped after 1 iteration it lands farther off
    assert "<!-- pool_convergence:begin -->" in text


def test_smoke_ot_coupling(tmp_path, monkeypatch, capsys):
    """Two tiny sizes: both solvers and sinkflow's ot_permutation agree on every batch, the times are positive, the
    ratio column is their quotient; the import timer measures a statement in a fresh interpreter."""
    bench = load("ot_coupling")
    monkeypatch.setattr(bench, "RESULTS", tmp_path / "RESULTS.md")
    rows = bench.main(["--sizes", "8x2", "16x784", "--batches", "3", "--import-repeats", "0", "--write"])
    assert [(r["n"], r["dim"], r["same"]) for r in rows] == [(8, 2, 3), (16, 784, 3)]
    assert all(r["lsa_ms"] > 0 and r["emd_ms"] > 0 and r["path_ms"] > 0 for r in rows)
    text = (tmp_path / "RESULTS.md").read_text()
    assert "| 16 x 784 | 3 of 3 |" in text and f"{rows[1]['emd_ms'] / rows[1]['lsa_ms']:.2f}x |" in text
    assert "ot_permutation ms (cpu)" in text and f"| {rows[1]['path_ms']:.2f} |" in text
    assert "<!-- ot_coupling:begin -->" in text and "import after torch" not in text
    assert 0 < bench.import_seconds("import json", 1, before="pass") < 10


def test_ot_coupling_leaves_each_solvers_first_call_out_of_its_mean(monkeypatch):
    """A first call that is slow (on CUDA: ot_permutation's first cdist and copy kernels) was in the timed mean of
    the first size; an untimed pair runs first now, and the timed batches are the same as without it."""
    import time as clock

    from sinkflow.ot import exact

    bench = load("ot_coupling")
    calls, real = [], exact.ot_permutation

    def first_call_slow(x0, x1):
        calls.append(x0.shape)
        if len(calls) == 1:
            clock.sleep(0.5)
        return real(x0, x1)

    monkeypatch.setattr(exact, "ot_permutation", first_call_slow)
    row = bench.measure(8, 2, 2)
    assert row["path_ms"] < 100 and row["same"] == 2 and len(calls) == 3  # 250 ms a pair with the first call in


def test_smoke_cpu_step(tmp_path, monkeypatch, capsys):
    """One thread, a few calls: every time is positive, both Adam kinds are timed side by side, and the floor column
    is the forward + backward time times --iters."""
    bench = load("cpu_step")
    monkeypatch.setattr(bench, "RESULTS", tmp_path / "RESULTS.md")
    torch_threads = __import__("torch").get_num_threads()
    try:
        bench.main(["--threads", "1", "--steps", "3", "--iters", "5000", "--write"])
    finally:
        __import__("torch").set_num_threads(torch_threads)
    text = (tmp_path / "RESULTS.md").read_text()
    row = [line for line in text.splitlines() if line.startswith("| 1 |")][0].split("|")
    matmul, forward, fwd_bwd, foreach, fused = (float(row[2].split()[0]), float(row[3]), float(row[4]), float(row[5]),
                                                float(row[6]))
    assert min(matmul, forward, fwd_bwd, foreach, fused) > 0  # no order between timings: 3 calls on a loaded CPU
    # read forward 5.54 ms, forward + backward 5.37 (a clean-clone CI beside a benchmark, 2026-11-29)
    ratio, half = float(row[7].strip().rstrip("x")), 0.005  # the times are printed to 0.01 ms, the ratio to 0.01
    assert (foreach - half) / (fused + half) - half <= ratio <= (foreach + half) / (fused - half) + half
    # the floor is computed from the unrounded time: within the printed time's rounding (and its own) of it
    assert abs(int(row[8]) - 5000 * fwd_bwd / 1e3) <= 5000 * half / 1e3 + 0.5
    assert "<!-- cpu_step:begin -->" in text and "batch 256" in text
    # the quoted command runs this table again: it once dropped --preset and --iters
    assert "Command: `python benchmarks/cpu_step.py --threads 1 --steps 3 --preset 8gaussians-moons --iters 5000`" in text


def test_smoke_gpu_session(tmp_path, capsys):
    """The prepared GPU plan: every step's arguments (GPU and CPU variants) pass its script's own parser, and the
    runner runs a step's CPU variant in a process of its own, its log and the summary written, the tail printed."""
    bench = load("gpu_session")
    assert bench.check(bench.PLAN, smoke=True) == []
    rows = bench.main(["--smoke", "--only", "ot-coupling", "--out", str(tmp_path / "out")])
    assert [(r["step"], r["result"]) for r in rows] == [("ot-coupling", "ok")]
    assert "| 8 x 4 | 2 of 2 |" in (tmp_path / "out" / "ot-coupling.log").read_text()
    assert "| ot-coupling | ok |" in (tmp_path / "out" / "summary.md").read_text()
    assert "| 8 x 4 | 2 of 2 |" in capsys.readouterr().out


def test_gpu_session_refuses_a_plan_its_scripts_would_refuse(capsys):
    """A step the script's parser refuses (a path name train_throughput does not have, a CLI flag sinkflow lacks) is
    found before the call, named, and nothing runs."""
    bench = load("gpu_session")
    plan = (bench.Step("typo", ("train_throughput.py", "--compile", "--paths", "fp16+compile+stepgraf"), 1, "-"),
            bench.Step("cli", ("sinkflow", "doctor", "mnist", "--stpes", "100"), 1, "-"),
            bench.Step("fine", ("ot_coupling.py", "--sizes", "8x4"), 1, "-"))
    assert [p.split(":")[0] for p in bench.check(plan, smoke=True)] == ["typo", "cli"]
    assert "fp16+compile+stepgraf" in capsys.readouterr().err  # argparse's own message names the bad value
    with pytest.raises(SystemExit):
        bench.main(["--only", "no-such-step", "--check"])


def test_gpu_session_runs_what_fits_and_stops_what_overruns(tmp_path):
    """Steps run in order; one whose expected time exceeds what is left is skipped (a later one still runs), a failing
    one is recorded with its exit status, and one that overruns the budget is stopped with its process group."""
    bench = load("gpu_session")
    script = tmp_path / "step.py"
    script.write_text("import sys, time\nprint('step', sys.argv[1]); time.sleep(float(sys.argv[2]))\n"
                      "sys.exit(int(sys.argv[3]))\n")
    plan = (bench.Step("ok", (str(script), "a", "0", "0"), 1, "-"),
            bench.Step("too-long", (str(script), "b", "0", "0"), 10_000, "-"),
            bench.Step("fails", (str(script), "c", "0", "3"), 1, "-"),
            bench.Step("overruns", (str(script), "d", "60", "0"), 1, "-"))
    rows = bench.run_plan(plan, budget=3, out=tmp_path / "out", env=dict(os.environ))
    assert [(r["step"], r["result"].split(" (")[0]) for r in rows] == [
        ("ok", "ok"), ("too-long", "skipped"), ("fails", "rc 3"), ("overruns", "timed out")]
    assert rows[3]["seconds"] < 20
    assert (tmp_path / "out" / "ok.log").read_text() == "step a\n" and not (tmp_path / "out" / "too-long.log").exists()


def test_smoke_sample_precision(mnist_quick, monkeypatch, capsys):
    """Each method's validation-chosen sampler draws the same noise under fp32, bf16 and fp16; the half precisions'
    FD-CNN is paired with fp32's, and a second invocation reuses every number (nothing sampled again)."""
    out, _ = mnist_quick
    sp = load("sample_precision")
    argv = ["--out", str(out), "--train-seeds", "0", "--nfe", "3", "--n", "6", "--sampling-seeds", "2"]
    sp.main(argv)
    first = capsys.readouterr().out
    res = json.loads((out / "sample_precision.json").read_text())
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == {"NSGF++", "OT-CFM (warped)", "FM (warped)"}
    assert res["floor"] > 0 and f"(floor: 6 real training digits, {res['floor']:.2f})" in first
    for r in rows.values():
        assert r["nfe"] == 3 and r["pairs"] == 2 and r["seed_sd"] > 0 and np.isfinite(r["fd"])
        for half in ("bf16", "fp16"):  # the autocast moved the samples, a little
            assert 0 < r[half]["dpix"] < r[half]["dmax"] <= 2 and np.isfinite(r[half]["delta"])
    assert rows["NSGF++"]["fp16"]["dt"] is not None and rows["FM (warped)"]["fp16"]["dt"] is None
    stored = json.loads((out / "seed0" / "precision.json").read_text())
    chosen = load("mnist").from_scores(out, 0, [3])["sampler"]
    k, shift = load("mnist").parse_sampler(chosen["NSGF++"][3])
    assert stored["nsgfpp 3 n6"]["sampler"] == {"nsgf_steps": k, "t_shift": shift}  # the benchmark's choice
    assert stored["nsgfpp 3 n6"]["steps"] == 3 - 1 - k
    assert stored["otcfm 3 n6"]["sampler"] == {"time_warp": float(chosen["OT-CFM (warped)"][3][1:])}

    def no_sampling(*a, **k):
        raise AssertionError("sampled again")

    monkeypatch.setattr(sp, "generate", no_sampling)
    sp.main(argv)  # resumed: the table again from precision.json
    again = capsys.readouterr().out
    assert "NFE 3:" not in again and again[again.index("| method"):] == first[first.index("| method"):]
    sp.main([*argv[:-1], "1"])  # fewer noise draws than stored: the table reads the first one only
    assert all(r["pairs"] == 1 for r in json.loads((out / "sample_precision.json").read_text())["rows"])
    capsys.readouterr()
    sp.main([*argv, "--precisions", "fp32"])  # fp32 alone: its sampling-seed noise (RESULTS' draw-size table)
    table = capsys.readouterr().out.split("\n\n")[1].splitlines()
    assert table[0] == "| method | NFE | FD-CNN, fp32 | sampling-seed sd |" and table[1] == "|---|---|---|---|"
    assert len(table) == 5 and all(line.count("|") == 5 for line in table)
    with pytest.raises(SystemExit):
        sp.main([*argv, "--precisions", "bf16", "fp32"])


# ------------------------------------------------------------------ bad input: one line, before any work; nothing lost

def test_helper__args(capsys):
    """The shared checks: whole numbers with a floor (argparse types), a device torch knows and CUDA only where there
    is one, and a SinkflowError at a script's main as one line with exit 2."""
    import argparse

    import torch

    args = load("_args")
    assert args.positive_int("3") == 3 and args.at_least(0)("0") == 0
    for bad, parse in (("0", args.positive_int), ("x", args.positive_int), ("1", args.at_least(2))):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
    assert args.checked_device("cpu") == torch.device("cpu")
    with pytest.raises(SystemExit) as stop:
        args.checked_device("gpu0")
    assert stop.value.code == 2 and "--device gpu0: not a device torch knows" in capsys.readouterr().err

    @args.one_line_errors
    def main(argv=None):
        from sinkflow.errors import SinkflowError

        raise SinkflowError("the problem", "the fix")

    with pytest.raises(SystemExit) as stop:
        main([])
    assert stop.value.code == 2 and capsys.readouterr().err == "error: the problem; the fix\n"


NO_CUDA = [("ot_coupling", ["--sizes", "8x4", "--batches", "1", "--import-repeats", "0"]),
           ("flow_memory", ["--depths", "1", "--no-memcnn"]), ("memory_estimate", ["--presets", "moons"]),
           ("preset_throughput", ["--smoke"]), ("sampling", ["--smoke"]), ("train_throughput", ["--smoke"]),
           ("loss_curve", ["--smoke"]), ("sample_precision", ["--out", "nowhere"]), ("pool_build", []),
           ("gpu_checks", ["--smoke"]), ("mnist", ["--out", "nowhere", "--scale", "quick"])]


@pytest.mark.parametrize("name,argv", NO_CUDA, ids=[n for n, _ in NO_CUDA])
def test_device_cuda_without_cuda_is_refused_in_one_line(name, argv, quiet, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        load(name).main([*argv, "--device", "cuda"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--device cuda: no CUDA device here; use --device cpu" in err
    assert "Traceback" not in err and not list(quiet.iterdir())  # refused before anything was written


BAD_VALUES = [("ot_coupling", ["--sizes", "8x"], "'8x' is not BATCHxDIM"),
              ("ot_coupling", ["--batches", "0"], "argument --batches: 0 is below 1"),
              ("sinkhorn_solver", ["--batches", "0", "--n", "16"], "argument --batches: 0 is below 1"),
              ("sinkhorn_solver", ["--task", "nosuch"], "--task nosuch: unknown preset 'nosuch'"),
              ("memory_estimate", ["--presets", "nosuch"], "--presets nosuch: unknown preset 'nosuch'"),
              ("w2_mode_counts", ["--n", "64", "--draws", "1"], "argument --draws: 1 is below 2"),
              ("w2_mode_counts", ["--n", "0"], "argument --n: 0 is below 16"),
              ("pool_convergence", ["--blur", "0.2"], "'0.2' is not BLUR:MAX_ITERS"),
              ("cpu_step", ["--threads", "0"], "argument --threads: 0 is below 1"),
              ("flow_digits_ablation", ['{"name": "base", "stpes": 3}'], "unknown key stpes; the keys are name, steps"),
              ("train_throughput", ["--smoke", "--steps", "0"], "argument --steps: 0 is below 1"),
              ("train_throughput", ["--smoke", "--batch", "0"], "argument --batch: 0 is below 1"),
              # a --profile path that was not timed printed no profile and exited 0
              ("train_throughput", ["--smoke", "--profile", "fast+graphs"], "--profile fast+graphs: not a timed path"),
              ("train_throughput", ["--smoke", "--paths", "fast", "--profile", "fast+CL"],
               "--profile fast+CL: not a timed path"),
              ("sampling", ["--smoke", "--nfe", "0"], "argument --nfe: 0 is below 1"),
              ("sampling", ["--smoke", "--repeats", "0"], "argument --repeats: 0 is below 1"),
              ("loss_curve", ["--smoke", "--log-every", "0"], "argument --log-every: 0 is below 1"),
              ("preset_throughput", ["--smoke", "--steps", "0"], "argument --steps: 0 is below 1"),
              ("loss_curve", ["--smoke", "--device", "cpu", "--preset", "nosuch"], "unknown preset 'nosuch'"),
              # pool_build: '--device gpu' printed an empty table; a 0 ended in a traceback after the first case
              ("pool_build", ["--device", "gpu"], "argument --device: invalid choice: 'gpu'"),
              ("gpu_checks", ["--smoke", "--device", "gpu0"], "--device gpu0: not a device torch knows"),
              ("flow_memory", ["--depths", "1", "--no-memcnn", "--repeats", "0"], "argument --repeats: 0 is below 1"),
              ("flow_memory", ["--from-json", "none.json"], "--from-json none.json: no such file"),
              ("nsgf_2d", ["--workers", "0"], "argument --workers: 0 is below 1"),
              ("nsgf_2d", ["--eval-seeds", "0"], "argument --eval-seeds: 0 is below 1"),
              ("nsgf_suite", ["--runs-dir", "r", "--seeds", "0"], "argument --seeds: 0 is below 1"),
              ("nsgf_suite", ["--runs-dir", "r", "--eval-seeds", "0"], "argument --eval-seeds: 0 is below 1"),
              ("digits", ["--smoke", "--workers", "0"], "argument --workers: 0 is below 1"),
              ("digits", ["--smoke", "--ref-steps", "0"], "argument --ref-steps: 0 is below 1"),
              ("sample_precision", ["--out", "nowhere", "--sampling-seeds", "0"],
               "argument --sampling-seeds: 0 is below 1"),
              # mnist: a 0 budget was silently the scale's own
              ("mnist", ["--scale", "quick", "--velocity", "0"], "argument --velocity: 0 is below 1"),
              ("pool_build", ["--device", "cpu", "--batches", "0"], "argument --batches: 0 is below 1"),
              ("pool_build", ["--device", "cpu", "--repeats", "0"], "argument --repeats: 0 is below 1")]


@pytest.mark.parametrize("name,argv,says", BAD_VALUES, ids=[f"{n}:{' '.join(a)}" for n, a, _ in BAD_VALUES])
def test_bad_flag_values_are_refused_in_one_line(name, argv, says, quiet, capsys):
    """Each was a traceback (ValueError, ZeroDivisionError, StatisticsError, TypeError, a SinkflowError's), or a 0
    silently taken for the default; the last one a SinkflowError raised mid-run (loss_curve: caught at main)."""
    with pytest.raises(SystemExit) as stop:
        load(name).main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and says in err and "Traceback" not in err


def test_digits_out_never_deletes_what_it_did_not_write(quiet, capsys):
    """--out was removed whole (shutil.rmtree on any folder given). A folder holding anything else is refused before
    any work; one of the script's own layout loses only the seed folders the rerun writes again."""
    bench = load("digits")
    mine = quiet / "mine"
    (mine / "notes.txt").parent.mkdir()
    (mine / "notes.txt").write_text("the user's")
    with pytest.raises(SystemExit) as stop:
        bench.main(["--smoke", "--train-seeds", "0", "--seeds", "1", "--nfe", "3", "--out", str(mine)])
    assert stop.value.code == 2 and "which this script did not write" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "the user's"
    own = quiet / "own"
    for seed in ("seed0", "seed5"):
        (own / seed).mkdir(parents=True)
        (own / seed / "grid.png").write_text("x")
    (own / "results.json").write_text("{}")
    bench.clear_out(own, [0], pytest.fail)
    assert sorted(p.name for p in own.iterdir()) == ["results.json", "seed5"]


def test_flow_memory_writes_its_plot_in_the_current_folder_by_default(quiet, capsys):
    """The default was benchmarks/flow_memory.png, relative to the current folder: a toy run from the repository root
    replaced the committed plot."""
    load("flow_memory").main(["--depths", "1", "--shape", "1", "8", "8", "--batch", "2", "--hidden", "4", "--levels",
                              "1", "--repeats", "1", "--no-memcnn", "--clock", "cpu", "--device", "cpu"])
    assert "wrote flow_memory.png" in capsys.readouterr().out
    assert [p.name for p in quiet.iterdir()] == ["flow_memory.png"]


def test_collect_on_a_folder_without_runs_says_so_and_keeps_results_md(quiet, capsys, monkeypatch):
    """--collect on an empty or wrong --runs-dir printed an all-'-' table, exit 0, and with --write replaced the
    committed section with it; write_section itself refuses a section with no scored rows."""
    results = quiet / "RESULTS.md"
    before = "# Benchmark results\n\n<!-- nsgf_2d:begin -->\nold\n<!-- nsgf_2d:end -->\n"
    results.write_text(before)
    for name, argv in (("nsgf_2d", ["--tasks", "moons", "--methods", "nsgf", "--seeds", "1"]),
                       ("nsgf_suite", ["--families", "unequal", "--methods", "nsgf", "--seeds", "1"])):
        bench = load(name)
        monkeypatch.setattr(bench, "RESULTS", results)
        monkeypatch.setattr(bench, "ProcessPoolExecutor", InProcessPool)
        with pytest.raises(SystemExit) as stop:
            bench.main([*argv, "--runs-dir", "no-such-runs", "--collect", "--write"])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and "no finished runs under " in err and "relative to the current directory" in err
        assert not (quiet / "no-such-runs").exists()
    with pytest.raises(SystemExit, match="no scored rows"):
        load("results_md").write_section("nsgf_2d", "empty\n", "NSGF", results, scored=0)
    assert results.read_text() == before


def test_nsgf_2d_removes_its_temporary_runs_folder(quiet, monkeypatch, capsys):
    """Without --runs-dir the runs (about 1 GB for the defaults) were left in /tmp/sinkflow-bench-XXXX."""
    bench = load("nsgf_2d")
    seen = []

    def fake(args, argv, runs_dir):
        (Path(runs_dir) / "run").mkdir()
        seen.append(Path(runs_dir))

    monkeypatch.setattr(bench, "bench", fake)
    bench.main(["--tasks", "moons"])
    assert seen and not seen[0].exists() and f"runs in {seen[0]}, removed at the end" in capsys.readouterr().out


def test_finer_worse_needs_a_seed_spread():
    """With one seed the spread is 0 and "100 steps worse than 10 by more than the spread" fired on any difference,
    rounding included."""
    scoring = load("scoring")
    one = [{"family": "a", "method": "nsgf", "seed": 0, "scores": {"iid": {"10": [0.3], "100": [0.3 + 1e-12]}}}]
    assert scoring.verdict(one, ["a"], "iid")["finer_worse"] == []


def test_flow_bpd_selects_among_the_final_weights_too(quiet, capsys):
    """The final weights were never a candidate (--iters below --ckpt-every: "no checkpoints to select from"; here the
    last step after the last checkpoint was ignored), and --json into a new folder failed after the training."""
    bench = load("flow_bpd")
    bench.main_cli(["--iters", "3", "--ckpt-every", "2", "--runs-dir", str(quiet / "runs"), "--json",
                    str(quiet / "new" / "bpd.json"), "model.flow.depth_per_level=1", "model.flow.hidden_channels=8",
                    "train.flow.batch_size=8"])
    result = json.loads((quiet / "new" / "bpd.json").read_text())["results"][0]
    assert [c["step"] for c in result["val_curve"]] == [2, 3] and result["selected_step"] in (2, 3)


def test_mnist_without_mnist_files_says_so_in_one_line(mnist_bench, tmp_path, capsys):
    """--mnist-dir of a folder without the IDX files, or a --data-root without MNIST/raw: both were a DataNotFound
    traceback after the scorers' set-up began (the first naming <out>/data, where nothing had been linked)."""
    (tmp_path / "empty").mkdir()
    for flag, says in (("--mnist-dir", f"{tmp_path / 'empty'} holds no MNIST IDX files"),
                       ("--data-root", "MNIST not found in")):
        with pytest.raises(SystemExit) as stop:
            mnist_bench.main(["--scale", "quick", "--out", str(tmp_path / "out"), flag, str(tmp_path / "empty")])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and says in err.strip().splitlines()[-1] and "Traceback" not in err


def test_mnist_report_only_needs_no_mnist_files(mnist_bench, tmp_path, monkeypatch):
    """--report-only reads the saved scores only: it demanded MNIST files ("no MNIST files") it never reads."""
    monkeypatch.setattr(mnist_bench, "find_mnist_dir", lambda: None)
    with pytest.raises(SystemExit) as stop:
        mnist_bench.main(["--scale", "quick", "--out", str(tmp_path / "empty"), "--train-seeds", "0", "--report-only"])
    assert str(stop.value).startswith("no scored run of seeds 0 under ")


def test_gpu_session_installs_torchcfm_and_keeps_lr_find_output(tmp_path, monkeypatch, capsys):
    """(a) the wheels were installed only when POT or GeomLoss was missing, never for torchcfm alone; (b) lr-find
    wrote lr_find.png into the repository root on the device, where nothing comes back; (c) the default budget is
    the one docs/performance.md's device commands give."""
    bench = load("gpu_session")
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "torchcfm-1.0-py3-none-any.whl").write_text("")
    monkeypatch.setattr(bench, "WHEELS", wheels)
    calls = []

    def run(cmd, **kwargs):  # POT and GeomLoss import, torchcfm does not
        calls.append(cmd)
        return __import__("subprocess").CompletedProcess(cmd, int("torchcfm" in cmd[-1]) if "-c" in cmd else 0)

    monkeypatch.setattr(bench.subprocess, "run", run)
    bench.environment()
    assert any("pip" in cmd and "install" in cmd for cmd in calls)
    ran = []
    monkeypatch.setattr(bench, "run_step", lambda argv, log, timeout, env: ran.append(argv) or ("ok", 0.0))
    bench.run_plan(tuple(s for s in bench.PLAN if s.name == "lr-find"), 1e6, tmp_path / "out", env={})
    assert ran[0][ran[0].index("--out") + 1] == str((tmp_path / "out" / "lr_find.png").resolve())
    monkeypatch.setattr(bench, "check", lambda plan, smoke: [])
    bench.main(["--check"])
    docs = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text()
    # each device call the docs give fits one call as the default does (b0cde5c split the plan over two calls, 540 s
    # and 300 s, and the equality with 560 failed), and a call's --only steps fit its budget
    calls = re.findall(r"gpu_session\.py --budget (\d+) [^\n]*?(?:--only ([\w -]+))?\n", docs)
    assert calls and all(int(budget) <= 560 for budget, _ in calls), calls
    seconds = {s.name: s.seconds for s in bench.PLAN}
    for budget, only in calls:
        assert sum(seconds[name] for name in only.split()) <= int(budget), (budget, only)
    assert "one call holds 560 s" in capsys.readouterr().out


def test_train_throughput_without_torchcfm_has_no_nan_row(quiet, capsys, monkeypatch):
    bench = load("train_throughput")

    def missing(*args):
        raise ImportError("No module named 'torchcfm'")

    monkeypatch.setattr(bench, "torchcfm_step", missing)
    bench.main(["--smoke", "--device", "cpu", "--batch", "2", "--steps", "1", "--warmup", "0", "--paths", "fast"])
    out = capsys.readouterr().out
    header = rows(out, "path ")[0]
    assert "not importable" in out and "nanx" not in out and "vs torchcfm" not in header
    assert not rows(out, "torchcfm" + " " * 10)  # the message names it; no table row does
    assert "1 timed steps after 0 warm-up" in out  # --warmup 0 is taken as 0, not as the default


def test_mnist_table_head_names_the_precision_a_set_training_precision_samples_in(mnist_bench):
    """benchmarks/mnist.py's table head said what `sample.precision: auto` is for a UNet on the device, and ignored
    `--every train.velocity.precision=...`, which auto keeps on a CUDA card: a T4's fp16 read "sampled in fp32", a
    network kept in fp32 on an H100 "sampled in fp16"."""
    from argparse import Namespace

    def head(device, *every):
        return mnist_bench.sampled_in(Namespace(device=device, every=list(every)))

    assert head("cpu") == head("cpu", "train.velocity.precision=fp16") == "sampled in fp32 (sample.precision=auto)"
    assert head("cuda", "train.velocity.precision=fp16") == "sampled in fp16 (sample.precision=auto)"
    assert head("cuda", "train.velocity.precision=fp32") == "sampled in fp32 (sample.precision=auto)"
    assert head("cuda", "train.velocity.precision=fp16", "sample.precision=bf16") == \
        "sampled in bf16 (sample.precision=bf16)"


def test_helper__dist():
    """A process group of this one process for the split-step check and row (gloo on the CPU), gone afterwards, also
    when the work inside it fails (a later check's trainer would otherwise average in a group that is no longer
    wanted)."""
    import torch
    import torch.distributed as tdist

    from sinkflow.runtime import dist

    group_of_one = load("_dist").group_of_one
    with group_of_one(torch.device("cpu")):
        assert dist.grouped() and tdist.get_world_size() == 1 and dist.current().world == 1
    assert not dist.grouped()
    with pytest.raises(RuntimeError, match="inside"):
        with group_of_one(torch.device("cpu")):
            raise RuntimeError("inside")
    assert not dist.grouped()
