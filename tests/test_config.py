import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from sinkflow import config
from sinkflow.cli import main
from sinkflow.config import render, schema
from sinkflow.errors import SinkflowError


@pytest.mark.parametrize("preset", config.preset_names())
def test_shorthands_reach_every_phase_key(preset):
    pool = "pool.batches" in schema.used(config.resolve(preset))  # a one-key shorthand of an unread key: refused
    cfg = config.resolve(preset, [], {"train_iters": 7, "batch_size": 12, "seed": 3, "device": "cpu",
                                      "precision": "fp32",
                                      **({"pool_batches": 4, "sinkhorn_batch": 16} if pool else {})})
    flat = config.flatten(cfg)
    iters = {k: v for k, v in flat.items() if k.startswith("train.") and k.endswith(".iters")}
    batch = {k: v for k, v in flat.items() if k.startswith("train.") and k.endswith(".batch_size")}
    precision = {k: v for k, v in flat.items() if k.startswith("train.") and k.endswith(".precision")}
    assert iters and set(iters.values()) == {7}, iters
    assert batch and set(batch.values()) == {12}, batch
    assert precision and set(precision.values()) == {"fp32"}, precision  # fp32 one flag away on every phase
    assert cfg["experiment"]["seed"] == 3 and cfg["experiment"]["device"] == "cpu"
    assert not pool or cfg["pool"]["batches"] == 4 and cfg["pool"]["batch_size"] == 16
    if not pool:  # `--pool-batches 4` on a flow run was dropped in silence; `pool.batches=4` is refused, and so is it
        with pytest.raises(SinkflowError, match=r"config key 'pool.batches' is not read by method"):
            config.resolve(preset, [], {"pool_batches": 4})
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
    ("train.velocity.prefetch=on", "must be one of auto, always, never .got bool True, YAML for on/off"),
    ("train.velocity.accum=3", "accum=3 does not divide train.velocity.batch_size=256.*a divisor of 256 .e.g. 2"),
])
def test_bad_values(override, msg):
    with pytest.raises(SinkflowError, match=msg):
        config.resolve("moons", [override])


def test_values_parse_like_yaml():
    cfg = config.resolve("moons", ["train.velocity.lr=1e-3", "eval.steps=[5, 50]", "experiment.runs_dir=/x/y"])
    assert cfg["train"]["velocity"]["lr"] == 1e-3
    assert cfg["eval"]["steps"] == [5, 50]
    assert cfg["experiment"]["runs_dir"] == "/x/y"


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


def test_presets_resolve_as_before_the_schema():
    """Every preset x method resolves to the tree it had before the schema (tests/data/resolved_presets.json,
    made by tests/data/make_resolved_presets.py on main d6ad35e, model sections as the model builder saw them;
    train.*.precision / compile = auto and channels_last = false since issue 23 changed those defaults, measured;
    model.*.use_scale_shift_norm = auto since 2026-11-28, measured)."""
    snapshot = json.loads((Path(__file__).parent / "data" / "resolved_presets.json").read_text())
    assert {name.partition(" --method ")[0] for name in snapshot} == set(config.preset_names())
    for name, old in snapshot.items():
        preset, _, method = name.partition(" --method ")
        if method == "flow" and old["data"]["target"] in schema.POINT_TARGETS_2D:  # refused since 2026-11-27, as train did
            with pytest.raises(SinkflowError, match="experiment.method=flow models images"):
                config.resolve(preset, [], {"method": method})
            continue
        cfg = config.resolve(preset, [], {"method": method})
        new, before = config.flatten(cfg), config.flatten(old)
        own = set(config.flatten(config._raw_preset(preset)))  # digits sets its UNet's conditioning (measured)
        film = {k: "auto" for k in before if k.endswith(".use_scale_shift_norm") and k not in own}
        assert {k: new.get(k, "missing") for k in before} == {**before, **film}, name
        # keys added since (a new method's section, sample.qmc...) hold their defaults (or the preset's own value):
        # behaviour as before, but for a UNet's use_scale_shift_norm (auto since 2026-11-28: FiLM where ADM's groups
        # cancel an added t; measured, docs/models.md)
        specs = schema.keys(cfg)
        assert {k: v for k, v in new.items() if k not in before and k not in own} == \
            {k: specs[k].default for k in new if k not in before and k not in own}, name


# ---- the schema: one declaration, everything else generated from it or checked against it ------------------

def test_base_yaml_and_config_doc_are_generated_from_the_schema():
    """presets/_base.yaml and docs/config.md are the schema's; regenerate with `sinkflow config --base/--doc`."""
    base = Path(config.__file__).parent / "presets" / "_base.yaml"
    assert base.read_text() == render.base_yaml(), "run: sinkflow config --base > sinkflow/config/presets/_base.yaml"
    assert yaml.safe_load(base.read_text()) == schema.defaults()
    doc = Path(__file__).parent.parent / "docs" / "config.md"
    assert doc.read_text() == render.doc_markdown(), "run: sinkflow config --doc > docs/config.md"


def _other_value(key):
    """A valid value of ``key`` that is not its default (the default itself when the rule allows one value)."""
    rule, default = key.rule, key.default
    if isinstance(rule, schema.Options):
        return next((c for c in rule.choices if c != default), default)
    if isinstance(rule, schema.Bool):
        return not default
    if isinstance(rule, schema.AutoBool):
        return True if default == "auto" else "auto"
    if isinstance(rule, schema.Str):
        return "x-test"
    if isinstance(rule, schema.ListOf):
        first = schema.Key(default[0] if default else None, rule.item, "", nullable=True)
        return [_other_value(first)]
    if isinstance(rule, schema.Int):
        candidates = [] if default is None else [default + 1, default - 1]
        candidates += [rule.lo if rule.lo is not None else 1, 1, 2]
    else:
        candidates = [] if default is None else [default * 0.5, default + 0.25]
        candidates += [(rule.lo or 0) + 0.25, 0.25, 1.5]
    return next(v for v in candidates if v != default and rule.violation(rule.coerce(v)) is None)


def _kind_setup(name):
    """The override that gives a model key's section the kind the key belongs to (set first)."""
    parts = name.split(".")
    if parts[0] != "model" or parts[2] == "kind":
        return []
    kinds = schema.kinds_with(parts[1], parts[2])
    return [] if schema.MODEL[parts[1]].default_kind in kinds else [f"model.{parts[1]}.kind={kinds[0]}"]


def _a_run_that_reads(name):
    """(preset, method, overrides) of a run that reads key ``name`` (the first found)."""
    for preset in ["moons", "digits", "flow-digits", "folder", *config.preset_names()]:
        for method in schema.METHODS:
            for extra in ([], ["sinkhorn.solver=geomloss"], ["data.target=points.npy"]):  # resolving reads no file
                try:
                    cfg = config.resolve(preset, [*extra, *_kind_setup(name)], {"method": method})
                except SinkflowError:  # sinkhorn.solver on a method without a pool
                    continue
                if name in schema.used(cfg):
                    return preset, method, [*extra, *_kind_setup(name)]
    raise AssertionError(f"no preset x method reads {name}")


