"""What `sinkflow train` prints and draws when it finishes, and what `sinkflow eval` computes.

The run's ``Method`` decides (``evaluate`` / ``plots``); it gets this module as ``ev``, the evaluation layer,
so methods never import it. The standard evaluation is sample-based: exact W2 over seeds for point clouds,
the image metrics for images.
"""

from __future__ import annotations

import sys

from sinkflow import data, methods
from sinkflow.errors import SinkflowError
from sinkflow.eval.records import METRIC_KEYS, image_record, scores, setting  # noqa: F401 (the method's ``ev``)
from sinkflow.runtime.data_record import check_split, check_split_files


def is_points(cfg: dict) -> bool:
    """Evaluated as a point cloud (exact W2, scatter plots): vectors, and a user's point file of any row shape
    (an (N, C, H, W) array has no image set's test split or classifier: its rows are points, W2 on them flattened)."""
    return len(data.sample_shape(cfg)) == 1 or isinstance(data.distributions(cfg)[1], data.PointFile)


def requested_evaluation(run, n: int | None, split: str = "test", flags: tuple[str, str] = ("--n", "--split")):
    """What `sinkflow eval --n N --split S` and ``Run.evaluate(n=N, split=S)`` check before any work, and the run
    view they score: the split exists and its files are the run's; ``n`` fits the target (a point file's held-out
    rows, a digit set's 2, the split's images: the report cuts eval.n to the split, an asked-for n is refused) and
    this machine's memory; an asked-for ``n`` is every metric's count, the classifier columns' too (not the run's
    eval.class_n, digits' 3,590). ``flags``: how the caller names n and split (the command's, or the API's)."""
    from sinkflow.data.memory import check_sample_memory

    n_flag, split_flag = flags
    sep = " " if n_flag.startswith("-") else "="
    check_eval_split(run.cfg, split, split_flag)
    check_split_files(run, data.target_split_info(run.cfg), doing="evaluate")  # before anything decodes the images
    run.require_trained()  # before the classifier and the reference are built (a resume's own refusals first)
    if n:
        target = data.distributions(run.cfg)[1]
        target.check_test_n(n, n_flag)
        held = (len(target.val_index) if split == "val" else len(target.test_images)) \
            if hasattr(target, "test_images") else None
        if held is not None and n > held:
            which = "validation" if split == "val" else "held-out"
            raise SinkflowError(f"{n_flag}{sep}{n} images, but the {which} split of {target.name} holds {held}",
                                f"use {n_flag}{sep}{held} or less")
        run = run.variant(eval={"class_n": None})
    check_sample_memory(n or run.cfg["eval"]["n"], run.cfg, n_flag if n else "eval.n", exact_w2=is_points(run.cfg))
    return run


def evaluate(run, seeds: int | None = None, n: int | None = None, split: str = "test",
             flags: tuple[str, str] = ("--n", "--split")) -> str:
    """The run's method's evaluation, on the data the run recorded (a changed test split is refused first);
    ``split="val"`` scores an image run against its validation split (``check_eval_split`` says when it cannot).
    Every check of ``requested_evaluation`` comes first, named by ``flags`` (`sinkflow eval`'s, ``Run.evaluate``'s)."""
    run = requested_evaluation(run, n, split, flags)
    check_split(run, *data.distributions(run.cfg), doing="evaluate")
    return methods.of(run.cfg).evaluate(run, sys.modules[__name__], seeds=seeds, n=n, split=split)


def check_eval_split(cfg: dict, split: str, flag: str = "split", who: str | None = None,
                     points_fix: str = "evaluate it on its test split: sinkflow eval RUN, without --split val") -> None:
    """Refuse, before any work (nothing decoded), an evaluation split the run does not have: ``val`` exists for
    image runs trained with ``data.val_fraction`` > 0 (it is carved from the training images before training, so it
    cannot be added to a trained run; 2D and point-file targets have none). ``who`` starts the message (default
    ``<flag>=val``); ``points_fix`` is the fix for a run of points (``sinkflow tune``'s names no flag)."""
    if split == "test":
        return
    if split != "val":
        raise SinkflowError(f"{flag}={split!r} is not an evaluation split", "use test or val")
    who = who or f"{flag}=val"
    if cfg["data"]["target"] not in data.IMAGE_SETS:  # by name: nothing decoded before check_split_files
        raise SinkflowError(f"{who}: {cfg['data']['target']} is not an image set, so it has no validation split "
                            "(a validation split is carved from an image set's training images)", points_fix)
    if not cfg["data"].get("val_fraction"):
        raise SinkflowError(f"{who}: this run was trained without a validation split (data.val_fraction=0), "
                            "and one cannot be carved from images it trained on",
                            "train a run with data.val_fraction=0.1 to choose sampling settings on validation")


