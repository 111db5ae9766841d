"""Image evaluation: sample grids, trajectory strips, and metrics that are real or absent, never faked.

Offline metrics (every image set): exact W2 in pixel space ([-1, 1] pixels, flattened, POT emd2)
between generated and held-out real images. For digit sets (sklearn digits, MNIST): a scikit-learn
logistic-regression classifier trained on the training split (its arrays cached under ``<data.root>/cache``)
gives the class histogram and mean confidence of generated vs held-out real images. FID runs only
when ``eval.inception_weights`` names a local weights file (torchmetrics' FrechetInceptionDistance,
which uses torch-fidelity's Inception-v3); otherwise one line says it was skipped and why. For digit sets,
FD-CNN (sinkflow.eval.fd_cnn) is the offline stand-in: the same Fréchet formula on the features of a small
CNN trained on the training split, with its floor (real training digits vs the held-out ones at the same n);
it is not Inception FID and is never labelled so.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sinkflow import data, methods
from sinkflow.data.atomic_write import atomic_path, atomic_write_bytes, temp_beside
from sinkflow.data.images import trains_on_test
from sinkflow.errors import SinkflowError
from sinkflow.eval import fd_cnn
from sinkflow.eval.points import generate
from sinkflow.eval.records import image_record

log = logging.getLogger(__name__)
CLASSIFIER_SETS = data.DIGIT_SETS
CLASSIFIER_MAX_TRAIN = 20000


# ------------------------------------------------------------------------------------------------ pictures

def _to_unit(x: torch.Tensor) -> torch.Tensor:
    return ((x.detach().float().cpu().clamp(-1, 1) + 1) / 2)


def _upscale_factor(height: int, width: int, min_side: int = 32) -> int:
    return max(1, math.ceil(min_side / min(height, width)))


def _upscale(x: torch.Tensor, min_side: int = 32) -> torch.Tensor:
    """Nearest-neighbour upscaling so 8x8 digits are visible in a grid (pixels stay exact squares)."""
    factor = _upscale_factor(*x.shape[-2:], min_side=min_side)
    return torch.nn.functional.interpolate(x, scale_factor=factor, mode="nearest") if factor > 1 else x


# bytes ``save_grid`` holds per element of the grid at its peak: torchvision's save_image keeps make_grid's float32
# grid and its ``grid.mul(255)`` float32 copy, then the uint8 copy and PIL's copies of it (the peak measured 2.0 GB for
# 20,000 28x28 digits, where 5 bytes an element counted 1.26 GB: the check passed a grid the machine could not hold)
GRID_BYTES_PER_ELEMENT = 12


def grid_bytes(n: int, shape: tuple[int, ...]) -> int:
    """About the memory ``save_grid`` holds for ``n`` images of ``shape`` (C, H, W): the upscaled images and their grid
    (torchvision's make_grid: 3 channels, 2-pixel padding) as ``GRID_BYTES_PER_ELEMENT`` bytes an element: about
    13 GB for `sample --n 100000 --out grid.png` of MNIST digits, which the memory check before sampling did not
    count."""
    c, h, w = shape[-3:]
    f = _upscale_factor(h, w)
    cols = max(1, math.ceil(math.sqrt(n)))  # save_grid's nrow: images per row
    rows = math.ceil(n / cols)
    grid = 3 * (rows * (h * f + 2) + 2) * (cols * (w * f + 2) + 2)
    return 4 * n * c * h * f * w * f + GRID_BYTES_PER_ELEMENT * grid


def save_grid(x: torch.Tensor, path, nrow: int | None = None) -> Path:
    """Save (N, C, H, W) images in [-1, 1] as one PNG grid (torchvision.utils.save_image)."""
    from torchvision.utils import save_image

    if x.ndim != 4:
        raise SinkflowError(f"save_grid needs images shaped (N, C, H, W), got {tuple(x.shape)}",
                            "save point samples as .npy or a scatter plot")
    path = Path(path)
    nrow = nrow or max(1, math.ceil(math.sqrt(len(x))))
    grid = _upscale(_to_unit(x))  # written atomically: a kill or a full disk mid-write keeps the grid that was there
    from PIL import Image

    fmt = Image.registered_extensions().get(path.suffix.lower(), "PNG")  # PIL's name: .jpg is JPEG, .tif TIFF
    atomic_write_bytes(path, lambda f: save_image(grid, f, format=fmt, nrow=nrow, padding=2, pad_value=1.0))
    return path


def pixels(x: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) images in [-1, 1] as (N, C, H, W) uint8 on the CPU, rounded as ``torchvision.utils.save_image``
    rounds: a data set's own pixel k comes back as k."""
    return _to_unit(x).mul(255).add_(0.5).clamp_(0, 255).to(torch.uint8)


def to_uint8(x: torch.Tensor) -> np.ndarray:
    """(N, C, H, W) images in [-1, 1] as (N, H, W, C) uint8 (``pixels``: so a folder's image has the grid's
    pixels)."""
    return pixels(x).permute(0, 2, 3, 1).numpy()


def check_image_folder(folder, n: int) -> Path:
    """Refuse, before any sampling, a folder that already holds files (nothing saved is overwritten)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise SinkflowError(f"--out {folder} is a file, not a folder", "name a new folder, e.g. --out samples/")
    if folder.is_dir() and any(folder.iterdir()):
        raise SinkflowError(f"--out {folder} already holds files; {n} images would mix with them",
                            "name a new or empty folder")
    return folder


def save_image_folder(x: torch.Tensor, folder, progress: bool = True) -> Path:
    """One PNG per image (``000000.png``, ...; grayscale or RGB at the native size), the folder that FID tools
    (torch-fidelity, clean-fid, pytorch-fid) read. Written into a hidden sibling folder renamed into place at the
    end, so a failed write leaves no folder that looks complete."""
    import shutil

    from PIL import Image

    from sinkflow.runtime.callbacks import progress as progress_of

    if x.ndim != 4 or x.shape[1] not in (1, 3):
        raise SinkflowError(f"a folder of PNGs needs images shaped (N, 1 or 3, H, W), got {tuple(x.shape)}",
                            "save point samples as .npy or a scatter plot (.png)")
    folder = check_image_folder(folder, len(x))
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_beside(folder)
    tmp.mkdir()
    try:
        width = max(6, len(str(len(x) - 1)))
        pixels = to_uint8(x)
        for i in progress_of(range(len(x)), "png", "images", enabled=progress and len(x) >= 1000):
            img = pixels[i]
            Image.fromarray(img[..., 0] if img.shape[-1] == 1 else img).save(tmp / f"{i:0{width}d}.png")
        if folder.is_dir():
            folder.rmdir()  # empty (checked above): the rename needs the name free
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _pick_states(path: list, nsgf_steps: int | None, cols: int = 8, warp: float = 1.0) -> tuple[list[int], list[str]]:
    """Which recorded states the strip shows, and their column titles: NSGF++'s parts, or how far along the
    sampling grid each state is (``warp``: the run's sample.time_warp, whose grid is not uniform: a state titled
    t=i/K was at 1 - (1 - i/K)^warp)."""
    from sinkflow.methods.ode import warped_fractions

    last = len(path) - 1
    if nsgf_steps is not None:  # NSGF++: x0, every NSGF step, the NSF result
        idx = list(range(nsgf_steps + 1)) + [last]
        return idx, ["noise"] + [f"NSGF {k}" for k in range(1, nsgf_steps + 1)] + ["NSF result"]
    idx = sorted({round(i * last / (cols - 1)) for i in range(cols)})
    grid = warped_fractions(last, warp) if last else [0.0]
    return idx, [f"t={grid[i]:.2f}" for i in idx]


def trajectory_strip(path: list, out, nsgf_steps: int | None = None, t_hat: torch.Tensor | None = None,
                     rows: int = 6, title: str = "", warp: float = 1.0) -> Path:
    """One row per sample, one column per shown state; NSGF++ writes t_hat on the last NSGF column."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    idx, names = _pick_states(path, nsgf_steps, warp=warp)
    rows = min(rows, path[0].shape[0])
    fig, axes = plt.subplots(rows, len(idx), figsize=(1.3 * len(idx), 1.3 * rows + 0.5), squeeze=False)
    for r in range(rows):
        for c, k in enumerate(idx):
            img = _to_unit(path[k][r]).permute(1, 2, 0).numpy()
            ax = axes[r][c]
            ax.imshow(img[..., 0] if img.shape[-1] == 1 else img, cmap="gray", vmin=0, vmax=1,
                      interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(names[c], fontsize=8)
            if t_hat is not None and nsgf_steps is not None and c == nsgf_steps:
                ax.text(0.03, 0.97, rf"$\hat{{t}}$={float(t_hat[r]):.2f}", transform=ax.transAxes, fontsize=7, va="top",
                        color="yellow", bbox={"facecolor": "black", "alpha": 0.6, "pad": 1, "lw": 0})
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    from sinkflow.eval.plots import save_figure

    return save_figure(fig, out, dpi=110)


@torch.no_grad()
def plots(run, n: int = 64) -> list[Path]:
    """grid.png (n samples) and trajectory_strip.png (the sampling path of a few of them)."""
    cfg = run.cfg
    method = methods.of(cfg)
    steps = method.default_steps(cfg)
    x, info = generate(run, n, steps, seed=7, record=True)
    grid = save_grid(x, run.dir / "grid.png")
    title = f"{data_label(cfg['data']['target'], cfg['experiment']['preset'])} ({method.name}, NFE {info['nfe']})"
    strip = trajectory_strip(info["path"], run.dir / "trajectory_strip.png", info.get("nsgf_steps"),
                             info.get("t_hat"), title=title, warp=float(cfg["sample"].get("time_warp", 1.0)))
    return [grid, strip]


# ------------------------------------------------------------------------------------------------ metrics

def _flat(x) -> np.ndarray:
    x = x.float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, np.float32)
    return x.reshape(len(x), -1)


def digit_classifier(target, data_root: str):
    """LogisticRegression on the training split (pixels in [-1, 1]), fitted once. The cache under
    ``<data.root>/cache`` holds only its arrays (.npz read with ``allow_pickle=False``): a cache file is never
    unpickled, so a planted one cannot run code. Its name holds a hash of the data (``fd_cnn.data_key``, as the
    FD-CNN's cache): keyed on the name, shape and count alone, other images of the same size in the same data.root
    were scored by a classifier fitted on the old ones (audit HH)."""
    from sklearn.linear_model import LogisticRegression

    from sinkflow.eval.fd_cnn import data_key

    name = getattr(target, "name", "")
    if name not in CLASSIFIER_SETS or getattr(target, "labels", None) is None:
        return None
    shape = "x".join(str(s) for s in target.shape)
    path = Path(data_root) / "cache" / f"classifier-{name}-{shape}-n{len(target.images)}-{data_key(target)[:16]}.npz"
    clf = LogisticRegression(max_iter=1000, C=0.5)
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as z:
                coef, intercept, classes = z["coef"], z["intercept"], z["classes"]
            if coef.ndim == 2 and coef.shape[1] == math.prod(target.shape) and len(intercept) == len(coef):
                clf.coef_, clf.intercept_, clf.classes_ = coef, intercept, classes
                clf.n_features_in_ = coef.shape[1]
                return clf
            log.info("classifier cache %s does not match the data; refitting", path)
        except (OSError, ValueError, KeyError):  # a stale, truncated or foreign cache is refitted
            log.info("classifier cache %s unreadable; refitting", path)
    n = min(len(target.images), CLASSIFIER_MAX_TRAIN)
    images = np.asarray(target.images[:n], dtype=np.float32) * (2 / 255) - 1
    clf.fit(images.reshape(n, -1), np.asarray(target.labels[:n]))
    try:
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, coef=clf.coef_, intercept=clf.intercept_, classes=clf.classes_)
    except OSError as exc:  # a cache under a data.root this machine cannot write (fd_cnn.train_cnn's alike)
        log.warning("digit classifier of %s not cached (%s cannot be written: %s); the next evaluation fits it again",
                    name, path.parent, exc.strerror or type(exc).__name__)
    return clf


