import pytest

from sinkflow import config
from sinkflow.cli import main
from sinkflow.errors import SinkflowError


@pytest.mark.parametrize("preset", config.preset_names())
def test_shorthands_reach_every_phase_key(preset):
    cfg = config.resolve(preset, [], {"train_iters": 7, "batch_size": 12, "seed": 3, "device": "cpu",
                                      "pool_batches": 4, "sinkhorn_batch": 16})
    flat = config.flatten(cfg)
    iters = {k: v for k, v in flat.items() if k.startswith("train.") and k.endswith(".iters")}
    batch = {k: v for k, v in flat.items() if k.startswith("train.") and k.endswith(".batch_size")}
    assert iters and set(iters.values()) == {7}, iters
    assert batch and set(batch.values()) == {12}, batch
    assert cfg["experiment"]["seed"] == 3 and cfg["experiment"]["device"] == "cpu"
    assert cfg["pool"]["batches"] == 4 and cfg["pool"]["batch_size"] == 16
    # every key that *looks* like an iteration count is reached (a missed phase would hang for hours)
    for key, value in flat.items():
        if key.split(".")[-1] in ("iters", "num_iterations", "iterations"):
            assert value == 7, key


def test_explicit_override_wins_over_shorthand():
    cfg = config.resolve("moons", ["train.velocity.iters=9"], {"train_iters": 7})
    assert cfg["train"]["velocity"]["iters"] == 9


def test_unknown_key_names_closest():
    with pytest.raises(SinkflowError, match="did you mean 'pool.eta'"):
        config.resolve("moons", ["pool.etaa=0.1"])


@pytest.mark.parametrize("override,msg", [
    ("pool.eta=abc", "expects float"),
    ("train.velocity.iters=2.5", "expects int"),
    ("pool.eta_growth=yes", "expects float"),
    ("experiment.method=nsfg", "did you mean 'nsgf'"),
    ("train.velocity.iters=0", "must be >= 1"),
    ("pool.eta", "not of the form"),
])
def test_bad_values(override, msg):
    with pytest.raises(SinkflowError, match=msg):
        config.resolve("moons", [override])


def test_values_parse_like_yaml():
    cfg = config.resolve("moons", ["train.velocity.lr=1e-3", "eval.steps=[5, 50]", "data.path=/x/y"])
    assert cfg["train"]["velocity"]["lr"] == 1e-3
    assert cfg["eval"]["steps"] == [5, 50]
    assert cfg["data"]["path"] == "/x/y"


def test_unknown_preset():
    with pytest.raises(SinkflowError, match="did you mean 'moons'"):
        config.resolve("moon")


def test_config_command_prints_tree(capsys):
    assert main(["config", "moons", "--train-iters", "5", "pool.eta=0.5"]) == 0
    out = capsys.readouterr().out
    assert "iters: 5" in out and "eta: 0.5" in out and "target: moons" in out


def test_cli_error_is_one_line(capsys):
    assert main(["config", "moons", "pool.nope=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown config key 'pool.nope'" in err[0]
