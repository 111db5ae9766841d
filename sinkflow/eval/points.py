"""2D evaluation: exact W2 (POT) between generated samples and held-out target samples, over seeds."""

from __future__ import annotations

import math
import os
import statistics

import torch

from sinkflow import data, methods
from sinkflow.errors import SinkflowError
from sinkflow.methods.ode import network_evaluations
from sinkflow.runtime.autocast import fp16_overflow
from sinkflow.runtime.rng import phase_generator


def eval_qmc(cfg: dict) -> bool:
    """Does the evaluation protocol (``eval.protocol``) draw the source by randomised QMC?"""
    return cfg["eval"]["protocol"] == "qmc"


def protocol_pair(cfg: dict, protocol: str | None = None):
    """(source, target) of the evaluation ``protocol`` (``eval.protocol`` when None): ``qmc`` = the source's
    scrambled-Sobol twin and the stratified target (its ``test_set``); ``iid`` = i.i.d. twins of both, the
    draws a user makes (a point file's ``test_set`` is its held-out rows, i.i.d. already)."""
    protocol = protocol or cfg["eval"]["protocol"]
    source, target = data.distributions(cfg)
    if protocol == "iid":
        return data.iid_twin(source), data.iid_twin(target)
    return data.qmc_twin(source), target


def source_protocol(cfg: dict, qmc: bool) -> str:
    """One line naming how the source is drawn (evaluation output says which protocol it used)."""
    source = data.distributions(cfg)[0]
    if not qmc:
        return f"source {source.name} drawn i.i.d."
    if data.qmc_twin(source) is source:
        return f"source {source.name} drawn i.i.d. (QMC asked for, but it has no scrambled-Sobol twin)"
    return f"source {source.name} drawn by randomised QMC (scrambled Sobol)"


def generate(run, n: int, steps: int, seed: int, record: bool = False, qmc: bool | None = None,
             protocol: str | None = None):
    """n samples in chunks of ``sample.batch_size`` (so eval.n=10000 fits a small card); info merged.

    The source draw is the ``protocol``'s (:func:`protocol_pair`) when one is given; otherwise ``qmc`` says
    whether it is drawn by randomised QMC; None = the evaluation protocol's choice (``eval.protocol``).
    ``sinkflow sample`` and ``Run.sample`` pass ``sample.qmc`` (default false: i.i.d. draws)."""
    if protocol is not None:
        source = protocol_pair(run.cfg, protocol)[0]
    else:
        source = data.sampling_source(run.cfg, eval_qmc(run.cfg) if qmc is None else qmc)
    return sample_chunks(run, source.sample(n, phase_generator(seed, "sample"), "cpu"), steps, record)


def sample_chunks(run, x0: torch.Tensor, steps: int | None, record: bool = False):
    """The run's samples from the source draw ``x0`` (on the host), in chunks of ``sample.batch_size`` moved to the
    run's device one at a time (a draw of any size fits the card the evaluation fits); (samples on the host, info).
    NaN / Inf samples are refused here (``check_finite_samples``), before anything saves or scores them."""
    method = methods.of(run.cfg)
    chunk = max(1, run.cfg["sample"]["batch_size"])
    x, infos = None, []
    for lo in range(0, len(x0), chunk):
        part, info = method.sample(run, x0[lo : lo + chunk].to(run.device), steps, record)
        if x is None:  # one host array filled in place: 2,000 chunks kept apart for a torch.cat held 875 MB of freed
            x = torch.empty((len(x0), *part.shape[1:]), dtype=part.dtype)  # heap between them (1M 2-D samples)
        x[lo : lo + len(part)] = part
        infos.append(info)
    check_finite_samples(run.cfg, x, steps, method.sample_precision(run.cfg, run.device))
    return x, merge_info(infos)


def check_finite_samples(cfg: dict, x: torch.Tensor, steps: int | None, precision: str) -> None:
    """One line naming the likely cause when samples hold NaN / Inf (`sinkflow sample` wrote them as they were, and
    each evaluation found them its own way): sampled in fp16 (``precision``: ``sample.precision`` made concrete for the
    run's device), a network's activation that float16's range (65,504) cannot hold, otherwise a model that diverged."""
    bad = ~torch.isfinite(x.reshape(len(x), -1)).all(dim=1)
    if not bool(bad.any()):
        return
    method = methods.of(cfg)
    where = f"{int(bad.sum())} of {len(x)} samples of {method.name}" + (f" with {steps} steps" if steps else "")
    if precision == "fp16":
        raise fp16_overflow(f"{where} are NaN/Inf", cfg["sample"]["precision"])
    raise SinkflowError(f"{where} are NaN/Inf", "the model diverged: train longer with a lower learning rate")


