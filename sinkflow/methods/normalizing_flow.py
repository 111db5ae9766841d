"""Normalizing flows (Glow / RealNVP, ``sinkflow.flows``) as a method of the runner: ``experiment.method=flow``.

One training phase, ``flow``: maximum likelihood with uniform dequantisation, so the logged loss *is* the
training bits/dim. The network is ``model.flow`` (kind ``flow``), built by ``sinkflow.flows.build_flow``
through ``build_model``, so checkpoints, resume and ``run.model("flow")`` work as for every other phase.

Pixels: the data layer serves 8-bit images as ``k * 2/255 - 1`` (k = 0..255). They are turned back into
the exact integer levels k, the dequantisation noise ``U[0, 1)`` is drawn from the phase generator (so a
resumed run draws the same noise), and the density is over ``model.flow.n_bins`` levels (docs/flows.md).

Sampling ignores Euler steps: ``x0`` (standard normal noise of the image shape, from the runner's source)
*is* the prior noise: it fills the latents top first, each scaled by ``sample.temperature``. So
``sinkflow sample --seed`` and the evaluation seeds pick the samples, and a flow costs one inverse pass.
"""

from __future__ import annotations

import logging
import math
import statistics
from pathlib import Path

import numpy as np
import torch

from sinkflow import data
from sinkflow.data.images import trains_on_test
from sinkflow.errors import SinkflowError
from sinkflow.flows import bits_per_dim, dequantize, flow_loss, postprocess, preprocess
from sinkflow.methods.base import Method, TrainingStep
from sinkflow.runtime import dist
from sinkflow.runtime.callbacks import LEARNING_LOG
from sinkflow.runtime.rng import phase_generator

log = logging.getLogger("sinkflow")

# Published test bits/dim, for context only (different architectures and budgets; docs/flows.md).
PUBLISHED_BPD = {
    "mnist": [("RealNVP (as reported by FFJORD, Grathwohl et al. 2019)", 1.06),
              ("Glow (as reported by FFJORD, Grathwohl et al. 2019)", 1.05)],
    "cifar10": [("RealNVP (Dinh et al. 2017)", 3.49), ("Glow (Kingma & Dhariwal 2018)", 3.35)],
}
PUBLISHED_SHAPE = {"mnist": (1, 28, 28), "cifar10": (3, 32, 32)}  # what those numbers were measured on


def published_bpd(target: str, n_bins: int, shape: tuple[int, ...]) -> list[tuple[str, float]]:
    """The published bits/dim printed for context, only for the images they were measured on: 256 levels at the
    set's own size and channels. Bits/dim depends on both, and a flow-cifar10 run at data.image_size=16 (or
    data.channels=1) printed Glow's 3.35 beside its own as if the two measured the same thing."""
    if n_bins != 256 or tuple(shape) != PUBLISHED_SHAPE.get(target):
        return []
    return PUBLISHED_BPD.get(target, [])


# ------------------------------------------------------------------------------------------------ pixels

def pixel_levels(x: torch.Tensor, n_bins: int) -> torch.Tensor:
    """What ``flow_loss`` expects from data-layer images in [-1, 1] (``k * 2/255 - 1``).

    The exact uint8 levels k when ``n_bins`` divides 256 (Glow's bit reduction applies), else the floats
    ``k / 255`` in [0, 1], which ``to_levels`` rounds to ``n_bins`` levels: for sklearn digits (values
    0..16 stored as ``round(v * 255/16)``) and ``n_bins = 17`` these are exactly the native values v.
    """
    k = torch.round((x.float() + 1.0) * 127.5).clamp_(0, 255).to(torch.uint8)
    return k if 256 % n_bins == 0 else k.float() / 255.0


def flow_batch(target, generator: torch.Generator, n: int, n_bins: int) -> torch.Tensor:
    """The global batch, dequantised: ``levels + U[0, 1)`` in [0, n_bins), drawn on the CPU from ``generator``."""
    return dequantize(pixel_levels(target.sample(n, generator, "cpu"), n_bins), generator, n_bins,
                      torch.float32)


def nll_bits(model, x_deq: torch.Tensor, n_bins: int) -> torch.Tensor:
    """Mean bits/dim of a dequantised batch (``flow_loss`` with the noise already drawn). The log-likelihood comes
    from ``model(x)`` (``FlowModel.forward``: latents, log p), not ``model.log_prob``: under torchrun the model is a
    DistributedDataParallel wrapper, which has no ``log_prob`` and averages gradients only over its forward."""
    return bits_per_dim(model(preprocess(x_deq, n_bins))[1], math.prod(x_deq.shape[1:]), n_bins).mean()