@pytest.mark.parametrize("name", list(schema.all_keys()))
def test_every_key_is_settable_from_the_command_line(name):
    if name == "experiment.preset":  # only relabelled the run, its keys the first preset's: the preset is named
        with pytest.raises(SinkflowError, match=r"experiment.preset=digits would only relabel the run: its keys are "
                                                r"still moons's; name the preset instead: `sinkflow train digits`"):
            config.resolve("moons", ["experiment.preset=digits"])
        return
    key = schema.all_keys()[name]
    value = _other_value(key)
    preset, method, setup = _a_run_that_reads(name)
    cfg = config.resolve(preset, [*setup, f"{name}={render.scalar(value)}"], {"method": method})
    assert config.get(cfg, name) == value
    config.validate(cfg)


def test_every_key_a_run_reads_through_the_cli_at_once(capsys):
    cfg = config.resolve("moons")
    values = {k: _other_value(key) for k, key in schema.used(cfg).items()
              if not k.endswith(".kind") and k not in ("experiment.method", "sinkhorn.solver", "experiment.preset")}
    for k in [k for k in values if k.endswith(".accum")]:  # one rule across two keys: accum divides batch_size
        values[k.replace(".accum", ".batch_size")] = config.get(cfg, k.replace(".accum", ".batch_size")) * values[k]
    overrides = [f"{k}={render.scalar(v)}" for k, v in values.items()]
    assert main(["config", "moons", "--plain", *overrides]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    for item in overrides:
        k, _, text = item.partition("=")
        assert config.get(cfg, k) == config.parse_value(text) or k == "experiment.preset", k


@pytest.mark.parametrize("name", list(schema.all_keys()))
def test_a_misspelled_key_names_the_closest_key(name):
    with pytest.raises(SinkflowError, match=f"unknown config key '{name}x'; did you mean '{name}'"):
        config.resolve("moons", [*_kind_setup(name), f"{name}x=1"])


def test_a_key_of_another_model_kind_says_which_kind_has_it(capsys):
    assert main(["config", "moons", "model.velocity.channel_mult=[1, 2]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'model.velocity.channel_mult' is a unet key but model.velocity.kind is mlp" in err[0]
    assert "model.velocity.kind=unet first" in err[0]
    cfg = config.resolve("moons", ["model.velocity.kind=unet", "model.velocity.channel_mult=[1, 2]"])
    assert cfg["model"]["velocity"] == {"kind": "unet", **schema.model_defaults("unet"), "channel_mult": [1, 2]}
    back = config.resolve("digits", ["model.velocity.kind=mlp"])["model"]["velocity"]  # from the mlp defaults
    assert back == {"kind": "mlp", **schema.model_defaults("mlp")}


@pytest.mark.parametrize("override,msg", [
    ("model.velocity.kind=unte", "must be one of mlp, unet .*did you mean 'unet'"),
    ("model.time.kind=mlp", "must be one of time_predictor"),
    ("data.channels=2", "'data.channels' must be one of 1, 3"),
    ("data.image_size=0", "'data.image_size' must be >= 1"),
    ("data.image_size=abc", "expects int or null"),
    ("eval.steps=[0]", "'eval.steps' must have every element in \\[1, 100000\\]"),
    ("sinkhorn.scaling=1.0", r"'sinkhorn.scaling' must be in \(0, 1\)"),
    ("train.velocity.ema=null", "cannot be null"),
    ("model.velocity.time_freqs=-1", "must be >= 0"),
])
def test_rule_errors_name_the_key_and_the_rule(override, msg):
    with pytest.raises(SinkflowError, match=msg):
        config.resolve("moons", [override])


def test_documented_model_keys_are_settable():
    """Keys that docs/models.md documents and the old base tree did not hold."""
    cfg = config.resolve("digits", ["model.velocity.use_scale_shift_norm=true", "model.velocity.pad_mode=zeros"])
    assert cfg["model"]["velocity"]["use_scale_shift_norm"] is True and cfg["model"]["velocity"]["pad_mode"] == "zeros"
    assert config.resolve("moons", ["model.velocity.time_freqs=6"])["model"]["velocity"]["time_freqs"] == 6


def _printed_keys(out: str) -> set[str]:
    """Dotted keys of `sinkflow config`'s commented YAML."""
    keys, path = set(), []
    for line in out.splitlines():
        text = line.split(" #")[0].rstrip()
        if not text or text.startswith("#"):
            continue
        depth = (len(text) - len(text.lstrip())) // 2
        name, _, value = text.strip().partition(":")
        path = path[:depth] + [name]
        if value.strip():
            keys.add(".".join(path))
    return keys


@pytest.mark.parametrize("preset,method,want,not_want", [
    ("moons", None, {"pool.eta", "model.velocity.hidden", "sinkhorn.max_iters", "sample.steps"},
     {"model.velocity.channels", "model.nsf.kind", "model.time.kind", "model.flow.arch", "train.nsf.iters",
      "data.root", "data.channels", "sample.nsf_steps", "sample.temperature", "sinkhorn.backend"}),
    ("digits", None, {"model.velocity.channel_mult", "model.time.channels", "train.time.lr", "data.flip",
                      "sample.nsf_steps"},
     {"model.velocity.hidden", "model.flow.arch", "train.flow.iters", "data.path", "sample.temperature"}),
    ("digits", "fm", {"model.velocity.channel_mult", "sample.steps", "eval.steps"},
     {"pool.eta", "sinkhorn.blur", "nsgf.time", "model.nsf.kind", "train.time.iters"}),
    ("flow-digits", None, {"model.flow.levels", "model.flow.n_bins", "train.flow.warmup", "sample.temperature"},
     {"model.velocity.kind", "pool.eta", "sample.steps", "eval.steps", "train.velocity.iters"}),
])
def test_config_prints_only_the_keys_the_run_reads(capsys, preset, method, want, not_want):
    argv = ["config", preset, *(["--method", method] if method else [])]
    assert main(argv) == 0
    shown = _printed_keys(capsys.readouterr().out)
    assert want <= shown and not shown & not_want, (want - shown, shown & not_want)
    assert main([*argv, "--all"]) == 0
    every = _printed_keys(capsys.readouterr().out)
    cfg = config.resolve(preset, [], {"method": method})
    assert every == set(config.flatten(cfg)) and shown < every


def test_method_phases_match_the_methods():
    """METHOD_PHASES (read by the schema without building anything) names what each method's phases() builds."""
    from sinkflow import methods

    for method in schema.METHODS:  # every registered method: one added later is checked too
        preset = "flow-digits" if schema.METHOD_REGISTRY[method].images_only else "moons"
        cfg = config.resolve(preset, ["data.download=false"] if preset != "moons" else [], {"method": method})
        phases = methods.get(method).phases(cfg, *methods.distributions(cfg))
        assert tuple(p.name for p in phases) == methods.METHOD_PHASES[method]
        for p in phases:
            if getattr(p, "model_key", None):
                assert p.model_key == p.name and f"model.{p.name}.kind" in schema.used(cfg)


def test_choice_lists_agree_with_the_code():
    from sinkflow.data import TOY2D
    from sinkflow.data.points import POINT_SUFFIXES
    from sinkflow.data.images import IMAGE_SETS, SPLITS
    from sinkflow.flows import MEMORY_MODES
    from sinkflow.flows.coupling import SCALE_MAPS
    from sinkflow.models.mlp import ACTIVATIONS
    from sinkflow.ot.velocity import LANDINGS, SCHEDULES

    assert schema.ACTIVATIONS == tuple(ACTIVATIONS)
    assert schema.IMAGE_TARGETS == tuple(IMAGE_SETS)
    assert set(schema.POINT_TARGETS_2D) == set(TOY2D) | {"8gaussians-qmc"}
    assert schema.POINT_FILE_SUFFIXES == POINT_SUFFIXES
    assert schema.DATA["split"].rule.choices == SPLITS
    assert schema.POOL_KEYS["schedule"].rule.choices == SCHEDULES
    assert schema.POOL_KEYS["landing"].rule.choices == LANDINGS
    assert schema.MODEL_KINDS["flow"]["memory"].rule.choices == MEMORY_MODES
    assert schema.MODEL_KINDS["flow"]["scale"].rule.choices == SCALE_MAPS


def test_an_old_run_folders_config_reads_back(tmp_path):
    """config.yaml as sinkflow wrote it before the schema (every kind's keys in each model section)."""
    from sinkflow.runtime.run_folder import read_config

    (tmp_path / "config.yaml").write_text((Path(__file__).parent / "data" / "run_config_6a93012.yaml").read_text())
    cfg = read_config(tmp_path)
    # as written then (nsgf.segment 0.5, the blur-0.1 solver, 192 pool batches); keys added since (pool.qmc,
    # nsgf.nsf_pairs) take the schema default, or the value they had before (data.holdout: schema.BEFORE_ADDED);
    # the speed settings it wrote (fp32, channels_last, eager) stay what it trained with
    expected = config.resolve("moons", ["experiment.name=old", "nsgf.segment=0.5", "pool.qmc=false",
                                        "sinkhorn.blur=0.1", "sinkhorn.max_iters=30", "pool.landing=sinkhorn",
                                        "pool.batches=192"])
    had = yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]  # a phase added since (a new method's)
    for name, section in expected["train"].items():  # holds its defaults; all: the EMA without the warm-up
        section.update(ema_warmup=False, **(dict(precision="fp32", channels_last=True, compile=False)  # BEFORE_ADDED
                                            if name in had else {}))
    expected["data"]["holdout"] = "last_tenth"
    expected["sample"]["precision"] = "fp32"  # BEFORE_ADDED: the sampler's precision before the key (fp32)
    assert cfg == expected
    (tmp_path / "config.yaml").write_text("experiment: {preset: moons}\npool: {etaa: 1}\n")
    with pytest.raises(SinkflowError, match=r"has unknown key 'pool.etaa'; edit that file \(did you mean 'pool.eta'"):
        read_config(tmp_path)


def test_a_run_folder_written_before_sample_precision_samples_in_fp32(tmp_path):
    """sample.precision came in (caf769c) with the default fp32, which became auto (fp16 for a UNet on a CUDA card
    with bf16 tensor cores): a digits run's config.yaml written before the key read back auto, and its evaluation or
    its NSGF++ states on such a card switched to fp16 in silence (schema.BEFORE_ADDED). One that wrote the key keeps
    what it wrote; a new run gets auto."""
    from sinkflow import methods
    from sinkflow.runtime.run_folder import read_config

    tree = config.resolve("digits", ["experiment.name=old"])
    assert tree["sample"]["precision"] == "auto"
    for written, want in ((None, "fp32"), ("fp32", "fp32"), ("auto", "fp16"), ("bf16", "bf16")):
        old = copy.deepcopy(tree)
        if written is None:
            del old["sample"]["precision"]
        else:
            old["sample"]["precision"] = written
        (tmp_path / "config.yaml").write_text(config.dump_run_config(old))
        cfg = read_config(tmp_path)
        assert cfg["sample"]["precision"] == (written or "fp32"), written
        assert methods.of(cfg).sample_precision(cfg, "cuda", bf16=True) == want, written


def test_every_shorthand_flag_sets_schema_keys():
    """Each shorthand flag is one SHORTHANDS entry, and each of its patterns names keys of the schema."""
    import argparse

    from sinkflow.cli.common import add_config_args

    p = argparse.ArgumentParser()
    add_config_args(p)
    flags = {a.dest for a in p._actions if a.option_strings and a.dest != "help"}
    assert flags == set(config.SHORTHANDS)
    for name, patterns in config.SHORTHANDS.items():
        for pattern in patterns:
            assert config.expand_key(schema.defaults(), pattern), (name, pattern)


@pytest.mark.parametrize("override, key, want", [
    ("experiment.name=0123", "experiment.name", "0123"),  # YAML 1.1: octal 83, and `sinkflow train` made runs/83
    ("experiment.name='0123'", "experiment.name", "0123"),  # quoted: 123.0
    ('experiment.name="1.50"', "experiment.name", "1.50"),  # 1.5
    ("experiment.name=12:30", "experiment.name", "12:30"),  # base 60: 750
    ("experiment.name=yes", "experiment.name", "yes"),  # a bool, refused
    ("experiment.name=2024", "experiment.name", "2024"),
    ("experiment.name=null", "experiment.name", None),
    ("data.target=1e3", "data.target", "1e3"),  # 1000.0
    ("train.velocity.iters=010", "train.velocity.iters", 10),  # octal 8
    ("train.velocity.lr=1e-3", "train.velocity.lr", 1e-3),
])
def test_override_values_are_read_as_typed(override, key, want):
    from sinkflow.config import flatten

    assert flatten(config.resolve("moons", [override]))[key] == want


def test_a_base_60_looking_number_is_not_an_int():
    with pytest.raises(SinkflowError, match=r"'train.velocity.iters' expects int .* got str '1:30'"):
        config.resolve("moons", ["train.velocity.iters=1:30"])


@pytest.mark.parametrize("override", ["train.velocity.lr=.nan", "pool.eta=1e400", "train.velocity.iters=.inf",
                                      "train.velocity.lr=nan", "pool.eta=-inf", "train.velocity.iters=Infinity"])
def test_a_non_finite_number_is_named_so(override):
    """It read "expects float (default 0.001) but got float nan; pass a float" (YAML's .nan), and "got str 'nan'" for
    Python's spelling."""
    with pytest.raises(SinkflowError, match=r"must be a finite number \(got '?(\.?nan|\.?inf|-inf|Infinity)'?\)"):
        config.resolve("moons", [override])


def test_a_list_with_a_bad_element_names_the_element():
    """It read "expects list (default [10, 100]) but got list [10, 'abc']"."""
    with pytest.raises(SinkflowError, match=r"'eval.steps' expects a list of int in \[1, 100000\], but its element 'abc' is a str"):
        config.resolve("moons", ["eval.steps=[10,abc]"])


def test_a_config_file_of_your_own_trains_what_it_says(tmp_path, capsys, monkeypatch):
    """`sinkflow config moons > my.yaml`, edit, `sinkflow train my.yaml`: not documented before and not working
    (`unknown preset 'my.yaml'`); a path without .yaml was joined onto the preset folder (any file loaded, the run
    folder made next to it)."""
    monkeypatch.chdir(tmp_path)
    assert main(["config", "moons"]) == 0
    text = capsys.readouterr().out
    assert "  eta: " in text
    (tmp_path / "my.yaml").write_text(text.replace("  name: null", "  name: mine", 1))
    got = config.resolve("my.yaml", ["train.velocity.iters=7"])
    assert got == config.resolve("moons", ["experiment.name=mine", "train.velocity.iters=7"])
    (tmp_path / "typo.yaml").write_text(text.replace("  eta: ", "  etaa: ", 1))
    with pytest.raises(SinkflowError, match=r"config file typo.yaml, line [0-9]+: unknown config key 'pool.etaa'; did you mean 'pool.eta'"):
        config.resolve("typo.yaml")
    (tmp_path / "moon.yaml").write_text("experiment:\n  preset: moon\n")  # a typo ran the schema's defaults silently
    with pytest.raises(SinkflowError, match=r"config file moon.yaml names experiment.preset 'moon', which is no preset, "
                                            r"and leaves \d+ keys the run reads unset .*; did you mean 'moons'\?"):
        config.resolve("moon.yaml")
    (tmp_path / "mine.yaml").write_text(text.replace("  preset: moons", "  preset: mine", 1))  # every key set: a label
    assert config.resolve("mine.yaml")["experiment"]["preset"] == "mine"
    (tmp_path / "bad.yaml").write_text("pool: [1\n")
    with pytest.raises(SinkflowError, match=r"config file bad.yaml is not valid YAML \(line 2\)"):
        config.resolve("bad.yaml")
    with pytest.raises(SinkflowError, match=r"config file moons.yaml does not exist; did you mean the preset 'moons'"):
        config.resolve("moons.yaml")
    (tmp_path / "p").write_text("experiment: {}\n")
    with pytest.raises(SinkflowError, match=r"unknown preset '\./p'; a config file of your own ends in .yaml"):
        config.resolve("./p")
    small = ["pool.batches=1", "pool.batch_size=16", "pool.steps=2", "--train-iters", "2", "--no-report"]
    assert main(["train", "my.yaml", *small, "--device", "cpu"]) == 0  # the file's run, then a resume naming it:
    capsys.readouterr()  # "cannot resume as preset 'my.yaml': it is a run of preset 'moons'" for its own file
    assert main(["train", "my.yaml", "--resume", str(tmp_path / "runs" / "mine")]) == 2
    err = capsys.readouterr().err.strip()
    assert "with the config file 'my.yaml': a resume reads the run's own config.yaml" in err and "\n" not in err
    assert f"drop the file (`sinkflow train --resume {tmp_path / 'runs' / 'mine'}`)" in err


@pytest.mark.parametrize("key, text, value", [
    ("train.velocity.lr", "1e-3", 0.001), ("train.velocity.lr", "1.0e3", 1000.0), ("train.velocity.iters", "010", 10),
    ("train.velocity.iters", "1e4", 10000), ("experiment.name", "0123", "0123"), ("experiment.name", "12:30", "12:30"),
    ("experiment.name", "0x1F", "0x1F"), ("experiment.name", "1.50", "1.50"), ("experiment.name", "2024-01-05",
                                                                              "2024-01-05"),
    ("experiment.runs_dir", "0755", "0755"), ("eval.steps", "[010, 1e2]", [10, 100]), ("eval.steps", "10,100", [10, 100]),
    ("train.velocity.ema", ".5", 0.5), ("pool.qmc", "yes", True), ("experiment.name", "~", None)])
def test_a_value_in_a_config_file_reads_as_on_the_command_line(tmp_path, monkeypatch, key, text, value):
    """YAML 1.1 read a hand-edited ``iters: 010`` as octal 8, ``name: 0123`` as '83', ``12:30`` as 750, a date as
    a date, and refused ``lr: 1e-3`` (a string to it) that the command line takes: the same text is the same value
    in a file and on the command line now."""
    monkeypatch.chdir(tmp_path)
    section, *mid, leaf = key.split(".")
    body = "".join(f"{'  ' * i}{part}:\n" for i, part in enumerate([section, *mid]))
    (tmp_path / "q.yaml").write_text(f"experiment:\n  preset: moons\n" * (section != "experiment") + body +
                                     ("  preset: moons\n" if section == "experiment" else "") +
                                     f"{'  ' * (len(mid) + 1)}{leaf}: {text}\n")
    assert config.get(config.resolve("q.yaml"), key) == value
    assert config.get(config.resolve("moons", [f"{key}={text}"]), key) == value


def test_a_key_given_twice_in_a_config_file_is_refused_naming_both_lines(tmp_path, monkeypatch):
    """PyYAML keeps the last of two equal keys: a second ``train:`` section replaced the first (its lr lost) in
    silence, and `lr-find --write` rewrote the first of two ``lr:`` while the second won."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.yaml").write_text("experiment:\n  preset: moons\ntrain:\n  velocity:\n    lr: 0.005\ntrain:\n"
                                     "  velocity:\n    iters: 20\n")
    with pytest.raises(SinkflowError, match=r"config file d.yaml is not valid YAML \(line 6\): the key 'train' is "
                                            r"given twice \(lines 3 and 6\)"):
        config.resolve("d.yaml")


def test_a_yaml_merge_key_in_a_config_file_is_read_as_yaml_reads_it(tmp_path, monkeypatch):
    """``<<: *anchor`` (one phase's keys shared with another) was refused as "not valid YAML: could not determine a
    constructor for the tag merge": the duplicate-key check built the ``<<`` key itself. Its keys are merged, the
    section's own keys win, and a key given twice beside it is still refused."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.yaml").write_text("experiment: {preset: digits}\ntrain:\n  nsf: &t\n    lr: 5e-4\n    iters: 7\n"
                                     "  time:\n    <<: *t\n    iters: 9\n")
    cfg = config.resolve("m.yaml")
    assert cfg["train"]["time"]["lr"] == 0.0005 and cfg["train"]["time"]["iters"] == 9
    assert cfg["train"]["nsf"]["iters"] == 7
    (tmp_path / "m.yaml").write_text("experiment: {preset: digits}\ntrain:\n  nsf: &t {lr: 5e-4}\n  time:\n"
                                     "    <<: *t\n    iters: 9\n    iters: 8\n")
    with pytest.raises(SinkflowError, match=r"the key 'iters' is given twice \(lines 6 and 7\)"):
        config.resolve("m.yaml")


def test_a_bad_value_in_a_config_file_names_its_line_and_the_files_form(tmp_path, monkeypatch):
    """A bad value in a file of a hundred keys was named by its dotted key alone, and the example was the command
    line's `train.velocity.lr=0.001`: the error names the line, and the example is written as the file writes it."""
    from sinkflow.runtime.run_folder import read_config

    monkeypatch.chdir(tmp_path)
    text = "experiment:\n  preset: moons\n# a comment\ntrain:\n  velocity:\n    iters: 30\n    lr: abc\n"
    (tmp_path / "d.yaml").write_text(text)
    with pytest.raises(SinkflowError, match=r"^config file d.yaml, line 7: config key 'train.velocity.lr' expects "
                                            r"float .*; pass a float, e.g. lr: 0.001$") as err:
        config.resolve("d.yaml")
    assert "train.velocity.lr=" not in str(err.value)
    (tmp_path / "d.yaml").write_text(text.replace("lr: abc", "lr: 0.002").replace("iters: 30", "iters: -5"))
    with pytest.raises(SinkflowError, match=r"^config file d.yaml, line 6: config key 'train.velocity.iters' must be "
                                            r">= 1 \(got -5\); e.g. iters: "):
        config.resolve("d.yaml")
    (tmp_path / "d.yaml").write_text(text.replace("lr: abc", "lrr: 1"))
    with pytest.raises(SinkflowError, match=r"^config file d.yaml, line 7: unknown config key 'train.velocity.lrr'"):
        config.resolve("d.yaml")
    run = tmp_path / "run"  # a run's config.yaml edited by hand: the same line, and the fix is to edit that file
    run.mkdir()
    (run / "config.yaml").write_text(text.replace("lr: abc", "lr: [1, 2]"))
    with pytest.raises(SinkflowError, match=rf"^{re.escape(str(run / 'config.yaml'))}, line 7: config key "
                                            r"'train.velocity.lr' expects float .*; edit that file \(pass a float, "
                                            r"e.g. lr: 0.001\)$"):
        read_config(run)


def test_own_data_named_where_a_preset_goes_gets_the_command_that_trains_on_it(tmp_path, capsys, monkeypatch):
    """`sinkflow train pts.npy` (a user's first try with their own points) listed the presets and nothing else; the
    line now names the command that trains on the file, or on a folder of images, and then does what it says."""
    import numpy as np

    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "pts.npy", np.random.default_rng(0).normal(size=(300, 2)).astype(np.float32))
    (tmp_path / "imgs").mkdir()
    assert main(["train", "pts.npy"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sinkflow: error: unknown preset 'pts.npy'") and "\n" not in err, err
    assert "`sinkflow train moons data.target=pts.npy`" in err, err
    with pytest.raises(SinkflowError, match=r"unknown preset 'imgs/'; a folder of your own images: `sinkflow train "
                                            r"folder data.path=imgs/`"):
        config.resolve("imgs/")
    with pytest.raises(SinkflowError, match=r"unknown preset 'sub/pts.csv'; .* data.target=sub/pts.csv"):
        config.resolve("sub/pts.csv")
    (tmp_path / "runs" / "r").mkdir(parents=True)  # a run folder where a preset goes (`bench runs/r`): it said
    (tmp_path / "runs" / "r" / "config.yaml").write_text("experiment: {}\n")  # "train on it as images"
    with pytest.raises(SinkflowError, match=r"unknown preset 'runs/r'; runs/r is a run folder: its config.yaml is a "
                                            r"config file \(`... runs/r/config.yaml`\), and `sinkflow train --resume "
                                            r"runs/r` continues the run"):
        config.resolve("runs/r")
    assert config.resolve("moons", ["data.target=pts.npy"])["data"]["target"] == "pts.npy"  # the command named


def test_old_run_folders_keep_the_unet_they_trained_and_new_runs_get_film_where_groups_are_single_channels(tmp_path):
    """New runs: ADM's groups (norm_min_channels 1) and use_scale_shift_norm auto, i.e. FiLM in the blocks whose
    GroupNorm has one channel per group. A run folder from before either key changed lists use_scale_shift_norm:
    false: without norm_min_channels (before 2026-11-27) it reads ADM's groups and builds the t-less network it
    trained, with norm_min_channels: 2 (2026-11-27) its groups of two; a resume builds what it checkpointed."""
    from sinkflow.models import build_model
    from sinkflow.runtime.run_folder import read_config

    def blocks(cfg):  # per residual block: (channels per group of the norm after the embedding, FiLM?)
        net = build_model("unet", cfg["model"]["velocity"], (1, 8, 8))
        return {(b.out_layers[0].num_channels // b.out_layers[0].num_groups, b.use_scale_shift_norm)
                for b in net.modules() if hasattr(b, "emb_layers")}

    new = config.resolve("mnist")
    assert (new["model"]["velocity"]["norm_min_channels"], new["model"]["velocity"]["use_scale_shift_norm"]) == (1, "auto")
    assert blocks(new) == {(1, True), (2, False)}  # 32 channels: one a group, t by FiLM; 64: ADM's added t
    assert blocks(config.resolve("mnist", ["model.velocity.channels=128"])) == {(4, False), (8, False)}  # unchanged
    assert blocks(config.resolve("digits")) == {(2, False)}  # the digits preset's own measured choice
    old = config.resolve("mnist", ["model.velocity.use_scale_shift_norm=false", "model.velocity.norm_min_channels=2",
                                   "model.nsf.use_scale_shift_norm=false", "model.nsf.norm_min_channels=2"])
    (tmp_path / "config.yaml").write_text(config.dump(old))
    assert blocks(read_config(tmp_path)) == {(2, False)}  # 2026-11-27's groups of two, t added
    for phase in ("velocity", "nsf"):
        del old["model"][phase]["norm_min_channels"]
    (tmp_path / "config.yaml").write_text(config.dump(old))
    assert blocks(read_config(tmp_path)) == {(1, False), (2, False)}  # before: ADM's groups, t added (and cancelled)


@pytest.mark.parametrize("method, override, fix", [
    ("nsgf", "train.nsf.ema=0.5", "drop it, or train a method that reads it (--method nsgfpp)"),
    ("nsgf", "sinkhorn.backend=online", "drop it: it matters only then"),
    ("nsgfpp", "sinkhorn.backend=online", "drop it: it matters only then")])
def test_an_unread_key_names_a_method_only_where_that_method_would_read_it(method, override, fix):
    """`sinkhorn.backend` under `sinkhorn.solver=converged` is read by no method: the error had sent NSGF to
    `--method nsgfpp` and NSGF++ back to `--method nsgf`, each refused the same way."""
    overrides = [f"experiment.method={method}", override]
    if override.startswith("sinkhorn."):
        overrides.insert(1, "sinkhorn.solver=converged")
    with pytest.raises(SinkflowError) as e:
        config.resolve("moons", overrides)
    assert str(e.value).endswith(fix), str(e.value)
    assert "sinkhorn.solver=geomloss" in str(e.value) or not override.startswith("sinkhorn.")  # when it is read


def test_an_empty_config_file_is_refused_not_trained_as_the_defaults(tmp_path, monkeypatch):
    """`sinkflow config moonz > my.yaml` fails and leaves my.yaml empty; `sinkflow train my.yaml` then trained the
    schema's defaults under the file's name."""
    monkeypatch.chdir(tmp_path)
    for text in ("", "# only a comment\n\n"):
        (tmp_path / "my.yaml").write_text(text)
        with pytest.raises(SinkflowError, match=r"config file my.yaml is empty .*; a failed `sinkflow config PRESET > "
                                                r"my.yaml` leaves it empty"):
            config.resolve("my.yaml")


def test_a_runs_dir_under_home_is_expanded(tmp_path, monkeypatch):
    """`experiment.runs_dir: ~/runs` made a folder named `~` in the working directory (an `rm -rf ~` waiting to
    happen), and the resume line it printed pointed elsewhere."""
    from sinkflow.cli import main

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "moons", "pool.batches=1", "pool.batch_size=16", "pool.steps=2", "--train-iters", "2",
                 "experiment.runs_dir=~/runs", "--name", "h", "--device", "cpu", "--no-report"]) == 0
    assert (tmp_path / "home" / "runs" / "h" / "config.yaml").is_file() and not (tmp_path / "~").exists()


def test_an_online_backend_without_pykeops_is_refused_before_the_folder(tmp_path, monkeypatch, capsys):
    """GeomLoss's online backend needs pykeops: the pool failed after config.yaml and meta.json were written; and a
    run with the converged solver, which reads no backend, failed on it too."""
    import importlib.util
    import sys

    from sinkflow.cli import main

    if importlib.util.find_spec("pykeops") is not None:
        monkeypatch.setitem(sys.modules, "pykeops", None)
    monkeypatch.chdir(tmp_path)
    small = ["pool.batches=1", "pool.batch_size=16", "pool.steps=2", "--train-iters", "2", "--device", "cpu",
             "--no-report"]
    assert main(["train", "moons", *small, "sinkhorn.solver=geomloss", "sinkhorn.backend=online", "--name", "o"]) == 2
    assert "needs pykeops" in capsys.readouterr().err and not (tmp_path / "runs" / "o").exists()
    tree = config.resolve("moons", ["sinkhorn.solver=geomloss", "sinkhorn.backend=online"])
    tree["sinkhorn"]["solver"] = "converged"  # a config.yaml written so: the key is not read, and nothing needs it
    from sinkflow.methods import nsgf

    nsgf.check(tree)


def test_a_config_file_key_the_run_does_not_read_is_warned_about_once(tmp_path, monkeypatch, caplog):
    """On the command line `train.nsf.ema=0.5` for an NSGF run is an error; in a config file it was dropped in
    silence. A warning names such keys (set away from the preset's value) once; a file from `sinkflow config --all`,
    which lists every key at its value, says nothing."""
    import logging

    monkeypatch.chdir(tmp_path)
    (tmp_path / "q.yaml").write_text("experiment:\n  preset: moons\ntrain:\n  nsf:\n    ema: 0.5\n"
                                     "sample:\n  temperature: 0.7\n")
    with caplog.at_level(logging.WARNING, logger="sinkflow"):
        config.resolve("q.yaml")
        config.resolve("q.yaml")
    said = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
    assert said == ["config file q.yaml sets 2 key(s) this nsgf run does not read (train.nsf.ema, "
                    "sample.temperature): unused"], said
    caplog.clear()
    (tmp_path / "all.yaml").write_text(yaml.safe_dump(config.resolve("moons")))  # every key, at its value
    with caplog.at_level(logging.WARNING, logger="sinkflow"):
        config.resolve("all.yaml")
    assert not [r for r in caplog.records if "does not read" in r.getMessage()]


def test_fid_weights_are_checked_before_training_and_kept_absolute(tmp_path, monkeypatch, capsys):
    """`eval.inception_weights=~/w.pth` trained every phase, then failed at the report ("is not a file": no ~
    expansion); a relative path named another file once `sinkflow eval RUN` ran from elsewhere."""
    from sinkflow.cli import main
    from sinkflow.runtime.run_folder import RunFolder

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "digits", "eval.inception_weights=~/w.pth", "--device", "cpu", "--name", "f"]) == 2
    assert "eval.inception_weights=~/w.pth is not a file" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "f").exists()
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "w.pth").write_bytes(b"weights")
    run = RunFolder.create(config.resolve("digits", ["eval.inception_weights=~/w.pth", "experiment.name=f"]))
    assert RunFolder.open(run.dir).cfg["eval"]["inception_weights"] == str(tmp_path / "home" / "w.pth")