SUMMED_INFO = ("nonfinite",)  # counts of samples, which add up over chunks (NFE is per sample: any chunk's)


def merge_info(infos: list[dict]) -> dict:
    """Per-sample tensors and recorded paths are concatenated; counts of samples (``SUMMED_INFO``) are summed;
    per-sample counts (NFE) come from the first chunk."""
    merged = dict(infos[0])
    for key, value in infos[0].items():
        if key in SUMMED_INFO:
            merged[key] = sum(i[key] for i in infos)
        elif isinstance(value, torch.Tensor) and value.ndim >= 1:
            merged[key] = torch.cat([i[key] for i in infos])
        elif key == "path" and value:
            merged[key] = [torch.cat(states) for states in zip(*(i[key] for i in infos))]
    return merged


def w2_table(run, n: int | None = None, seeds: int | None = None, steps_list=None,
             protocol: str | None = None) -> list[dict]:
    """For each step count: W2 mean/std over ``seeds`` sampling seeds, each against its own test draw
    (under ``protocol``, default ``eval.protocol``: :func:`protocol_pair`)."""
    from sinkflow.ot import w2

    cfg = run.cfg
    n = n or cfg["eval"]["n"]
    seeds = seeds or cfg["eval"]["seeds"]
    protocol = protocol or cfg["eval"].get("protocol", "qmc")
    _, target = protocol_pair(cfg, protocol)
    method = methods.of(cfg)
    rows = []
    for steps in steps_list or method.eval_steps(cfg):  # NSGF++: its sample.nsf_steps (eval.steps is not its key)
        values, nfe = [], 0
        for s in range(seeds):
            x, info = generate(run, n, steps, seed=1000 + s, protocol=protocol)
            values.append(w2(x.cpu(), target.test_set(n, seed=2000 + s)))
            nfe = info["nfe"]
        rows.append({
            "steps": steps, "nfe": nfe, "n": n, "seeds": seeds, "w2_mean": statistics.fmean(values),
            "w2_std": statistics.stdev(values) if len(values) > 1 else 0.0, "w2_all": values,
            **paper_entry(method, cfg, steps, n, protocol),
        })
    return rows


PAPER_N = 1024  # Table 1's W2: generated samples against a 1024-point test set (torchcfm's protocol)


def paper_entry(method, cfg: dict, steps: int, n: int, protocol: str = "qmc") -> dict:
    """The paper's W2 for a row (``paper``, None where it has none), only under the protocol that compares with it
    (docs/data.md): ``PAPER_N`` points, QMC source draws against the stratified test set. A W2 of fewer points is
    larger for the sampling alone (two perfect stratified moons draws: 0.156 at 64 points, 0.049 at 1024), and
    i.i.d. draws' floor (moons 0.218) is above every paper number, so `sinkflow eval --n 64` or eval.protocol=iid
    printed its W2 beside the paper's 0.077 as if the model were twice as far off. Elsewhere ``paper_off`` says why
    a number the paper has is left out (``format_table`` prints it, without the column)."""
    paper = method.paper_w2(cfg["experiment"]["preset"], steps) if is_paper_task(cfg) else None
    if paper is not None and n != PAPER_N:
        return {"paper": None, "paper_off": f"this one is on {n}, larger for the sample size alone; --n {PAPER_N} "
                                            "(eval.n) compares them"}
    if paper is not None and protocol != "qmc":
        return {"paper": None, "paper_off": f"this one is under eval.protocol={protocol}, whose i.i.d. draws' "
                                            "floor is above the paper's numbers (docs/data.md); eval.protocol=qmc "
                                            "compares them"}
    return {"paper": paper}


def task_name(cfg: dict, short: bool = False) -> str:
    """What the run transports, for tables and (``short``: a point file by its file name) figure titles: the
    preset's name for a paper task, else source -> target (a run of the moons preset on the user's points is not
    "moons", which its samples.png was titled)."""
    if is_paper_task(cfg):
        return cfg["experiment"]["preset"]
    def name(spec):
        return os.path.basename(spec) if short and str(spec).lower().endswith(data.POINT_SUFFIXES) else spec
    return f"{name(cfg['data']['source'])} -> {name(cfg['data']['target'])}"


def is_paper_task(cfg: dict) -> bool:
    """True when the run's data is its preset's own (the task the paper's number is for); a run on the
    user's ``data.target=points.npy`` (or another source) is not compared with the paper."""
    from sinkflow import config as config_mod

    try:
        own = config_mod.load_preset(cfg["experiment"]["preset"])["data"]
    except Exception:
        return False
    return all(cfg["data"].get(k) == own.get(k) for k in ("source", "target"))