def class_stats(clf, x) -> dict:
    """Class histogram (fractions over the classifier's classes) and mean max-probability."""
    probs = clf.predict_proba(_flat(x.clamp(-1, 1) if isinstance(x, torch.Tensor) else x))
    hist = np.bincount(probs.argmax(1), minlength=probs.shape[1]) / len(probs)
    return {"hist": hist, "confidence": float(probs.max(1).mean())}


INCEPTION_FIX = ("point it at a local pt_inception-2015-12-05 weights file or set it to null (in a run copied from the "
                 "machine it trained on: `sinkflow train --resume RUN eval.inception_weights=PATH --no-report`, a "
                 "finished run too)")


class InceptionFID:
    """FID by torchmetrics (torch-fidelity Inception-v3, 2048-d pool features, from a local weights file) against one
    fixed real set: the real images' features are extracted once (``reset_real_features=False``) and every generated
    set is scored against them, so scoring many samplers costs one Inception pass over the real images, not one each.

    ``extractor``: any module of torchmetrics' custom-feature interface (float images in [0, 1], 3 channels,
    -> (N, d), ``num_features``) in place of Inception; the tests use a tiny one, since the weights are not here.

    Inception reads uint8 pixels, rounded as the PNGs of `sinkflow sample --out DIR/` are (``pixels``): a real
    image's pixel k is k, and a generated image's pixels are its PNG's, which external FID tools read. torchmetrics'
    ``normalize=True`` truncated floats instead, ``(x * 255).byte()``: 47 of the 256 levels of a real image (k / 255
    in float32 lands just below k) reached Inception as k - 1, and generated pixels were floored where their PNGs
    round, so the two sets were quantised by different rules."""

    def __init__(self, real: torch.Tensor, weights: str | None, extractor: torch.nn.Module | None = None):
        hint = "pip install torchmetrics torch-fidelity, or unset eval.inception_weights"
        try:
            from torchmetrics.image.fid import FrechetInceptionDistance
        except ImportError:
            raise SinkflowError("FID needs torchmetrics and torch-fidelity, which are not installed", hint) from None
        self.floats = extractor is not None
        if extractor is not None:
            self.metric = FrechetInceptionDistance(feature=extractor, normalize=True, reset_real_features=False)
        else:
            weights = Path(weights).expanduser()
            if not weights.is_file():
                raise SinkflowError(f"eval.inception_weights={weights} is not a file", INCEPTION_FIX)
            try:  # torchmetrics without torch-fidelity imports, then refuses here (a raw ModuleNotFoundError)
                self.metric = FrechetInceptionDistance(feature=2048, normalize=False, reset_real_features=False,
                                                       feature_extractor_weights_path=str(weights))
            except ModuleNotFoundError:
                raise SinkflowError("FID needs torch-fidelity (torchmetrics' Inception-v3), which is not installed",
                                    hint) from None
            except torch.OutOfMemoryError:
                raise
            except (RuntimeError, pickle.UnpicklingError, EOFError, KeyError) as exc:
                # torch-fidelity loads the file strictly (torch.load, load_state_dict): torchvision's ImageNet
                # Inception-v3 (1000 classes, AuxLogits) or a file that is not a state dict was a multi-line traceback
                # at the report after training, which read as a crash of the evaluation, not as the wrong file
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
                raise SinkflowError(f"eval.inception_weights={weights} is not the FID Inception-v3 weights "
                                    f"(pt_inception-2015-12-05) torch-fidelity loads: {first}", INCEPTION_FIX) from None
        self._update(real, True)

    def _update(self, imgs: torch.Tensor, real: bool) -> None:
        for chunk in imgs.split(256):
            chunk = _to_unit(chunk) if self.floats else pixels(chunk)
            self.metric.update(chunk.expand(-1, 3, -1, -1) if chunk.shape[1] == 1 else chunk, real=real)

    def __call__(self, generated: torch.Tensor) -> float:
        self.metric.reset()  # drops the previous generated set's features only
        self._update(generated, False)
        return float(self.metric.compute())