def test_fid_packages_are_checked_before_training(tmp_path, monkeypatch, capsys):
    """With the weights file there but torch-fidelity not installed (torchmetrics alone does not bring it), every
    phase trained and the report then failed: "FID needs torch-fidelity ..., which is not installed"."""
    import sys

    from sinkflow.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "torch_fidelity", None)  # not importable, whatever this machine has
    (tmp_path / "w.pth").write_bytes(b"weights")
    assert main(["train", "digits", f"eval.inception_weights={tmp_path / 'w.pth'}", "--device", "cpu",
                 "--name", "f"]) == 2
    assert re.search(r"FID needs (torchmetrics and )?torch_fidelity, not installed here; pip install torchmetrics "
                     r"torch-fidelity, or set eval.inception_weights=null", capsys.readouterr().err)
    assert not (tmp_path / "runs" / "f").exists()


def test_a_resume_checks_the_fid_settings_before_training_and_before_config_yaml(tmp_path, monkeypatch, capsys):
    """A new run is refused on a missing weights file or torch-fidelity before its folder exists; a resume skipped
    both: `--resume RUN eval.inception_weights=BAD` trained every phase left, was refused at the report, and kept
    BAD in config.yaml, so every later `sinkflow eval RUN` failed too (found walking the cifar10 journey, audit XX)."""
    import sys

    from sinkflow.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "torch_fidelity", None)  # not importable, whatever this machine has
    from sinkflow.runtime.run_folder import RunFolder

    tiny = ["experiment.name=f", "experiment.device=cpu", "train.velocity.iters=1", "train.nsf.iters=1",
            "train.time.iters=1", "pool.batches=1", "pool.batch_size=4", "model.velocity.channels=8",
            "model.nsf.channels=8", "eval.n=4", "train.velocity.warmup=0", "train.nsf.warmup=0"]
    run = RunFolder.create(config.resolve("digits", tiny)).dir  # the folder, nothing trained yet
    capsys.readouterr()
    (tmp_path / "w.pth").write_bytes(b"weights")
    for value, said in ((tmp_path / "nope.pth", "nope.pth is not a file"),
                        (tmp_path / "w.pth", "FID needs torch_fidelity, not installed here")):
        assert main(["train", "--resume", str(run), f"eval.inception_weights={value}"]) == 2
        assert yaml.safe_load((run / "config.yaml").read_text())["eval"]["inception_weights"] is None
        assert not (run / "checkpoints" / "velocity").exists()  # refused before the phases
        err = capsys.readouterr().err
        assert said in err and f"as `sinkflow train --resume {run} key=value`; or resume with --no-report" in err


