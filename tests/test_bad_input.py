"""Bad input: a non-zero exit, one line naming the problem, no traceback, nothing overwritten."""

import shutil

import numpy as np
import pytest

from helpers import cli, error_line, snapshot


def one_line_error(result, *needles):
    error_line(result.returncode, result.stderr, *needles)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_run):
    cwd = tmp_path_factory.mktemp("bad")
    shutil.copytree(tiny_run, cwd / "runs" / "ok")  # a finished `train moons TINY_2D --no-report`
    return cwd


def test_unknown_key(tmp_path):
    one_line_error(cli("train", "moons", "train.velocity.iter=5", cwd=tmp_path), "unknown config key", "iters")
    assert not (tmp_path / "runs").exists()


def test_help_status_and_config_errors_answer_before_torch_loads(tmp_path):
    """`--help`, `status` and a bad key answer without importing torch (seconds on a login node or a busy box):
    each command module loads the engine inside its run(), after the arguments are checked."""
    import subprocess
    import sys

    calls = [["status", str(tmp_path)], ["train", "moons", "pool.stepz=3"], ["sample", "RUN", "--out", "x.txt"],
             ["eval"], ["bench", "moons", "--warmup", "-1"], ["bench", "moons", "--profile", "--throughput"],
             ["doctor", "moons", "--overfit-batch", "0"], ["doctor", "moons", "--factor", "nan"],
             ["doctor", "moons", "--factor", "0.5"], ["preflight", "moons", "--gpu", "foo"],
             ["doctor", "moons", "--phase", ""], ["preflight", str(tmp_path)]]
    code = ("import sys\nfrom sinkflow.cli import main\nfor argv in %r:\n    try:\n        print(main(argv))\n"
            "    except SystemExit as exc:\n        print(exc.code)\nprint('torch' in sys.modules)\n" % calls)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout.split() == ["2"] * len(calls) + ["False"], out.stdout + out.stderr
    assert "not a sinkflow run folder" in out.stderr and "unknown config key 'pool.stepz'" in out.stderr
    assert "must end in .npy or .png" in out.stderr and "required: RUN" in out.stderr
    assert "--warmup -1 is not a valid budget" in out.stderr
    assert "--throughput: not allowed with argument --profile" in out.stderr  # was: throughput, silently
    # doctor's own numbers: a 0-sample batch ran the checks then crashed; --factor nan failed "the loop is broken"
    assert "--overfit-batch 0 must be a whole number >= 1" in out.stderr
    assert "--factor nan must be a number > 1" in out.stderr and "--factor 0.5 must be a number > 1" in out.stderr
    assert "unknown GPU 'foo'; use one of T4" in out.stderr  # it loaded the planner (and torch) first: 2.6 s
    assert "--phase '' names no phase" in out.stderr  # it checked every phase, "only phase(s)  checked"
    assert f"{tmp_path} is a folder without config.yaml: not a sinkflow run folder" in out.stderr


def test_a_folder_of_images_given_as_a_run_names_the_folder_preset_before_torch_loads(tmp_path):
    """`sinkflow preflight imgs/` (a user's first check of a folder of images) said only "not a sinkflow run folder;
    name a run folder, a preset or a .yaml config", and doctor / lr-find the same after loading torch; `sinkflow
    train imgs/` names `train folder data.path=imgs` (found walking the image-folder journey, audit WW)."""
    import subprocess
    import sys

    imgs = tmp_path / "my imgs"
    imgs.mkdir()
    calls = [[command, str(imgs)] for command in ("preflight", "doctor", "lr-find")]
    code = ("import sys\nfrom sinkflow.cli import main\nfor argv in %r:\n    print(main(argv))\n"
            "print('torch' in sys.modules)\n" % calls)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout.split() == ["2"] * len(calls) + ["False"], out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 3, lines
    for (command, _), line in zip(calls, lines):
        assert line.endswith(f"for a folder of your own images: `sinkflow {command} folder 'data.path={imgs}'` "
                             "(docs/data.md)"), line