def fid(generated: torch.Tensor, real: torch.Tensor, weights: str | None, extractor: torch.nn.Module | None = None
        ) -> float:
    """FID of one generated set against one real set (``InceptionFID`` for many generated sets)."""
    return InceptionFID(real, weights, extractor)(generated)


@dataclass
class HeldOut:
    """What every sampler of a run is scored against, built once per (split, n) by ``held_out``: the ``n`` real
    images W2 and FID read, the digit classifier and the real class statistics, the FD-CNN reference (every
    held-out image's features and the floor) and the FID's real features. ``sinkflow tune`` scores its candidates
    against one of these, so the reference work is done once, not once a candidate."""

    name: str
    split: str
    n: int
    n_test: int
    class_n: int
    real: torch.Tensor
    clf: object | None
    real_stats: dict | None
    cnn: dict | None
    fid: InceptionFID | None
    weights: str | None
    trained_on: bool = False  # the test split is the one the run trained on (data.split=test)


def held_out(cfg: dict, split: str = "test", n: int | None = None) -> HeldOut:
    """The reference of ``split`` ("test", or "val" for choices that must not read the test split) for ``cfg``'s
    data and ``eval`` section (``n`` defaults to ``eval.n``)."""
    if split not in ("test", "val"):
        raise SinkflowError(f"image_metrics: unknown split {split!r}", "use 'test' or 'val'")
    _, target = data.distributions(cfg)
    val = target.val_set() if split == "val" else None
    n_test = len(target.test_images) if val is None else len(val)
    n = min(n or cfg["eval"]["n"], n_test)
    class_n = max(n, cfg["eval"].get("class_n") or n)  # the classifier columns need more samples than W2 can use
    if cfg["eval"]["inception_weights"] and n < 2:
        raise SinkflowError(f"FID of {n} image: a Fréchet distance fits a covariance to each side's features, so it "
                            "needs at least 2", "use --n 2 or more (eval.n for the report after training)")
    weights = cfg["eval"]["inception_weights"]
    if weights and not Path(weights).expanduser().is_file():  # before the classifiers: a run's absolute path from the
        # machine it trained on was refused after the FD-CNN had trained (seconds to minutes) and its samples drawn
        raise SinkflowError(f"eval.inception_weights={weights} is not a file", INCEPTION_FIX)
    clf = digit_classifier(target, cfg["data"]["root"])
    real = target.test_set(n) if val is None else val[:n]
    cnn = None
    if clf is not None:  # FD-CNN against every held-out image (its covariance needs them), not the W2 subset
        every = target.test_set(n_test) if val is None else val
        cnn = fd_cnn_reference(target, cfg["data"]["root"], every, class_n, val is not None)
    real_stats = class_stats(clf, real) if clf is not None else None
    return HeldOut(target.name, split, n, n_test, class_n, real, clf, real_stats, cnn,
                   InceptionFID(real, weights) if weights else None, weights, trains_on_test(target, split))