def test_a_file_named_like_a_preset_without_naming_one_is_refused(tmp_path, monkeypatch):
    """`lab/moons.yaml` holding `pool: {eta: 0.5}` was labelled preset 'moons' but trained the schema's defaults (a
    `mnist.yaml` so made trained a 2D run); a file that sets every key is its own recipe, whatever its name."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "moons.yaml").write_text("pool:\n  eta: 0.5\n")
    with pytest.raises(SinkflowError, match=r"config file lab/moons.yaml names no experiment.preset, so its keys go "
                                            r"over the schema's defaults, not preset 'moons''s.*; add `experiment: "
                                            r"\{preset: moons\}`"):
        config.resolve("lab/moons.yaml")
    (tmp_path / "lab" / "moons.yaml").write_text("experiment:\n  preset: moons\npool:\n  eta: 0.5\n")
    assert config.resolve("lab/moons.yaml")["pool"]["eta"] == 0.5
    (tmp_path / "lab" / "mine.yaml").write_text("pool:\n  eta: 0.5\n")  # no preset's name: its label, as before
    assert config.resolve("lab/mine.yaml")["experiment"]["preset"] == "mine"


@pytest.mark.parametrize("text, what", [("pool:\n", "empty"), ("pool:\n  - eta: 0.5\n", "a list"),
                                        ("experiment: moons\n", "the value 'moons'"),
                                        ("train:\n  velocity:\n  lr: 0.01\n", "empty")])
def test_a_section_that_holds_no_keys_is_named_so(tmp_path, monkeypatch, text, what):
    """An empty, listed or misindented section read "unknown config key 'pool'; did you mean 'pool.qmc'?"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text(text)
    with pytest.raises(SinkflowError, match=rf"config file s.yaml, line [12]: section '[a-z.]+' is {what}, not keys .*; indent "
                                            r"its keys below it"):
        config.resolve("s.yaml")