def test_doctor_and_lr_find_refuse_a_wrong_preset_or_key_before_torch_loads(tmp_path):
    """`sinkflow doctor runs/typo` (a run folder mistyped) or `lr-find moons pool.etaa=1`: the one-line refusal came
    after torch and the tools had loaded (seconds), where a plain folder's was already said before them (found in
    review, audit ZZ: the config was resolved only after the imports)."""
    import subprocess
    import sys

    calls = [[command, *rest] for command in ("doctor", "lr-find")
             for rest in (["runs/typo"], ["moons", "pool.etaa=1"])]
    code = ("import sys\nfrom sinkflow.cli import main\nfor argv in %r:\n    print(main(argv))\n"
            "print('torch' in sys.modules)\n" % calls)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout.split() == ["2"] * len(calls) + ["False"], out.stdout + out.stderr
    assert out.stderr.count("unknown preset 'runs/typo'") == 2 and out.stderr.count("'pool.etaa'") == 2, out.stderr


TOO_OLD = ("sinkflow needs torch>=2.4 and torchvision>=0.19, this Python has {}; pip install -U 'torch>=2.4' "
           "'torchvision>=0.19', then restart Python (a notebook: its kernel)")


def test_an_older_torch_stops_import_sinkflow_in_one_line(monkeypatch):
    """pyproject.toml said torch>=2.2, and on torch 2.2 (a notebook image's own) a run got as far as its first
    training step and died there in a traceback: torch.amp.GradScaler is torch 2.3, torch.OutOfMemoryError 2.4. The
    floor is now the oldest torch the suite passed on, checked by ``import sinkflow``: one line, the fix in it."""
    import sys

    import torch

    from sinkflow import torch_floor as errors

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # check_torch sets its one-line hook: put back after
    monkeypatch.setattr(torch, "__version__", "2.2.2+cu121")  # a notebook that imported torch first: its version
    error = errors.torch_too_old()
    assert isinstance(error, ImportError) and str(error) == TOO_OLD.format("torch 2.2.2+cu121")
    with pytest.raises(errors.TorchTooOld, match=r"this Python has torch 2\.2\.2\+cu121; pip install -U"):
        errors.check_torch()
    monkeypatch.setattr(torch, "__version__", "2.3.1")
    assert str(errors.torch_too_old()) == TOO_OLD.format("torch 2.3.1")
    for version in ("2.4.0", "2.4.1+cu121", "2.6.0a0+ecf3bae40a", "2.10.0", "2.14.1+cu130", "3.0.0"):  # 2.10 > 2.4
        monkeypatch.setattr(torch, "__version__", version)
        assert errors.torch_too_old() is None, version
    # torch not imported yet: the installed packages' metadata is read, torch is not loaded for it
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torchvision", None)
    found = {"torch": "2.3.1", "torchvision": "0.18.1"}
    monkeypatch.setattr(errors.metadata, "version", lambda name: found[name])
    assert str(errors.torch_too_old()) == TOO_OLD.format("torch 2.3.1 and torchvision 0.18.1")
    found["torch"] = "2.4.1"
    assert str(errors.torch_too_old()) == TOO_OLD.format("torchvision 0.18.1")


def test_the_checked_floor_is_the_one_pyproject_declares():
    """pip installs what pyproject.toml declares, ``import sinkflow`` checks ``TORCH_MINIMUM``: one floor."""
    import re
    from pathlib import Path

    from sinkflow.torch_floor import TORCH_MINIMUM

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    declared = dict(re.findall(r'"(torch|torchvision)>=([0-9.]+)"', text))
    assert declared == {name: ".".join(map(str, floor)) for name, floor in TORCH_MINIMUM.items()}, declared


def test_the_sinkflow_command_on_an_older_torch_prints_one_line():
    """The console script imports sinkflow first: the check's line, with no traceback above it (exit status 1, the
    import failing before the command's own handling), and nothing trained."""
    import subprocess
    import sys

    code = ("import sys, types\nsys.modules['torch'] = types.SimpleNamespace(__version__='2.2.2')\n"
            "from sinkflow.cli import entry\nentry()\n")
    out = subprocess.run([sys.executable, "-c", code, "train", "moons"], capture_output=True, text=True)
    assert (out.returncode, out.stdout) == (1, ""), out.stdout + out.stderr
    assert out.stderr.splitlines() == [f"sinkflow: error: {TOO_OLD.format('torch 2.2.2')}"], out.stderr


