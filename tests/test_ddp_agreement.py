"""Every rank of a torchrun job runs the same config: ranks started with different options (a wrapper adding one
rank's own --train-iters) ran different loops, and the first to finish waited forever in a collective the others
never reached. They now stop at start-up, every one, with one line naming the first differing key and the ranks,
before any folder exists (a new run) or anything in the run folder changes (a resume)."""

import shutil

import pytest

from helpers import bytes_snapshot, run_main
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

    def gather(out, mine):  # the configs differ; the checks' outcomes (dist.on_every) are alike
        out[:] = [mine, {**mine, "checkpoint.keep": "5"} if isinstance(mine, dict) else mine]

    monkeypatch.setattr(dist, "current", lambda: dist.DistInfo(0, 2))
    monkeypatch.setattr(tdist, "all_gather_object", gather)
    monkeypatch.setattr(dist, "leave", lambda: None)  # no process group was joined
    assert main(["train", "--resume", str(run), "checkpoint.keep=4", "--no-report"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint.keep is 4 on rank 0 but 5 on rank 1" in err[0], err
    assert bytes_snapshot(run) == before


def test_nodes_in_other_folders_compare_what_the_run_reads_as_absolute_paths(tmp_path, monkeypatch):
    """Two nodes started in different folders (the gather simulated, as rank 0 of two): a 2D run was refused for a
    data.root it never reads, while relative run folders went to two places without a word. The keys the run reads
    are compared, runs_dir as an absolute path, and a path that differs with the folder says so."""
    import pytest
    import torch.distributed as tdist

    from sinkflow import config
    from sinkflow.engine.experiment import check_ranks_agree
    from sinkflow.errors import SinkflowError
    from sinkflow.runtime import dist
    from sinkflow.runtime.run_folder import DATA_PATH_KEYS, absolute_data_paths

    elsewhere = str(tmp_path / "node1")

    def gather(out, mine):  # rank 1 resolved its relative paths in its own folder
        out[:] = [mine, {k: (v.replace(str(tmp_path), elsewhere) if isinstance(v, str) else v)
                         for k, v in mine.items()}]

    monkeypatch.setattr(dist, "current", lambda: dist.DistInfo(0, 2))
    monkeypatch.setattr(tdist, "all_gather_object", gather)
    monkeypatch.chdir(tmp_path)
    same_runs = [f"experiment.runs_dir={tmp_path.parent / 'shared-runs'}"]
    check_ranks_agree(absolute_data_paths(config.resolve("moons", same_runs), DATA_PATH_KEYS))  # data.root: unread
    with pytest.raises(SinkflowError, match=r"experiment\.runs_dir is .* on rank 0 but .*node1/runs.* on rank 1: the "
                                            r"nodes were started in different working directories; start every node"):
        check_ranks_agree(absolute_data_paths(config.resolve("moons"), DATA_PATH_KEYS))
    with pytest.raises(SinkflowError, match=r"data\.root is .* on rank 0 but .*node1/data.* different working dir"):
        check_ranks_agree(absolute_data_paths(config.resolve("digits", same_runs), DATA_PATH_KEYS))


def test_a_rank_that_cannot_see_the_run_folder_stops_every_rank(tmp_path, monkeypatch):
    """Nodes with their own disks: rank 1 read a pool, checkpoints and config.yaml that were never on its disk (and
    said to delete the good pool on node 0), or resumed a stale copy from another step (a hang). Rank 0 writes a
    probe into the folder; a rank that cannot read it back stops every rank in one line (the gather simulated, as
    rank 0 of two, rank 1 on a node that does not see the file); the probe is removed."""
    import pytest

    from sinkflow.errors import SinkflowError
    from sinkflow.runtime import dist
    from sinkflow.runtime.run_folder import check_shared

    monkeypatch.setattr(dist, "current", lambda: dist.DistInfo(0, 2))
    monkeypatch.setattr(dist, "broadcast_object", lambda obj, src=0: obj)
    monkeypatch.setattr(dist, "on_main", lambda work: work())
    monkeypatch.setattr(dist, "all_gather_object", lambda mine: [mine, (False, "node1")])
    with pytest.raises(SinkflowError, match=r"rank 1 on node1 cannot see the run folder .* that rank 0 writes.*; put "
                                            r"experiment\.runs_dir on a filesystem every node mounts") as err:
        check_shared(tmp_path)
    assert err.value.every_rank and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(dist, "all_gather_object", lambda mine: [mine, mine])  # rank 1 read it back: nothing said
    check_shared(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rank", [0, 1])
def test_a_refusal_every_rank_makes_alike_is_one_line_from_rank_0(rank, runs_dir, monkeypatch, capsys):
    """A config the ranks share and compared, refused by the method's check (NSGF++ with pool.steps=6), or a resume
    refused by its checkpoints: every rank printed the same line (8 GPUs, 8 lines). Rank 0 prints it once and the
    other ranks exit 2 in silence; the gather is simulated in one process, as rank 0 and as rank 1 of two."""
    from sinkflow.runtime import dist

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setattr(dist, "current", lambda: dist.DistInfo(rank, 2))
    monkeypatch.setattr(dist, "all_gather_object", lambda mine: [mine, mine])  # every rank found the same
    monkeypatch.setattr(dist, "leave", lambda: None)  # no process group was joined
    rc, err = run_main(capsys, "train", "moons", "--method", "nsgfpp", "pool.steps=6", "--device", "cpu")
    said = [line for line in err.splitlines() if line.startswith("sinkflow: error:")]
    assert rc == 2 and len(said) == (1 if rank == 0 else 0), err
    assert rank or "pool.steps=6 but NSGF++ uses at most 5 NSGF steps" in said[0]
    assert not runs_dir.exists()


def test_a_check_that_fails_on_one_rank_alone_stops_every_rank_and_rank_0_names_it(runs_dir, monkeypatch, capsys):
    """A check that passes on rank 0 but fails on another (a node whose own disk lacks room for the pool, a resume's
    folder another node cannot see): rank 0 went on alone into its next collective, and its line was a lost peer's.
    Every rank now stops before any folder, and rank 0 says which rank stopped and why (the gather simulated)."""
    from sinkflow.runtime import dist

    monkeypatch.setattr(dist, "current", lambda: dist.DistInfo(0, 2))
    monkeypatch.setattr(dist, "all_gather_object",
                        lambda mine: [mine, mine if isinstance(mine, dict) else "no room here; free disk space"])
    monkeypatch.setattr(dist, "leave", lambda: None)
    rc, err = run_main(capsys, "train", *COMMON)
    said = [line for line in err.splitlines() if line.startswith("sinkflow: error:")]
    assert rc == 2 and said == ["sinkflow: error: rank 1 stopped: no room here; free disk space"], err
    assert not runs_dir.exists()


@pytest.mark.parametrize("rank", [0, 1])
def test_the_datas_warnings_are_rank_0s_alone(rank, runs_dir, monkeypatch, capsys, caplog):
    """Every rank reads the same data (check_ranks_agree), and each printed its warnings: a point file far from unit
    scale was said 8 times on 8 GPUs. Rank 0 says them; the ranks simulated in one process, as in the test above."""
    import numpy as np

    from sinkflow.runtime import dist

    np.save(runs_dir.parent / "pts.npy", np.random.default_rng(0).normal(size=(200, 2)).astype(np.float32) * 1e-3)
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setattr(dist, "current", lambda: dist.DistInfo(rank, 2))
    monkeypatch.setattr(dist, "all_gather_object", lambda mine: [mine, mine])
    monkeypatch.setattr(dist, "leave", lambda: None)
    rc, err = run_main(capsys, "train", "moons", "data.target=pts.npy", "data.test_rows=50", "eval.n=100",
                       "--device", "cpu")  # refused once the file is read: 100 test points of 50 held out
    said = [r for r in caplog.records if "its points spread" in r.getMessage()]
    assert rc == 2 and ("holds out only data.test_rows=50" in err) == (rank == 0), err  # rank 0's one line
    assert len(said) == (1 if rank == 0 else 0), said