@pytest.mark.parametrize("key, example", [("pool", "pool.batches"), ("train.velocity", "train.velocity.iters")])
def test_a_section_given_a_value_on_the_command_line_is_named_a_section(key, example):
    """`pool=3` read "unknown config key 'pool'; did you mean 'pool.qmc'?" (the same in a file names the section)."""
    with pytest.raises(SinkflowError, match=rf"^config key '{key}' is a section, not a key; set one of its keys, "
                                            rf"e.g. {example}=\.\.\."):
        config.resolve("moons", [f"{key}=3"])


@pytest.mark.parametrize("text, section, close", [("poool: {}\n", "poool", "pool"),
                                                  ("train:\n  velocty: {}\n", "train.velocty", "train.velocity")])
def test_an_empty_misspelt_section_in_a_file_is_named(tmp_path, monkeypatch, text, section, close):
    """`poool: {}` has no key to flag, so a misspelt section was accepted in silence (audit DD); a known section left
    empty (`pool: {}`) sets nothing and is fine."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text("experiment:\n  preset: moons\n" + text)
    with pytest.raises(SinkflowError, match=rf"^config file s.yaml, line \d: unknown config section '{section}'; "
                                            rf"did you mean '{close}'\?"):
        config.resolve("s.yaml")
    (tmp_path / "ok.yaml").write_text("experiment:\n  preset: moons\npool: {}\n")
    assert config.resolve("ok.yaml")["pool"] == config.resolve("moons")["pool"]


def test_a_run_config_file_given_for_its_folder_names_the_folder(tmp_path, monkeypatch, capsys):
    """`train --resume runs/x/config.yaml` said "runs/x/config.yaml is not a sinkflow run folder (no config.yaml)"."""
    from sinkflow.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "moons", "pool.batches=1", "pool.batch_size=16", "pool.steps=2", "--train-iters", "2",
                 "--name", "x", "--device", "cpu", "--no-report"]) == 0
    capsys.readouterr()
    for argv in (["train", "--resume", "runs/x/config.yaml"], ["status", "runs/x/config.yaml"]):
        assert main(argv) == 2
        assert "runs/x/config.yaml is a run's config file, not its folder; pass the folder: runs/x" in \
            capsys.readouterr().err


def test_training_a_runs_config_file_names_its_mid_run_changes(tmp_path, monkeypatch, caplog):
    """`train RUN/config.yaml --name new` trained a resume's lr change (step 377 in the run) from step 0 in silence:
    the file holds the values the run ended with; meta.json's changes, what it cannot, are named. It also warned of
    4 keys "this nsgf run does not read": ones the run wrote (train.nsf.iters from --train-iters, data.root)."""
    import logging

    from sinkflow.cli import main

    monkeypatch.chdir(tmp_path)
    small = ["pool.batches=1", "pool.batch_size=16", "pool.steps=2", "train.velocity.ckpt_every=2", "--device", "cpu",
             "--no-report"]
    assert main(["train", "moons", *small, "--train-iters", "4", "--name", "part"]) == 0
    (tmp_path / "runs" / "part" / "checkpoints" / "velocity" / "final.pt").unlink()  # as if stopped after step 2
    (tmp_path / "runs" / "part" / "checkpoints" / "velocity" / "step_00000004.pt").unlink()
    assert main(["train", "--resume", "runs/part", "train.velocity.lr=0.02", "--no-report"]) == 0
    with caplog.at_level(logging.WARNING, logger="sinkflow"):
        config.resolve("runs/part/config.yaml", ["experiment.name=again"])
    said = [r.getMessage() for r in caplog.records if "is a run's config" in r.getMessage()]
    assert len(said) == 1 and "train.velocity.lr=0.02 (from velocity step 2)" in said[0], said
    # and not the keys the run itself wrote that it does not read (--train-iters set train.nsf.iters, ...: noise)
    assert not [r for r in caplog.records if "does not read" in r.getMessage()], caplog.text


def test_a_hand_edit_of_an_unread_key_in_a_runs_config_is_still_named(tmp_path, monkeypatch, caplog):
    """A run's own config.yaml fed back left out the keys the run wrote and does not read (--train-iters'
    train.nsf.iters on an fm run, data.root), and with them every unread key: sample.t_shift edited into an fm run's
    file (fm has no time predictor) passed in silence (audit LL)."""
    import logging

    from sinkflow.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "moons", "--method", "fm", "--train-iters", "2", "--batch-size", "8", "--lr", "0.002",
                 "--device", "cpu", "--no-report", "--name", "f"]) == 0
    path = tmp_path / "runs" / "f" / "config.yaml"
    with caplog.at_level(logging.WARNING, logger="sinkflow"):
        config.resolve(str(path), ["experiment.name=again"])
    assert "does not read" not in caplog.text, caplog.text
    text = path.read_text()
    assert "  t_shift: 0.0\n" in text
    path.write_text(text.replace("  t_shift: 0.0\n", "  t_shift: -0.1\n", 1))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sinkflow"):
        config.resolve(str(path), ["experiment.name=again"])
    assert "sets 1 key(s) this fm run does not read (sample.t_shift)" in caplog.text, caplog.text


@pytest.mark.parametrize("word", ["inherit", "base"])
def test_another_tools_word_for_the_preset_names_experiment_preset(tmp_path, monkeypatch, word):
    """`inherit: moons` (Hydra's and other tools' word) read "did you mean 'sinkhorn.tol'?"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "i.yaml").write_text(f"{word}: moons\npool:\n  eta: 0.5\n")
    with pytest.raises(SinkflowError, match=rf"unknown config key '{word}'; did you mean 'experiment.preset'"):
        config.resolve("i.yaml")