def test_version_names_sinkflow_torch_and_python_before_torch_loads():
    """There was no `sinkflow --version`: a bug report's first line had to be pieced together by hand."""
    import platform
    import subprocess
    import sys
    from importlib import metadata

    import sinkflow

    code = ("import sys\nfrom sinkflow.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit as exc:\n"
            "    print(exc.code)\nprint('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.splitlines() == [f"sinkflow {sinkflow.__version__} (torch {metadata.version('torch')}, Python "
                                       f"{platform.python_version()})", "0", "False"], out.stdout + out.stderr


def test_config_doc_and_base_refuse_what_they_would_ignore_and_a_folder_is_no_config_file(tmp_path, capsys):
    """`config moons --base pool.eta=-1` printed the schema's defaults, the preset and the invalid override dropped in
    silence; `config dir.yaml` (a folder) said "does not exist"."""
    from sinkflow.cli import main

    for argv, needle in ((["config", "moons", "--base"], "moons would be ignored; drop it, or see a preset's resolved "
                          "keys: `sinkflow config moons`"),
                         (["config", "--doc", "pool.eta=-1"], "pool.eta=-1 would be ignored"),
                         (["config", "--base", "--train-iters", "0"], "--train-iters would be ignored")):
        assert main(argv) == 2
        assert needle in capsys.readouterr().err, argv
    assert main(["config", "--base"]) == 0 and "holdout: every_tenth" in capsys.readouterr().out
    (tmp_path / "dir.yaml").mkdir()
    assert main(["config", str(tmp_path / "dir.yaml")]) == 2
    assert "dir.yaml is a folder, not a file; name the .yaml file itself" in capsys.readouterr().err


def test_every_command_help_has_an_example(capsys):
    """README: "Every command has `--help` with an example" (bench had none)."""
    from sinkflow.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    for name, parser in commands.items():
        assert "example" in (parser.epilog or ""), name


def test_wrong_type(tmp_path):
    one_line_error(cli("train", "moons", "pool.steps=many", cwd=tmp_path), "pool.steps", "expects int")


def test_missing_file(tmp_path):
    one_line_error(cli("train", "moons", "data.target=nope.npy", cwd=tmp_path), "nope.npy")
    assert not (tmp_path / "runs").exists()


def test_wrongly_shaped_npy(tmp_path):
    np.save(tmp_path / "p.npy", np.random.randn(100).astype(np.float32))  # 1-D: not an (N, D) array
    one_line_error(cli("train", "moons", "data.target=p.npy", cwd=tmp_path), "p.npy")
    assert not (tmp_path / "runs").exists()


def test_npy_dimension_mismatch_with_source(tmp_path):
    np.save(tmp_path / "p.npy", np.random.randn(100, 3).astype(np.float32))  # 3-D points, 2-D 8gaussians source
    one_line_error(cli("train", "8gaussians-moons", "data.target=p.npy", cwd=tmp_path), "shape")
    assert not (tmp_path / "runs").exists()


def test_nan_in_data(tmp_path):
    x = np.random.randn(100, 2)
    x[7, 1] = np.nan
    np.save(tmp_path / "p.npy", x)
    one_line_error(cli("train", "moons", "data.target=p.npy", cwd=tmp_path), "NaN")


def test_truncated_checkpoint(finished_run):
    run = finished_run / "runs/ok"
    ck = run / "checkpoints/velocity/final.pt"
    data = ck.read_bytes()
    ck.write_bytes(data[: len(data) // 3])
    before = snapshot(run)
    one_line_error(cli("sample", str(run), "--n", "4", "--out", str(finished_run / "s.npy"), cwd=finished_run),
                   "corrupt or truncated")
    assert snapshot(run) == before
    ck.write_bytes(data)


def test_a_folder_of_pngs_is_refused_for_points_and_never_written_into(finished_run):
    """`sample --out DIR` writes one PNG per image: a 2D run, or a folder that holds files, is one line before
    any sampling, and the folder is left as it was."""
    run = finished_run / "runs/ok"
    one_line_error(cli("sample", str(run), "--n", "4", "--out", str(finished_run / "pngs/"), cwd=finished_run),
                   "but this run draws points")
    assert not (finished_run / "pngs").exists()
    used = finished_run / "used"
    used.mkdir()
    (used / "000000.png").write_bytes(b"mine")
    # a points run: that it draws points, whether the folder is new or used (its files were said to "mix" with
    # images); an image run's used folder is refused as such (tests/test_images.py)
    one_line_error(cli("sample", str(run), "--n", "4", "--out", str(used), cwd=finished_run), "but this run draws points")
    assert [p.name for p in used.iterdir()] == ["000000.png"] and (used / "000000.png").read_bytes() == b"mine"


def test_truncated_step_checkpoint_on_resume(tiny_run, tmp_path):
    run = tmp_path / "runs/t"
    shutil.copytree(tiny_run, run)  # a finished `train moons TINY_2D --no-report` (6 steps)
    (run / "checkpoints/velocity/final.pt").unlink()  # as if killed after the step-6 checkpoint
    step = sorted((run / "checkpoints/velocity").glob("step_*.pt"))[-1]
    step.write_bytes(step.read_bytes()[:100])
    before = snapshot(run)
    one_line_error(cli("train", "--resume", str(run), cwd=tmp_path), "corrupt or truncated", step.name)
    assert snapshot(run) == before


def test_not_a_run_folder(tmp_path):
    one_line_error(cli("eval", str(tmp_path), cwd=tmp_path), "not a sinkflow run folder")


def test_an_unrecognized_argument_is_named_as_the_sub_commands(capsys):
    """The top-level parser reported a sub-command's stray argument as its own ("sinkflow: error: sinkflow: ...",
    see `sinkflow --help`); it is now the sub-command's, and a key=value given to a command without config keys
    says so."""
    import pytest

    from sinkflow.cli import main

    for argv, needle in ((["status", "RUN", "eval.protocol=iid"],  # (eval and sample take sample.* keys)
                          "sinkflow: error: sinkflow status: unrecognized arguments: eval.protocol=iid (it takes no "
                          "config keys); see `sinkflow status --help`"),
                         (["train", "moons", "--bogus"],
                          "sinkflow: error: sinkflow train: unrecognized arguments: --bogus; see `sinkflow train --help`"),
                         (["evl"], "sinkflow: error: argument COMMAND: invalid choice: 'evl'"),
                         (["eval"], "sinkflow: error: sinkflow eval: the following arguments are required: RUN; see "
                          "`sinkflow eval --help`"),  # it listed the optional overrides as required too
                         (["sample", "--out", "x.npy"], "sinkflow: error: sinkflow sample: the following arguments are "
                          "required: RUN; see")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.startswith(needle) and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("device, needle", [("mps", "MPS (Apple GPU) is not available here"),
                                            ("gpu", "is not a device"), ("xla", "is not supported")])
def test_a_device_this_machine_lacks_is_one_line_before_the_run_folder(tmp_path, monkeypatch, capsys, device,
                                                                       needle):
    """--device mps on a machine without MPS was a traceback from the pool, after the run folder was made."""
    import torch

    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    monkeypatch.chdir(tmp_path)
    one_line_error(in_process(capsys, "train", "moons", "--device", device, "--train-iters", "1"), needle)
    assert not (tmp_path / "runs").exists()


def in_process(capsys, *argv):
    """``cli(...)``'s result from ``sinkflow.cli.main`` in this process (no interpreter and torch start: seconds)."""
    from types import SimpleNamespace

    from sinkflow.cli import main

    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)


@pytest.mark.parametrize("name, where", [("../escape", "outside runs"), ("sub/run", "in a subfolder of runs"),
                                         ("..", "outside runs"), (".", "in runs itself")])
def test_a_run_name_that_is_a_path_is_refused_before_any_folder(tmp_path, monkeypatch, capsys, name, where):
    """`--name ../escape` made the run folder outside experiment.runs_dir; the refusal says where the run would have
    gone (it said 'outside runs' of `--name sub/run` too, which would be made in runs/sub/run)."""
    monkeypatch.chdir(tmp_path)
    one_line_error(in_process(capsys, "train", "moons", "--name", name, "--train-iters", "1", "--device", "cpu"),
                   "is a path, not a folder name", f"(the run would be made {where})")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("preset, overrides, needle", [
    ("moons", ["model.velocity.kind=unet"], "set model.velocity.kind=mlp for flat data"),
    ("moons", ["--method", "nsgfpp", "model.nsf.kind=unet"], "set model.nsf.kind=mlp for flat data"),
    ("digits", ["model.velocity.num_heads=3"], "change model.velocity.num_heads or model.velocity.channels"),
    ("digits", ["model.velocity.num_head_channels=5"], "not divisible by num_head_channels=5; change model.velocity."),
    ("moons", ["pool.batch_size=1"], "config key 'pool.batch_size' must be >= 2"),
    ("digits", ["eval.n=1", "eval.class_n=1"], "eval.n=1: digits is scored by FD-CNN, a Fréchet distance")])
def test_a_network_or_count_the_data_cannot_serve_is_refused_before_the_pool_is_built(
        tmp_path, monkeypatch, capsys, preset, overrides, needle):
    """A UNet on 2D points, heads that do not divide its widths: each phase's network was first built when its
    phase started, after the run folder and the pool (hours on CIFAR-10), or after a whole velocity phase for the
    NSF's. Every network is built on the meta device before anything is written, its error naming the key to set.
    One image to score (eval.n=1) failed in the report after training, in numpy's eigensolver."""
    monkeypatch.chdir(tmp_path)
    one_line_error(in_process(capsys, "train", preset, *overrides, "--train-iters", "1", "--device", "cpu"), needle)
    assert not (tmp_path / "runs").exists()


def test_make_refuses_a_torch_install_the_disk_cannot_hold_before_pip_runs(tmp_path):
    """A full disk failed a CI install half-way through pip (Errno 28): the Makefile checks the free space first."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)   # the venv exists: only the torch step is left to run
    makefile = Path(__file__).resolve().parents[1] / "Makefile"
    out = subprocess.run(["make", "-f", str(makefile), f"VENV={venv}", "TORCH_DISK_GB=100000000",
                          "TORCH_SPEC=no-such-package-sinkflow-test", f"{venv}/.torch"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode != 0
    assert "GB free on the disk" in out.stderr and "torch needs about 100000000 GB" in out.stderr
    assert "pip" not in out.stdout and not (venv / ".torch").exists()


def test_a_tilde_in_a_path_argument_is_the_home_folder(tiny_run, tmp_path, monkeypatch, capsys):
    """`sample RUN --out=~/s.npy` (the shell leaves a ~ after "=" as it is) made a folder named "~" in the working
    directory and wrote there; `status '~/runs/x'` said "not a sinkflow run folder". As data paths and config files
    are, a leading ~ is the home folder."""
    import shutil

    from helpers import run_main

    shutil.copytree(tiny_run, tmp_path / "home" / "r")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    assert run_main(capsys, "sample", "~/r", "--n", "4", "--out=~/s.npy", "--device", "cpu")[0] == 0
    assert (tmp_path / "home" / "s.npy").is_file() and not (tmp_path / "cwd" / "~").exists()
    assert run_main(capsys, "status", "~/r")[0] == 0


def test_sample_seed_out_of_the_seed_range_is_refused(tiny_run, tmp_path, monkeypatch, capsys):
    """`sample --seed -1` drew what --seed 18446744073709551615 draws (and seeds past 2**64 wrapped), where
    experiment.seed (and `train --seed -1`) refuses anything outside [0, 2**63 - 1]."""
    from helpers import run_main

    monkeypatch.chdir(tmp_path)
    for seed in ("-1", str(2**64)):
        rc, err = run_main(capsys, "sample", str(tiny_run), "--n", "4", "--out", "s.npy", "--seed", seed)
        assert rc == 2 and f"--seed {seed} must be in [0, 9223372036854775807]; e.g. --seed 0" in err, err
        assert not (tmp_path / "s.npy").exists()
