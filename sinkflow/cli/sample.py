"""`sinkflow sample RUN --n N --steps K --out FILE`: draw samples to .npy or .png."""

import argparse
from pathlib import Path

from sinkflow.cli.common import add_device_arg
from sinkflow.errors import DataNotFound, SinkflowError
from sinkflow.tools.trained import open_trained, with_sample_overrides


def add_parser(sub):
    p = sub.add_parser("sample", help="draw samples from a trained run",
                       description="Draw N samples with K Euler steps and save them as .npy (the raw array), "
                                   ".png (a scatter plot for 2D, an image grid for images) or, for images, a new "
                                   "folder of one PNG per image (what FID tools read).",
                       epilog="examples: sinkflow sample runs/moons-nsgf-20261122-120000 --n 2048 --steps 10 --out s.png\n"
                              "          sinkflow sample runs/cifar10-nsgfpp-20261122-120000 --n 50000 --out fid/",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN")
    p.add_argument("overrides", nargs="*", default=[], metavar="sample.key=value",
                   help="sampling settings for this call only, e.g. sample.temperature=0.7 (the run is not changed)")
    p.add_argument("--n", type=int, default=1024, help="samples to draw (default 1024)")
    p.add_argument("--steps", type=int, help="Euler steps (default sample.steps; NSGF++: its straight flow's steps "
                   "after the NSGF part and the time predictor, default sample.nsf_steps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--qmc", action="store_true", help="draw the source by randomised QMC (scrambled Sobol) instead "
                   "of i.i.d. (= sample.qmc=true; the evaluation's own choice is eval.protocol)")
    p.add_argument("--out", required=True, help="output: a .npy or .png file, or (image runs) a new or empty folder "
                   "(a path without a suffix, or ending in /) for one PNG per image")
    add_device_arg(p)
    p.set_defaults(func=run)


def run(args):
    if not 0 <= args.seed < 2**63:  # experiment.seed's range: -1 drew what 2**64 - 1 draws, larger ones wrapped
        raise SinkflowError(f"--seed {args.seed} must be in [0, {2**63 - 1}]", "e.g. --seed 0 (the default)")
    out = Path(args.out)
    as_folder = args.out.endswith(("/", "\\")) or not out.suffix
    if not as_folder and out.suffix not in (".npy", ".png"):
        raise SinkflowError(f"--out {out} must end in .npy or .png, or name a folder (no suffix) for one PNG per image",
                            "e.g. --out samples.png")
    # torch loads with these: `--help` and bad arguments stay fast
    from sinkflow.runtime.run_folder import run_state_entry
    from sinkflow.tools.data import sampling_data

    run_ = open_trained(args.run_dir, args.device)
    if (file := next((p for p in out.parents if p.is_file()), None)) is not None:  # "EEXIST File exists (s.png)"
        raise SinkflowError(f"--out {args.out}: {file} is a file, not a folder", "name a path in a folder")
    check_out_writable(out)
    if not as_folder and out.is_dir():  # sampled every image, then "EISDIR Is a directory (.s.npy.tmp-...)"
        raise SinkflowError(f"--out {args.out} is a folder, not a {out.suffix} file",
                            f"name a file, e.g. --out {out / ('samples' + out.suffix)}")
    if (entry := run_state_entry(run_.dir, out)) is not None:
        raise SinkflowError(f"--out {args.out} is in the run's own {entry}, which samples would replace",
                            f"write them beside it, e.g. --out {Path(args.run_dir) / 'samples'}.npy")
    if (key := data_entry(run_.cfg, out)) is not None:
        raise SinkflowError(f"--out {args.out} is in the run's own data ({key}), which samples would "
                            f"{'replace' if key != 'data.path' else 'join'}",
                            "write them beside it, e.g. --out samples.npy in another folder")
    with sampling_data(run_.cfg, run_.dir):  # an image run copied without its data set samples all the same
        _sample(args, run_, out, as_folder)


def data_entry(cfg: dict, out: Path) -> str | None:
    """The data key whose files ``out`` would change, or None: a point file the run trained on (``data.source`` /
    ``data.target``: `--out points.npy` replaced the training set, and the next evaluation scored the samples against
    themselves), or a path inside an image folder (``data.path``, read recursively: generated PNGs joined the data)."""
    from sinkflow.data import POINT_SUFFIXES

    where = out.resolve()
    for key in ("source", "target"):
        spec = cfg["data"].get(key)
        if isinstance(spec, str) and spec.lower().endswith(POINT_SUFFIXES) \
                and Path(spec).expanduser().resolve() == where:
            return f"data.{key}"
    folder = cfg["data"].get("path")
    if cfg["data"].get("target") == "folder" and folder and where.is_relative_to(Path(folder).expanduser().resolve()):
        return "data.path"
    return None


def check_out_writable(out: Path) -> None:
    """The folder that will hold ``out`` (its nearest existing one, where the missing ones are made) takes a new file,
    or a one-line error before any sampling: a read-only or unwritable folder failed only when the samples, all of
    them drawn, were written (the temporary file beside them named, "ENOENT ... (.s.npy.tmp-...)")."""
    from sinkflow.data.atomic_write import write_refused

    parent = out.absolute().parent
    folder = next(p for p in (parent, *parent.parents) if p.exists())
    if (why := write_refused(folder)) is not None:
        raise SinkflowError(f"--out {out}: cannot write into {folder} ({why})", "name a path in a writable folder")


def _sample(args, run_, out, as_folder):
    import numpy as np

    from sinkflow import data, methods
    from sinkflow.data.atomic_write import atomic_write_bytes
    from sinkflow.eval.points import generate
    from sinkflow.eval.report import is_points
    from sinkflow.methods.ode import network_evaluations

    if as_folder:
        from sinkflow.eval.images import check_image_folder

        if is_points(run_.cfg):  # before the folder's own checks: an existing one was told of "images" mixing
            raise SinkflowError(f"--out {args.out} is a folder, for one PNG per image, but this run draws points",
                                "save points as .npy or a scatter plot, e.g. --out samples.png")
        check_image_folder(out, args.n)
    from sinkflow.data.memory import check_sample_memory
    from sinkflow.eval.images import grid_bytes

    grid = not as_folder and out.suffix == ".png" and not is_points(run_.cfg)
    check_sample_memory(args.n, run_.cfg, grid_bytes=grid_bytes(args.n, data.sample_shape(run_.cfg)) if grid else 0)
    run_ = with_sample_overrides(run_, args.overrides, "sample", args.run_dir)
    method = methods.of(run_.cfg)
    method.check_steps(args.steps)
    steps = args.steps or method.default_steps(run_.cfg)  # NSGF++: the straight-flow steps
    qmc = args.qmc or run_.cfg["sample"]["qmc"]
    x, info = generate(run_, args.n, steps, seed=args.seed, qmc=qmc)
    x = x.cpu()
    out.parent.mkdir(parents=True, exist_ok=True)
    if as_folder:
        from sinkflow.eval.images import save_image_folder

        save_image_folder(x, out)
    elif out.suffix == ".npy":  # atomically: a kill or a full disk mid-write kept neither the old samples nor the new
        atomic_write_bytes(out, lambda f: np.save(f, x.numpy()))
    elif is_points(run_.cfg):
        from sinkflow.eval.plots import scatter_samples
        from sinkflow.eval.points import reference

        try:
            ref, title = reference(data.distributions(run_.cfg)[1], args.n), f"{steps} steps"
        except DataNotFound:  # a run sampled without its point file (tools.data.sampling_data): its samples alone
            ref, title = None, f"{steps} steps (the target's points are not on this machine)"
        scatter_samples(x, ref, out, title)
    else:
        from sinkflow.eval.images import save_grid

        save_grid(x, out)
    unit = method.steps_are.removesuffix("s") if steps == 1 else method.steps_are  # "1 straight-flow step"
    # a flow's samples are its temperature's (sample.temperature=0.7 for this call alone said nothing of it)
    temperature = run_.cfg["sample"].get("temperature", 1.0)
    how = f"{steps} {unit}" if method.takes_steps else f"one inverse pass at temperature {temperature:g}"
    precision = method.sample_precision(run_.cfg, run_.device)
    if precision != "fp32":  # sample.precision: auto is fp16 on a CUDA card for a UNet
        how += f", the networks in {precision}"
    source = data.distributions(run_.cfg)[0]
    drawn = "a QMC source draw" if qmc and data.qmc_twin(source) is not source else "an i.i.d. source draw"
    if qmc and drawn.startswith("an"):  # the words of the evaluation's protocol line (eval.points.source_protocol)
        drawn += f" (QMC asked for, but source {source.name} has no scrambled-Sobol twin)"
    noun = "sample" if args.n == 1 else "samples"
    print(f"wrote {args.n} {noun} ({how}, {network_evaluations(info['nfe'])}) from {drawn} to {out}")