def test_text_added_after_a_run_configs_end_line_is_named_so(tmp_path, monkeypatch):
    """Keys appended below a copied config.yaml's '...' line (which YAML reads nothing past) were called "cut
    short ... copy the run folder again"."""
    monkeypatch.chdir(tmp_path)
    text = config.dump_run_config(config.resolve("moons"))
    (tmp_path / "e.yaml").write_text(text + "pool:\n  eta: 0.5\n")
    with pytest.raises(SinkflowError, match=r"e.yaml has text after its end line '...' \(line \d+\).*; move the added "
                                            r"lines above the '...' line"):
        config.resolve("e.yaml")


def test_name_null_means_the_timestamped_name_and_a_blank_name_is_refused(tmp_path, monkeypatch, capsys):
    """`--name null` made a folder named "null" where `experiment.name=null` means <preset>-<method>-<time>; `--name
    " "` made a folder named " "."""
    from sinkflow.cli import main

    monkeypatch.chdir(tmp_path)
    assert config.resolve("moons", [], {"name": "null"})["experiment"]["name"] is None
    assert config.resolve("moons", [], {"name": "nullable"})["experiment"]["name"] == "nullable"
    assert main(["train", "moons", "--name", " ", "--device", "cpu"]) == 2
    assert "experiment.name=' ' is blank" in capsys.readouterr().err and not (tmp_path / "runs").exists()