def final_report(run) -> str:
    text = evaluate(run)
    written = methods.of(run.cfg).plots(run, sys.modules[__name__])
    return text + "\nwrote " + ", ".join(str(p) for p in written)


def standard_evaluation(run, method, seeds: int | None = None, n: int | None = None, split: str = "test") -> str:
    """W2 table over seeds (points) or the image metrics (images, against ``split``), logged to metrics.jsonl as
    ``eval``."""
    cfg = run.cfg
    if is_points(cfg):
        from sinkflow.eval.points import draws, format_table, task_name, w2_table

        rows = w2_table(run, n=n, seeds=seeds)
        n, seeds = rows[0]["n"], rows[0]["seeds"]
        record = setting(run, n, seeds)
        for r in rows:
            # with its NFE, as an image record: NSGF++'s "steps" are its straight flow's (2-D: 5 + 1 + steps NFE)
            record.update(scores({"w2": r["w2_mean"], "w2_std": r["w2_std"], "nfe": r["nfe"]}, f"_{r['steps']}"))
        run.logger.log_evaluation(record)
        half = sampled_in(run, method)  # a line of its own under the W2 table
        return format_table(rows, method.name, task_name(cfg), method.paper_label, cfg["eval"]["protocol"],
                            draws(cfg)) + (f"\n{half}" if half else "")
    from sinkflow.eval.images import evaluate_images

    half = sampled_in(run, method)
    return evaluate_images(run, seeds=seeds, n=n, split=split) + f"\n{protocol(cfg)}" + (f"; {half}" if half else "")


def protocol(cfg: dict) -> str:
    """How the evaluation drew its source (``eval.protocol``), said in its output."""
    from sinkflow.eval.points import eval_qmc, source_protocol

    return f"{source_protocol(cfg, eval_qmc(cfg))} (eval.protocol={cfg['eval']['protocol']})"


def sampled_in(run, method) -> str:
    """The networks' half precision where the sampler ran them in one, said after an image table's protocol and under
    a W2 table (``sample.precision: auto`` is fp16 for a UNet on a CUDA card, fp32 on a CPU, and the sampled
    network's set training precision on a CUDA card, a 2-D MLP's included: the same run's table from the two machines
    otherwise read alike; the record says it too, ``precision``); nothing for fp32."""
    from sinkflow.runtime.autocast import precision_named

    precision = method.sample_precision(run.cfg, run.device)
    if precision == "fp32":
        return ""
    return f"the networks sampled in {precision_named(run.cfg['sample']['precision'], precision)}"


def standard_plots(run, method) -> list:
    """samples.png + trajectories.png (points) or grid.png + trajectory_strip.png (images)."""
    if is_points(run.cfg):
        from sinkflow.eval.points import plots

        return plots(run)
    from sinkflow.eval.images import plots as image_plots

    return image_plots(run)


# ---- the building blocks a method's own evaluation may use ----------------------------------------

def generate(run, n: int, steps: int, seed: int, record: bool = False, qmc: bool | None = None):
    from sinkflow.eval.points import generate as _generate

    return _generate(run, n, steps, seed, record=record, qmc=qmc)


def image_metrics(run, seeds: int | None = None, n: int | None = None, steps_list=None, split: str = "test") -> dict:
    from sinkflow.eval.images import image_metrics as _image_metrics

    return _image_metrics(run, seeds=seeds, n=n, steps_list=steps_list, split=split)


def format_metrics(result: dict) -> str:
    from sinkflow.eval.images import format_metrics as _format_metrics

    return _format_metrics(result)


def save_grid(x, path, nrow: int | None = None):
    from sinkflow.eval.images import save_grid as _save_grid

    return _save_grid(x, path, nrow=nrow)