# ------------------------------------------------------------------------------------------------ phase

class FlowStep(TrainingStep):
    """Maximum likelihood of a flow: ActNorm initialised on the first batch, drift-guard reporting."""

    def __init__(self, target, n_bins: int):
        super().__init__("flow")
        self.target, self.n_bins = target, n_bins

    def batch(self, generator, n, device):
        return dist.shard(flow_batch(self.target, generator, n, self.n_bins)).to(device, non_blocking=True)

    def loss(self, model, batch):
        return nll_bits(model, batch, self.n_bins)

    def on_setup(self, trainer) -> None:
        self._model = trainer.model  # whose drift-guard counts a step checkpoint keeps (``state_dict``)
        if not trainer.run.checkpoints(self.name).steps():  # a resumed run loads its initialised ActNorms instead
            self.init_actnorm(trainer)

    def state_dict(self) -> dict:
        """The drift guard's counts (its fallen-back layers are buffers of the model): a resumed run's final record
        said 3 drift events and a max error of 1.41e-6 where the uninterrupted run's said 4 and 1.44e-6."""
        model = getattr(self, "_model", None)
        return {} if model is None else model.drift_state()

    def on_load_checkpoint(self, trainer, state: dict) -> None:
        trainer.model.load_drift_state((state.get("callbacks") or {}).get(self.state_key) or {})

    @torch.no_grad()
    def init_actnorm(self, trainer) -> None:
        """Data-dependent ActNorm init on the first training batch: the *global* batch, drawn from a copy of
        the phase generator (so the stream the loop draws is unchanged), identical on every rank."""
        gen = torch.Generator()
        gen.set_state(trainer.generator.get_state())
        x = flow_batch(self.target, gen, trainer.cfg["batch_size"] * trainer.info.world, self.n_bins)
        trainer.model.log_prob(preprocess(x.to(trainer.device), self.n_bins))

    def on_train_batch_end(self, trainer, batch, outputs) -> None:
        if trainer.log_step():
            trainer.run.logger.log(self.name, trainer.step, drift_report(trainer.model))

    def on_phase_end(self, trainer) -> None:
        model = trainer.model
        report = drift_report(model)
        # the guard runs in invertible mode alone: standard and checkpoint said "0 layer(s) fell back ... (max
        # rebuild error 0, memory standard)" of a guard that never ran (their metrics still carry the report)
        if dist.current().is_main and model.memory == "invertible":
            (log.warning if report["fallen_back"] else log.info)(
                "flow drift guard: %d layer(s) fell back to storing their input%s (max rebuild error %.2g, "
                "memory %s)", report["fallen_back"],
                "" if not report["fallen_back"] else ": " + ", ".join(model.fallen_back),
                report["max_drift"], model.memory)
        trainer.run.logger.log(self.name, trainer.step, {**report, "final": True})


def drift_report(model) -> dict:
    """Fallen-back layers (persistent, from the ``keep_input`` buffers) and the largest rebuild error seen."""
    return {"fallen_back": len(model.fallen_back), "drift_events": len(model.drift_events),
            "max_drift": float(model.max_drift)}


# ------------------------------------------------------------------------------------------------ method