def test_a_config_file_in_utf16_reads(tmp_path, monkeypatch):
    """Windows PowerShell 5's `sinkflow config moons > my.yaml` writes UTF-16 with a byte-order mark, which YAML
    allows: it was refused as "not UTF-8", and the fix named (`sinkflow config PRESET > FILE`) wrote it so again."""
    monkeypatch.chdir(tmp_path)
    text = "experiment:\n  preset: moons\ntrain:\n  velocity:\n    lr: 0.002\n"
    for encoding in ("utf-16", "utf-16-be", "utf-8-sig"):
        raw = text.encode(encoding)
        if encoding == "utf-16-be":
            raw = b"\xfe\xff" + raw
        (tmp_path / "w.yaml").write_bytes(raw)
        assert config.resolve("w.yaml")["train"]["velocity"]["lr"] == 0.002, encoding


def test_a_run_made_before_the_ema_warm_up_resumes_without_it(tmp_path):
    """``train.*.ema_warmup`` came with the default true: a run made before it averaged without a warm-up, and a
    resume switched it on in silence (an old digits run resumed at step 243 of 400 scored FD-CNN 16.06, not 17.11).
    A config.yaml without the key reads false in every phase (``schema.BEFORE_ADDED``, a ``*`` per phase); one that
    writes it keeps its value."""
    import yaml

    tree = config.resolve("digits")
    for section in tree["train"].values():
        del section["ema_warmup"]
    got = config.read_run_config(yaml.safe_load(yaml.safe_dump(tree)), "config.yaml")
    assert {p: s["ema_warmup"] for p, s in got["train"].items()} == {p: False for p in tree["train"]}
    tree["train"]["velocity"]["ema_warmup"] = True
    got = config.read_run_config(tree, "config.yaml")
    assert got["train"]["velocity"]["ema_warmup"] is True and got["train"]["nsf"]["ema_warmup"] is False