def image_metrics(run, seeds: int | None = None, n: int | None = None, steps_list=None, split: str = "test",
                  reference: HeldOut | None = None, per_seed: bool = False) -> dict:
    """Metrics for each sampling setting, mean/std over seeds; plus the protocol used. ``split="val"`` scores
    against the validation split (``data.val_fraction``) instead, for choices that must not read the test split.
    ``reference``: a ``held_out`` built once for many calls (its split and n are then the ones used).
    ``per_seed``: each row also holds every seed's value (``fd_cnn_per_seed``): the seeds are the same for every
    setting, so two settings compare seed by seed (``sinkflow tune``)."""
    from sinkflow.ot import w2

    cfg = run.cfg
    seeds = seeds or cfg["eval"]["seeds"]
    ref = reference or held_out(cfg, split, n)
    n, class_n, clf, cnn, real_stats = ref.n, ref.class_n, ref.clf, ref.cnn, ref.real_stats
    method = methods.of(cfg).name
    steps_list = steps_list or methods.of(cfg).eval_steps(cfg)
    rows = []
    for steps in steps_list:
        vals: dict[str, list] = {"w2": [], "tv": [], "confidence": [], "fd_cnn": [], "fid": []}
        info, t_hat = {}, []
        for s in range(seeds):
            x_all, info = generate(run, class_n if clf is not None else n, steps, seed=1000 + s)
            if info.get("t_hat") is not None:  # NSGF++: where the predictor starts each sample's straight flow
                t_hat.append(info["t_hat"].float().cpu())
            x_all = x_all.cpu()  # finite: generate refuses NaN / Inf samples (check_finite_samples)
            x = x_all[:n]
            vals["w2"].append(w2(x, ref.real))
            if clf is not None:
                st = class_stats(clf, x_all)
                vals["tv"].append(0.5 * float(np.abs(st["hist"] - real_stats["hist"]).sum()))
                vals["confidence"].append(st["confidence"])
                vals["fd_cnn"].append(fd_cnn.fd(fd_cnn.features(cnn["net"], x_all), cnn["real"]))
            if ref.fid is not None:
                vals["fid"].append(ref.fid(x))
        row = {"steps": steps, "nfe": info["nfe"],
               "nfe_breakdown": {k[4:]: v for k, v in info.items() if k.startswith("nfe_")} or None}
        if t_hat:
            t = torch.cat(t_hat)
            row.update(t_hat_mean=float(t.mean()), t_hat_min=float(t.min()), t_hat_max=float(t.max()))
        for key, v in vals.items():
            if v:
                row[key] = statistics.fmean(v)
                row[f"{key}_std"] = statistics.stdev(v) if len(v) > 1 else 0.0
                if per_seed:
                    row[f"{key}_per_seed"] = list(v)
        if clf is not None:
            row["hist"] = st["hist"].round(3).tolist()
        rows.append(row)
    # whose the real images are, in every line that names them: "held-out" said of validation images (which the
    # classifier and the FD-CNN were fitted to, with the rest of the training split) read as a test-split score
    real = "validation" if ref.split == "val" else "test" if ref.trained_on else "held-out"
    protocol = {
        "n": n, "class_n": class_n if clf is not None else None, "seeds": seeds, "real": real,
        "reference": (f"{ref.name} test split, the images this run trained on (data.split=test)" if ref.trained_on
                      else f"{ref.name} {'held-out' if ref.split == 'test' else 'validation'} split")
                     + f" ({n} of {ref.n_test} images, fixed subset)",
        "w2": "exact W2, POT emd2, squared Euclidean cost on flattened pixels (data in [-1,1]; generated samples "
              + ("clamped to [-1,1] by the flow's sampler)" if methods.of(cfg).clamps_samples else
                 "as sampled, not clamped)"),
        "classifier": (f"sklearn LogisticRegression(C=0.5) on <= {CLASSIFIER_MAX_TRAIN} training-split images; "
                       f"TV = total-variation distance of predicted-class histograms, {class_n} generated vs "
                       f"{n} {real} real" + ("; the classifier was fitted to the training split, these validation "
                                            "images included" if ref.split == "val" else ""))
        if clf is not None else None,
        "real_confidence": real_stats["confidence"] if real_stats else None,
        "real_hist": real_stats["hist"].round(3).tolist() if real_stats else None,
        "fd_cnn": (f"FD-CNN (not Inception FID): Fréchet distance of {fd_cnn.FEATURES}-d features of a small CNN "
                   f"trained on the training split (held-out accuracy {cnn['accuracy']:.4f}), {class_n} generated vs "
                   f"all {ref.n_test} {real} real") if cnn else None,
        "fd_cnn_floor": cnn["floor"] if cnn else None,
        "fd_cnn_floor_n": cnn["floor_n"] if cnn else None,
        "fid": (f"torchmetrics FrechetInceptionDistance (2048-d, torch-fidelity Inception-v3 from {ref.weights}), "
                f"{n} generated vs {n} {real} real") if ref.weights else None,
    }
    return {"rows": rows, "protocol": protocol, "method": method, "preset": cfg["experiment"]["preset"],
            "target": ref.name}