def check(cfg: dict, sample_shape: tuple[int, ...]) -> None:
    """Refuse, before any work, what a flow run cannot do."""
    from sinkflow.models import build_model

    m, t = cfg["model"]["flow"], cfg["train"]["flow"]
    if m["kind"] != "flow":
        raise SinkflowError(f"model.flow.kind={m['kind']!r} but experiment.method=flow trains a normalizing flow",
                            "set model.flow.kind=flow")
    if len(sample_shape) != 3:
        raise SinkflowError(f"flows here model images (C, H, W); data.target gives samples of shape {sample_shape}",
                            "use an image target (digits, mnist, cifar10, folder)")
    if m["memory"] == "invertible" and t["precision"] not in ("fp32", "auto"):  # auto: fp32 for a flow
        raise SinkflowError(f"model.flow.memory=invertible cannot train with train.flow.precision={t['precision']}",
                            "set train.flow.precision=fp32 or model.flow.memory=checkpoint")
    temp = cfg["sample"]["temperature"]
    if not temp >= 0:
        raise SinkflowError(f"sample.temperature={temp} must be >= 0", "e.g. sample.temperature=0.7")
    side, levels = 2 ** m["levels"], m["levels"]
    if m.get("squeeze", True) and any(n % side for n in sample_shape[1:]):  # the data's size is a data key
        h, w = sample_shape[1:]
        fit = max(side, round(max(h, w) / side) * side)
        most = next((k for k in range(levels - 1, 0, -1) if not (h % 2**k or w % 2**k)), 0)
        resize = f"data.image_size={fit} (resizes and center-crops: other pixels than the data set's own)"
        raise SinkflowError(f"a {levels}-level flow halves the image sides {levels} times, so they must be divisible "
                            f"by {side}; the data's images are {h}x{w}",
                            f"set model.flow.levels={most}, or {resize}" if most else f"set {resize}")
    # every architecture key and the shape (levels vs image size), on a throwaway one-step, narrow model
    build_model("flow", {**m, "depth_per_level": 1, "hidden_channels": 2}, sample_shape)


def warn_levels(target, n_bins: int, name: str, first: int = 2000) -> None:
    """Warn when ``n_bins`` rounds the data's pixel levels away: ``n_bins`` that does not divide 256 (flow-digits'
    17, sklearn digits' native levels) on images with more levels than that (a folder's 8-bit images) would fit and
    score a density over rounded images. A divisor of 256 is Glow's deliberate bit reduction: no warning."""
    images = getattr(target, "images", None)
    if images is None or 256 % n_bins == 0:
        return
    levels = int(np.count_nonzero(np.bincount(np.asarray(images[:first]).ravel(), minlength=256)))
    if levels > n_bins:
        log.warning("model.flow.n_bins=%d but data.target=%s has %d pixel levels in its first %d images: the flow "
                    "fits and scores them rounded to %d levels; set model.flow.n_bins=256 for 8-bit images",
                    n_bins, name, levels, min(first, len(images)), n_bins)


