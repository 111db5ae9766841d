"""What an evaluation record (`metrics.jsonl`, phase ``eval``) holds: each score with its spread over seeds, and
how it was made."""

from __future__ import annotations

# what an image evaluation records per row (t_hat_mean: NSGF++'s predictor, where the straight flow starts)
METRIC_KEYS = ("w2", "tv", "confidence", "fd_cnn", "fid", "nfe", "t_hat_mean")
# the settings a record names only where they differ from the run's defaults (``setting``)
OPTIONAL_SETTINGS = ("class_n", "split", "sample", "precision")


def setting(run, n: int, seeds: int, class_n: int | None = None, split: str = "test") -> dict:
    """What an evaluation record says of how it was made, beside its scores: samples per seed, seeds, protocol
    (and the classifier columns' samples per seed where they differ from ``n``; the ``sample`` settings where they
    differ from the run's config.yaml, e.g. `sinkflow eval RUN sample.t_shift=-0.1`; ``split: val`` for scores
    against the validation split, `sinkflow eval RUN --split val`, which are not the run's test scores).
    `sinkflow eval --n 64 --seeds 1` wrote the same keys at the same step as the run's own evaluation, and
    `status` then showed the quick look as the run's latest scores. ``precision``: the sampled networks' autocast where
    it is not fp32 (``sample.precision: auto`` takes the card's: the same run scored on a GPU and on a CPU)."""
    out = {"n": n, "seeds": seeds, "protocol": run.cfg["eval"]["protocol"]}
    if class_n is not None and class_n != n:
        out["class_n"] = class_n
    if split != "test":
        out["split"] = split
    changed = run.sampling_changes()
    if changed:
        out["sample"] = changed
    from sinkflow import methods  # here: status imports this module's names and loads no torch

    precision = methods.of(run.cfg).sample_precision(run.cfg, run.device)
    if precision != "fp32":  # sample.precision: auto is fp16 on a CUDA card for a UNet, fp32 on a CPU
        out["precision"] = precision
    return out


def scores(row: dict, suffix: str = "") -> dict:
    """A metrics row's scores and their standard deviation over seeds (``w2``, ``w2_std`` ...), keys + ``suffix``.
    A mean alone cannot say whether two runs differ: the std over seeds is what a reader compares it with."""
    out = {}
    for key in METRIC_KEYS:
        if key in row:
            out[f"{key}{suffix}"] = row[key]
            if f"{key}_std" in row:
                out[f"{key}_std{suffix}"] = row[f"{key}_std"]
    return out


def image_record(run, result: dict, split: str = "test", extra: dict | None = None, by_steps: bool = True) -> dict:
    """One evaluation, one record: every row of ``result`` (``image_metrics``'), each score suffixed by the row's
    step count (``by_steps``; a flow's one inverse pass keeps the plain names), its setting, and ``extra`` (a flow's
    bits/dim). The last ``eval`` record is then the whole evaluation (``Run.scores``): a record per row, and a flow's
    bits/dim in a record of its own, had left all but the last one's numbers out of it."""
    p = result["protocol"]
    out = dict(extra or {})
    for row in result["rows"]:
        out.update(scores(row, f"_{row['steps']}" if by_steps else ""))
    return {**out, **setting(run, p["n"], p["seeds"], p["class_n"], split)}
