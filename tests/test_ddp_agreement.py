"""Every rank of a torchrun job runs the same config: ranks started with different options (a wrapper adding one
rank's own --train-iters) ran different loops, and the first to finish waited forever in a collective the others
never reached. They now stop at start-up, every one, with one line naming the first differing key and the ranks,
before any folder exists (a new run) or anything in the run folder changes (a resume)."""

import shutil

from helpers import bytes_snapshot
from test_ddp import COMMON, _torchrun


def test_ranks_started_with_different_options_stop_before_any_folder(runs_dir, tmp_path):
    wrapper = tmp_path / "per_rank.py"  # what a per-rank wrapper script does: one rank gets its own option
    wrapper.write_text("import os, sys\nfrom sinkflow.cli import main\n"
                       "sys.exit(main(sys.argv[1:] + (['--train-iters', '8'] if os.environ['RANK'] == '1' else [])))\n")
    out = _torchrun(*COMMON, "--name", "mm", cwd=tmp_path, entry=(str(wrapper),), timeout=120)  # old code: a hang
    assert out.returncode != 0
    # every rank stops; rank 0 says why, once (each rank printed the same line)
    said = "started with different options: train.velocity.iters is 6 on rank 0 but 8 on rank 1"
    assert out.stderr.count(said) == 1 and "same command and options" in out.stderr, out.stderr[-3000:]
    assert "terminate called" not in out.stderr and "Connection closed" not in out.stderr, out.stderr[-3000:]
    assert not (runs_dir / "mm").exists()


def test_a_resume_whose_ranks_differ_is_refused_before_the_folder_changes(tiny_run, tmp_path, monkeypatch, capsys):
    """The resume path compares the overrides' result (rank 0 was given checkpoint.keep=4, rank 1 another value); the
    gather is simulated in one process, as rank 0 of two."""
    import torch.distributed as tdist

    from sinkflow.cli import main
    from sinkflow.runtime import dist

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    before = bytes_snapshot(run)

    def gather(out, mine):
        out[:] = [mine, {**mine, "checkpoint.keep": "5"}]

    monkeypatch.setattr(dist, "current", lambda: dist.DistInfo(0, 2))
    monkeypatch.setattr(tdist, "all_gather_object", gather)
    monkeypatch.setattr(dist, "leave", lambda: None)  # no process group was joined
    assert main(["train", "--resume", str(run), "checkpoint.keep=4", "--no-report"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint.keep is 4 on rank 0 but 5 on rank 1" in err[0], err
    assert bytes_snapshot(run) == before