def fd_cnn_reference(target, data_root, real: torch.Tensor, n_gen: int, val: bool) -> dict:
    """The FD-CNN network, the held-out features and the floor: ``n_gen`` real training digits (a fixed
    subset; with a validation split, only the digits models are fitted to) against the same held-out digits."""
    net, acc = fd_cnn.train_cnn(target, data_root)
    pool = target.fit_images() if val else np.asarray(target.images)
    idx = np.sort(np.random.default_rng(4242).choice(len(pool), size=min(n_gen, len(pool)), replace=False))
    real_feats = fd_cnn.features(net, real)
    floor = fd_cnn.fd(fd_cnn.features(net, np.asarray(pool[idx])), real_feats)
    return {"net": net, "accuracy": acc, "real": real_feats, "floor": floor, "floor_n": len(idx)}


def data_label(target: str, preset: str | None) -> str:
    """The images a run made or scored, by their set's name, and the preset where it is another one: a `digits`
    run trained on data.target=mnist titled its grid and trajectory strip "digits" over MNIST digits."""
    return target if preset in (None, target) else f"{target} (preset {preset})"


def format_metrics(result: dict) -> str:
    p = result["protocol"]
    on = data_label(result.get("target") or result["preset"], result["preset"])
    lines = [f"Image metrics on {on} ({result['method']}): {p['n']} generated vs {p['reference']}, "
             + (f"mean +- std over {p['seeds']} sampling seeds" if p["seeds"] > 1 else
                "one sampling seed (no spread: the +- 0.000 is not a measurement)"),
             f"  W2: {p['w2']}"]
    if p["classifier"]:
        real = p.get("real", "held-out")
        lines.append(f"  classifier: {p['classifier']}; real {real} confidence {p['real_confidence']:.3f}")
    if p.get("fd_cnn"):
        same = "same n" if p["fd_cnn_floor_n"] == p["class_n"] else f"{p['fd_cnn_floor_n']}: all there are"
        lines.append(f"  {p['fd_cnn']}; floor (real training digits, {same}) {p['fd_cnn_floor']:.3f}")
    if p["fid"]:
        lines.append(f"  FID: {p['fid']}")
    else:
        lines.append("  FID skipped: eval.inception_weights is not set (no Inception weights can be downloaded "
                     "offline); set it to a local pt_inception-2015-12-05 file to compute FID")
    head = f"  {'steps':>5} {'NFE':>4} {'W2 (pixels)':>16}"
    if p["classifier"]:
        head += f" {'class TV':>15} {'confidence':>15}"
    if p.get("fd_cnn"):
        head += f" {'FD-CNN':>15}"
    if p["fid"]:
        head += f" {'FID':>15}"
    lines.append(head)
    for r in result["rows"]:
        line = f"  {r['steps']:>5} {r['nfe']:>4} {r['w2']:>8.3f} +- {r['w2_std']:.3f}"
        if p["classifier"]:
            line += f" {r['tv']:>7.3f} +- {r['tv_std']:.3f} {r['confidence']:>7.3f} +- {r['confidence_std']:.3f}"
        if "fd_cnn" in r:
            line += f" {r['fd_cnn']:>7.3f} +- {r['fd_cnn_std']:.3f}"
        if p["fid"]:
            line += f" {r['fid']:>7.2f} +- {r['fid_std']:.2f}"
        if r["nfe_breakdown"]:
            line += "   NFE = " + " + ".join(f"{v} {k}" for k, v in r["nfe_breakdown"].items())
        if "t_hat_mean" in r:  # the predictor's placement: a seed-dependent t_hat moves FD (docs/nsgfpp.md)
            line += f"; t_hat {r['t_hat_mean']:.2f} ({r['t_hat_min']:.2f}-{r['t_hat_max']:.2f})"
        lines.append(line)
    return "\n".join(lines)


def evaluate_images(run, seeds: int | None = None, n: int | None = None, split: str = "test") -> str:
    result = image_metrics(run, seeds=seeds, n=n, split=split)
    run.logger.log_evaluation(image_record(run, result, split))
    return format_metrics(result)
