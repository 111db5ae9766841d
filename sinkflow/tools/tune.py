"""Choose a trained image run's sampler on its validation images (``sinkflow tune RUN --nfe 13``).

Why: a preset samples with the paper's settings, and the best sampler at a budget of network evaluations depends on
the run. On real MNIST at the CPU benchmark's budget, NSGF++ with k = NFE - 2 NSGF steps and one straight-flow step
from the predictor's t̂ - 0.2 or - 0.3 scored FD-CNN 32.6 at 6 NFE where the paper's t̂ scored 49.7, and OT-CFM's
warped Euler grid 41.5 where its uniform grid scored 45.0 (benchmarks/RESULTS.md, the CPU table). Which k and shift
win moves with the budget and the seed, so each run's are chosen on its own validation split (``data.val_fraction``,
held out of training), never on the test split its reported scores use. ``benchmarks/mnist.py`` chooses with the same
candidates and the same tie rule.

A candidate is a set of ``sample.*`` values at a fixed total NFE: for NSGF++ the NSGF steps k (about 1/4 and 1/2 of
the budget, and all but one straight-flow step; only the pool's T when the field was trained on its grid points
alone, ``nsgf.segment=0``), the straight flow's ``nsf_steps = NFE - 1 - k`` and the shift of t̂; for FM / OT-CFM the
``time_warp`` of the Euler grid of NFE steps; for a normalizing flow (one pass, no NFE) the prior's
``temperature``.
"""

from __future__ import annotations

from sinkflow import methods
from sinkflow.errors import SinkflowError
# each method's sampler knobs live with it (re-exported: benchmarks and tests read them here)
from sinkflow.methods.base import EULER_WARPS as WARPS  # noqa: F401
from sinkflow.methods.normalizing_flow import TEMPERATURES  # noqa: F401
from sinkflow.methods.nsgfpp import T_SHIFTS, nsgf_splits  # noqa: F401


def candidates(cfg: dict, total: int) -> list[dict]:
    """The ``sample.*`` settings tried at ``total`` network evaluations: the method's ``sampler_candidates`` (each
    method says what its sampler's knobs are; a new Euler method gets the grid's warps without naming it here)."""
    method = methods.of(cfg)
    found = method.sampler_candidates(cfg, total)
    if found is None:
        raise SinkflowError(f"sinkflow tune chooses a sampler's settings, and this run's method is {method.name}, "
                            "whose sampler has none to choose (Method.sampler_candidates)",
                            "evaluate it with sinkflow eval")
    return found


def current(cfg: dict) -> tuple[int, dict]:
    """(total NFE, settings) of the run's own sampler, as its config has it."""
    return methods.of(cfg).sampler_settings(cfg)


def hint(cfg: dict) -> str | None:
    """The line `sinkflow train` ends an image run's report with when ``sinkflow tune`` can choose its sampler
    (``{run}`` to fill), else None."""
    from sinkflow import data

    if cfg["data"]["target"] not in data.IMAGE_SETS or not cfg["data"].get("val_fraction"):
        return None
    try:
        if methods.of(cfg).sampler_candidates(cfg, current(cfg)[0]) is None:
            return None
    except SinkflowError:  # the run's own budget is not one tune can spend
        return None
    if cfg["data"]["target"] not in data.DIGIT_SETS and not cfg["eval"]["inception_weights"]:
        return None  # nothing to score a sampler by (``metric_of`` refuses it): no hint it would refuse
    if not methods.of(cfg).takes_steps:  # a flow: one pass, its temperature
        return "its sampling temperature, chosen on the validation split: sinkflow tune {run}"
    return (f"its sampler, chosen on the validation split: sinkflow tune {{run}} (at its own {current(cfg)[0]} network "
            "evaluations; --nfe N ... for other budgets)")


def overrides(settings: dict) -> list[str]:
    return [f"sample.{k}={v:g}" if isinstance(v, float) else f"sample.{k}={v}" for k, v in settings.items()]


def choose(scored: list[tuple]) -> tuple:
    """The lowest of (settings, score, ...) tuples; ties go to fewer NSGF steps, then to the smaller shift, then to
    the grid nearer uniform, then to the temperature nearer the model's 1."""
    return min(scored, key=lambda sv: (sv[1], sv[0].get("nsgf_steps", 0), abs(sv[0].get("t_shift", 0.0)),
                                       abs(sv[0].get("time_warp", 1.0) - 1), abs(sv[0].get("temperature", 1.0) - 1)))


def recommend(scored: list[tuple[dict, float, list[float]]], own: dict | None) -> tuple[dict, float, bool]:
    """(settings, score, kept): ``choose``'s lowest, unless it beats the run's own sampler ``own`` by less than twice
    the standard error of their seed-by-seed differences (every candidate samples with the same seeds, so the
    differences pair up), then the run's own (kept True): a win smaller than the noise of the score is no reason
    to change the sampler. One seed measures no noise: the lowest is named."""
    best = choose(scored)
    mine = next((sv for sv in scored if sv[0] == own), None)
    if mine is None or mine is best or len(best[2]) < 2 or not within_noise(best, mine):
        return best[0], best[1], False
    return mine[0], mine[1], True