@pytest.mark.parametrize("argv, needle", [(["--lr", "0"], "--lr 0: config key 'train.velocity.lr' must be > 0"),
                                          (["--train-iters", "0"], "--train-iters 0: config key 'train.velocity.iters'"),
                                          (["--batch-size", "-3"], "--batch-size -3: config key"),
                                          (["--precision", "half"], "--precision half: config key 'train.velocity."
                                                                    "precision' must be one of auto, fp32, bf16")])
def test_a_bad_shorthand_value_names_the_flag_typed(capsys, argv, needle):
    """`--lr 0` said "config key 'train.velocity.lr' must be > 0 ...; e.g. train.velocity.lr=0.001": the flag the user
    typed was not named, and the example was another spelling."""
    assert main(["config", "moons", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and f"e.g. {argv[0]} " in err and "\n" not in err, err


@pytest.mark.parametrize("argv, name", [(["train", "--resume", ""], "--resume"), (["status", " "], "RUN"),
                                        (["eval", ""], "RUN"), (["sample", "runs/x", "--out", ""], "--out")])
def test_an_empty_run_folder_or_out_path_is_named_empty(tmp_path, monkeypatch, capsys, argv, name):
    """`train --resume "$RUN"` with the variable unset started a new run of the default preset; `status ""` said
    "`.` is not a sinkflow run folder" (the working folder)."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert f"sinkflow: error: {name} is empty (an unset shell variable?)" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_an_empty_preset_name_is_an_unknown_preset_not_a_folder_of_images(tmp_path, monkeypatch, capsys):
    """`sinkflow train "$PRESET"` with the variable unset: "" is the working folder to ``Path``, so the fix offered
    was "a folder of your own images: `sinkflow train folder data.path=`" (an empty path)."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", ""]) == 2
    err = capsys.readouterr().err
    assert "unknown preset ''; choose one of: " in err and "data.path" not in err, err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name", ["_base", "_nsgf2d"])
def test_a_presets_building_block_is_no_preset(name, tmp_path, monkeypatch, capsys):
    """`sinkflow presets` leaves out the files starting with ``_`` (building blocks), yet `sinkflow train _nsgf2d` /
    `_base` trained them (`_base`: the schema's defaults) under that label."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", name, "--train-iters", "1"]) == 2
    assert f"'{name}' is a building block of presets, not a preset" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_numeric_shorthands_read_their_values_as_key_value_does(capsys):
    """argparse's int / float read the shorthands: `--train-iters 1e3` was refused where train.velocity.iters=1e3 is
    1000, and `--lr 1_000` was taken where train.velocity.lr=1_000 is refused. One rule now, the flag named."""
    assert main(["config", "moons", "--train-iters", "1e3", "--lr", "2e-3"]) == 0
    tree = yaml.safe_load(capsys.readouterr().out)
    assert tree["train"]["velocity"]["iters"] == 1000 and tree["train"]["velocity"]["lr"] == 0.002
    for flag, value in (("--lr", "1_000"), ("--train-iters", "1_000"), ("--batch-size", "2.5"),
                        ("--train-iters", "null")):
        assert main(["config", "moons", flag, value]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"sinkflow: error: {flag} {value}: config key ") and len(err.splitlines()) == 1, err