@torch.no_grad()
def decode(model, eps: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Model-space sample from standard-normal noise ``eps`` (N, *in_shape): the prior's reparameterisation.

    ``eps`` fills the latents in the order top, then the factored-out ones from the last level to the first
    (their priors are conditioned on what is decoded above them), each ``mean + temperature * std * eps``.
    """
    n = eps.shape[0]
    flat = eps.reshape(n, -1).to(model.top.mean.dtype)
    offset = 0

    def take(shape) -> torch.Tensor:
        nonlocal offset
        size = math.prod(shape)
        out = flat[:, offset:offset + size].reshape(n, *shape)
        offset += size
        return out

    top = model.top
    h = top.mean + temperature * torch.exp(top.log_std) * take(top.mean.shape[1:])
    for i in reversed(range(len(model.levels))):
        if i < len(model.splits):
            split = model.splits[i]
            mean, log_std = split._prior(h)
            h = split.inverse(h, mean + temperature * torch.exp(log_std) * take(mean.shape[1:]))
        h = model.levels[i].inverse(h)
    h = model.unpre(h)
    if offset != flat.shape[1]:
        raise SinkflowError(f"flow latents use {offset} numbers but the noise has {flat.shape[1]} per sample",
                            "sample with noise of the data's shape")
    return h


# ------------------------------------------------------------------------------------------------ evaluation

def _bpd_of(model, images: torch.Tensor, n_bins: int, seeds: int, batch: int) -> list[float]:
    """Mean bits/dim of ``images`` (data-layer floats in [-1, 1]), one fixed dequantisation draw per seed."""
    levels = pixel_levels(images, n_bins)
    values = []
    for s in range(seeds):
        gen = phase_generator(s, "dequantize-test")
        total = 0.0
        for chunk in levels.split(batch):
            total += float(flow_loss(model, chunk, gen, n_bins)[1]) * len(chunk)
        values.append(total / len(levels))
    return values


@torch.no_grad()
def test_bpd(run, n: int | None = None, seeds: int | None = None, batch: int | None = None, split: str = "test",
             model=None) -> dict:
    """Bits/dim of ``run``'s flow (or ``model``) on held-out images, one dequantisation draw per seed.

    ``split="test"``: ``n`` test images (default ``eval.n``). ``split="val"``: every image of the validation
    split carved from the train split (``data.val_fraction``); model selection reads this one only.
    """
    cfg = run.cfg
    _, target = data.distributions(cfg)
    seeds = seeds or cfg["eval"]["seeds"]
    batch = batch or cfg["train"]["flow"]["batch_size"]
    n_bins = cfg["model"]["flow"]["n_bins"]
    model = model if model is not None else run.model("flow")
    if split == "val":
        images = target.val_set()
    elif split == "test":
        images = target.test_set(min(n or cfg["eval"]["n"], len(target.test_images)))
    else:
        raise SinkflowError(f"unknown evaluation split {split!r}", "use 'val' or 'test'")
    values = _bpd_of(model, images, n_bins, seeds, batch)
    return {"bpd": statistics.fmean(values), "bpd_std": statistics.stdev(values) if seeds > 1 else 0.0,
            "bpd_all": values, "n": len(images), "seeds": seeds, "n_bins": n_bins, "target": target.name,
            "split": split,
            "trained_on": trains_on_test(target, split)}  # data.split=test: the test images are training images


def bpd_over_draws(r: dict) -> str:
    """A ``test_bpd`` result as printed: mean +- std over its dequantisation draws, or, from one draw, the value
    said to have no spread (eval.seeds=1 printed "+- 0.0000 over 1 dequantisation draws", a spread never measured,
    where the image metrics below it say theirs is none)."""
    if r["seeds"] > 1:
        return f"{r['bpd']:.4f} +- {r['bpd_std']:.4f} over {r['seeds']} dequantisation draws"
    return f"{r['bpd']:.4f}, one dequantisation draw (no spread)"


@torch.no_grad()
def select_checkpoint(run, paths, seeds: int | None = None) -> tuple[Path, list[dict]]:
    """Model selection on the validation split only: validation bits/dim of every checkpoint in ``paths``.

    Returns the best path and the curve ``[{"path", "step", "val_bpd", "val_bpd_std"}]``. Never reads the
    test split (a test replaces it with one that raises).
    """
    from sinkflow.runtime.run_folder import build_phase_model

    curve = []
    for path in paths:
        state = run.checkpoints("flow").load(path)  # weights only, and it must be this run's
        model = build_phase_model(run.cfg, "flow", data.sample_shape(run.cfg))
        model.load_state_dict(state.get("ema") or state["model"])
        model.to(run.device).eval().requires_grad_(False)
        r = test_bpd(run, seeds=seeds, split="val", model=model)
        curve.append({"path": str(path), "step": int(state.get("step", 0)), "val_bpd": r["bpd"],
                      "val_bpd_std": r["bpd_std"]})
    if not curve:
        raise SinkflowError("no checkpoints to select from", "train with train.flow.ckpt_every set")
    best = min(curve, key=lambda r: r["val_bpd"])
    return Path(best["path"]), curve


# ------------------------------------------------------------------------------------------------ method

# sample.temperature values `sinkflow tune` tries (1: the model; Glow's samples are shown at 0.7)
TEMPERATURES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class NormalizingFlow(Method):
    """``experiment.method=flow``: one maximum-likelihood phase; sampling is one inverse pass."""

    name = "flow"
    takes_steps = False
    clamps_samples = True  # sample_nets: the data's pixel levels (postprocess), never outside [-1, 1]

    def check(self, cfg: dict, sample_shape: tuple[int, ...]) -> None:
        check(cfg, sample_shape)

    def phases(self, cfg, source, target):
        check(cfg, tuple(target.shape))
        warn_levels(target, cfg["model"]["flow"]["n_bins"], cfg["data"]["target"])
        return [FlowStep(target, cfg["model"]["flow"]["n_bins"])]

    def default_steps(self, cfg: dict) -> int:
        return 1  # one inverse pass; Euler steps do not apply

    def eval_steps(self, cfg: dict) -> list[int]:
        return [1]

    @torch.no_grad()
    def sample_nets(self, nets, cfg, x0, steps=None, record=False):
        """Images in [-1, 1] on the data's pixel grid (``postprocess``) from the prior noise ``x0`` at
        ``sample.temperature``; ``steps`` is ignored.

        A Glow's inverse expands where its forward contracts (sigmoid couplings divide by a scale in (0, 1)),
        so a tail latent can overflow on the way back, in float64 too. Such samples are neither dropped nor
        redrawn: their pixels are clamped like every other sample's (+-inf to the range ends, NaN to
        mid-grey), they count in ``info["nonfinite"]``, and a warning says how many. Lower
        ``sample.temperature`` or train longer.
        """
        model = nets["flow"]
        temperature = cfg["sample"]["temperature"]
        raw = decode(model, x0.to(next(model.parameters()).device), temperature)
        bad = int((~torch.isfinite(raw.flatten(1))).any(1).sum())
        if bad:  # a sign of too little training: the tools' few-step scratch runs mute it (preflight flow-cifar10
            # said all 16 of its 3-step run's samples overflowed, then passed), a real run's sampling says it
            logging.getLogger(LEARNING_LOG).warning(
                "flow sampling: %d of %d samples overflowed in the inverse (temperature %g); their pixels are "
                "clamped, NaN shown as mid-grey", bad, len(raw), temperature)
        x = postprocess(raw, cfg["model"]["flow"]["n_bins"]) * 2 - 1  # on the data's pixel grid
        return x, {"nfe": 1, "path": [x.cpu()] if record else [], "nonfinite": bad}

    def evaluate(self, run, ev, seeds: int | None = None, n: int | None = None, split: str = "test") -> str:
        """``sinkflow eval`` for flows: validation (where there is one) and test bits/dim, then the image metrics of
        samples (one inverse pass). ``split="val"``: no test bits/dim, the samples scored against validation."""
        lines, bpd = [], {}  # recorded with the image metrics: one evaluation, one record (Run.scores reads it)
        if run.cfg["data"].get("val_fraction", 0) > 0:
            v = test_bpd(run, seeds=seeds, split="val")
            bpd.update(val_bpd=v["bpd"], val_bpd_std=v["bpd_std"])
            lines.append(f"Validation bits/dim on {run.cfg['experiment']['preset']} (flow): {bpd_over_draws(v)}, "
                         f"{v['n']} validation {v['target']} images (carved from the train split; model "
                         "selection reads this one)")
        if split == "test":
            r = test_bpd(run, n=n, seeds=seeds)  # its n and seeds are the image metrics' (the record's setting)
            bpd.update(test_bpd=r["bpd"], test_bpd_std=r["bpd_std"])
            lines.append(f"Test bits/dim on {run.cfg['experiment']['preset']} (flow): {bpd_over_draws(r)}, "
                         f"{r['n']} {'test' if r['trained_on'] else 'held-out'} {r['target']} images, "
                         f"{r['n_bins']} pixel levels"
                         + ("; the split it trained on (data.split=test)" if r["trained_on"] else ""))
            for name, value in published_bpd(r["target"], r["n_bins"], data.sample_shape(run.cfg)):
                lines.append(f"  published, for context: {name}: {value:.2f}")
        metrics = ev.image_metrics(run, seeds=seeds, n=n, steps_list=self.eval_steps(run.cfg), split=split)
        run.logger.log_evaluation(ev.image_record(run, metrics, split, bpd, by_steps=False))  # fd_cnn and nfe too
        lines.append(f"Samples at temperature {run.cfg['sample']['temperature']} (steps = 1 inverse pass; "
                     f"{'QMC' if run.cfg['eval']['protocol'] == 'qmc' else 'i.i.d.'} prior noise, eval.protocol):")
        lines.append(ev.format_metrics(metrics))
        return "\n".join(lines)

    @torch.no_grad()
    def plots(self, run, ev, n: int = 64) -> list[Path]:
        """grid.png: ``n`` samples at ``sample.temperature`` (a flow has no sampling path to draw)."""
        x, _ = ev.generate(run, n, 1, seed=7)
        return [ev.save_grid(x, run.dir / "grid.png")]

    def sampler_settings(self, cfg):
        return 1, {"temperature": cfg["sample"]["temperature"]}

    def sampler_candidates(self, cfg, total):
        if total != 1:
            raise SinkflowError(f"--nfe {total}: a normalizing flow samples in one pass of its inverse",
                                "leave --nfe out (its candidates are sample.temperature values)")
        return [{"temperature": t} for t in TEMPERATURES]

    def describe(self, cfg: dict) -> str:
        m = cfg["model"]["flow"]
        return (f"flow: a normalizing flow trained by maximum likelihood ({m['n_bins']} pixel levels, memory "
                f"{m['memory']}); sampling is one inverse pass at temperature {cfg['sample']['temperature']}")


METHOD = NormalizingFlow()