def within_noise(low: tuple, other: tuple) -> bool:
    """Whether ``low`` (settings, score, per-seed scores) beats ``other`` by less than twice the standard error of
    their seed-by-seed differences (the seeds are common to every candidate, so the differences pair up); needs two
    seeds or more."""
    import statistics

    diff = [o - lo for o, lo in zip(other[2], low[2])]
    return not statistics.fmean(diff) > 2 * statistics.stdev(diff) / len(diff) ** 0.5


def margin_note(scored: list[tuple[dict, float, list[float]]], best: dict) -> str | None:
    """The line that says how far ``best`` is from the next candidate where no run's own sampler was compared with it
    (another budget, or the run's own is the best): a lowest mean named from one seed, or ahead of the next by less
    than the paired noise, was printed as the best with nothing to say so (at --nfe 6 on a 10-step digits run, one
    seed: 214.68 against the next's 214.69). None where the margin is beyond the noise, or no other candidate scored
    otherwise."""
    low = next(sv for sv in scored if sv[0] == best)
    others = [sv for sv in scored if sv[0] != best and sv[2] != low[2]]  # a shift clamped to t_min: the same samples
    if not others:
        return None
    nxt = choose(others)
    named = f"the next ({' '.join(overrides(nxt[0]))}: {nxt[1]:.2f})"
    if len(low[2]) < 2:
        return (f"one seed measures no noise: `--seeds 3` shows whether the margin of {nxt[1] - low[1]:.3g} over "
                f"{named} is more than the sampling noise")
    if within_noise(low, nxt):
        return (f"{named} is behind by less than twice the standard error of their seed-by-seed differences: on "
                "validation the two are alike at this budget")
    return None


def repeats(scored: list[tuple[dict, float, list[float]]]) -> dict[int, dict]:
    """{row: the earlier candidate it repeats} for each candidate whose every seed scored exactly as an earlier one's:
    the same samples, a setting that changes nothing at this budget (NSGF++'s t̂ + shift clamped at nsgf.nsf_t_min
    for every sample: the shifts of a briefly trained predictor sample alike). The table said nothing, and the shift
    read as one that does not matter (audit AG)."""
    first: dict[tuple, dict] = {}
    out = {}
    for i, (settings, _, per_seed) in enumerate(scored):
        key = tuple(per_seed)
        if key in first:
            out[i] = first[key]
        else:
            first[key] = settings
    return out


def metric_of(cfg: dict, target) -> str:
    """FD-CNN where the data has a digit classifier (digits, mnist), else FID with the configured Inception
    weights; refused in one line before any sampling when neither exists."""
    from sinkflow.eval.images import digit_classifier

    if digit_classifier(target, cfg["data"]["root"]) is not None:
        return "fd_cnn"
    if cfg["eval"]["inception_weights"]:
        return "fid"
    raise SinkflowError(f"sinkflow tune scores samplers by FD-CNN, which exists for digit sets only, or by FID; "
                        f"{target.name} has no digit classifier and eval.inception_weights is not set",
                        "set eval.inception_weights to a local pt_inception-2015-12-05 file (FID)")


def tune(run, total: int, n: int, seeds: int = 1,
         metric: str = "fd_cnn") -> list[tuple[dict, float, list[float]]]:
    """Every candidate at ``total`` NFE (and the run's own sampler when it spends as many) scored by ``metric`` on
    ``n`` samples per seed against the validation split (the mean, and each seed's score), with a progress bar.
    Each candidate samples from a view of the run (``RunFolder.variant``; config.yaml is never written). The
    validation reference (FD-CNN features and floor, or FID's Inception features of the real images) is built once
    for all candidates."""
    from sinkflow.eval.images import held_out, image_metrics
    from sinkflow.runtime.callbacks import progress

    out, scoring = [], {"class_n": None}  # eval.class_n off: every metric on the same n samples
    reference = held_out(run.variant(eval=scoring).cfg, "val", n)
    cands = candidates(run.cfg, total)
    own_total, own = current(run.cfg)
    if own_total == total and own not in cands:
        cands.append(own)
    for settings in progress(cands, f"tune {total} NFE", "samplers"):  # lines, not a bar, in a log file
        view = run.variant(sample=settings, eval=scoring)  # the method says what its steps are under these settings
        steps = methods.of(view.cfg).default_steps(view.cfg)  # (a new method's candidates named otherwise: 1 step)
        row = image_metrics(view, seeds=seeds, steps_list=[steps], reference=reference, per_seed=True)["rows"][0]
        out.append((settings, row[metric], row[f"{metric}_per_seed"]))
    return out