def draws(cfg: dict, protocol: str | None = None) -> str:
    """What the W2 compared, in words: how the source was drawn (QMC only where it has a twin) and what the test
    points are (a point file's held-out rows, or draws from its rows, are neither stratified nor fresh)."""
    protocol = protocol or cfg["eval"]["protocol"]
    source, target = data.distributions(cfg)
    if protocol == "iid":
        drawn = "i.i.d. source draws"
    elif data.qmc_twin(source) is not source:
        drawn = "QMC source draws"
    else:  # protocol_pair draws the source itself: a built-in 2D sampler's is stratified (it read "i.i.d.")
        drawn = f"{'stratified' if getattr(source, 'stratified', False) else 'i.i.d.'} source draws (no QMC twin)"
    if isinstance(target, data.PointFile):
        test = (f"the file's {target.test_rows} held-out rows" if target.test_rows
                else "test points drawn from the file's training rows (data.test_rows=0)")
    else:
        test = "i.i.d. test points" if protocol == "iid" else "stratified test points"
    return f"{drawn} vs {test}"


def format_table(rows: list[dict], method: str, task: str, paper_label: str = "", protocol: str = "qmc",
                 compared: str | None = None) -> str:
    """The W2 table; a "paper <label>" column only where the method has the paper's numbers for the task.
    ``compared``: :func:`draws` of the run (default: the protocol's words for a built-in distribution)."""
    draws = compared or ("i.i.d. source draws vs i.i.d. test points" if protocol == "iid"
                         else "QMC source draws vs stratified test points")
    has_paper = any(r.get("paper") is not None for r in rows)
    head = f" {'paper ' + paper_label:>11}" if has_paper else ""
    n, seeds = rows[0].get("n"), rows[0].get("seeds", 2)
    size = f"{n} samples per seed, " if n else ""
    over = f"mean +- std over {seeds} seeds" if seeds > 1 else "one seed (no spread)"
    lines = [f"W2 on {task} ({method}), exact OT (POT emd2), {draws} (eval.protocol={protocol}), {size}{over}:",
             f"{'steps':>6} {'NFE':>5} {'W2':>16}{head}"]
    for r in rows:
        paper = "" if r.get("paper") is None else f" {r['paper']:>11.3f}"
        spread = f" +- {r['w2_std']:.3f}" if seeds > 1 else " " * 9
        lines.append(f"{r['steps']:>6} {r['nfe']:>5} {r['w2_mean']:>9.3f}{spread}{paper}".rstrip())
    off = next((r["paper_off"] for r in rows if r.get("paper_off")), None)
    if not has_paper and off:
        lines.append(f"(no paper {paper_label} column: its W2 is on {PAPER_N} test points, QMC source draws; {off})")
    return "\n".join(lines)


def reference(target, n: int) -> torch.Tensor:
    """Up to n test points to draw next to generated ones (a point file holds out only ``data.test_rows``)."""
    held = getattr(target, "test_rows", 0)
    return target.test_set(min(n, held) if held else n)


TRAJECTORY_PATHS = 256  # what trajectories.png draws


@torch.no_grad()
def plots(run, n: int = 1024, steps: int | None = None) -> list:
    """samples.png (generated vs target) and trajectories.png (particle paths) in the run folder, drawn by the
    run's own sampler (``steps`` None: the method's, as `sinkflow sample` draws: sample.steps, NSGF++'s
    sample.nsf_steps). They were drawn at 100 steps whatever the run's: an NSGF++ run sampled with 3 straight-flow
    steps, and scored so in the table above them, had its figures drawn with 100 (105 network evaluations).

    Only the drawn paths are recorded. Rows wider than a point (a point file of (N, 3, 32, 32) images) take
    eval.n samples: 1024 samples of a UNet, each path recorded (1.3 GB at 3x32x32), kept the final report
    running for many minutes after a 3-step CPU run."""
    from sinkflow.eval.plots import scatter_samples, trajectories

    if math.prod(data.sample_shape(run.cfg)) > 2:
        n = min(n, run.cfg["eval"]["n"])
    x, info = generate(run, n, steps, seed=7)
    _, paths = generate(run, min(n, TRAJECTORY_PATHS), steps, seed=7, record=True)
    _, target = data.distributions(run.cfg)
    title = f"{task_name(run.cfg, short=True)} ({methods.of(run.cfg).name}, {network_evaluations(info['nfe'])})"
    out1 = scatter_samples(x.cpu(), reference(target, n), run.dir / "samples.png", title)
    out2 = trajectories(torch.stack(paths["path"]), run.dir / "trajectories.png", title)
    return [out1, out2]
