"""FD-CNN: a Fréchet distance in the feature space of a small digit classifier, computable offline.

Inception FID needs weights that cannot be downloaded here, and Inception features of 28x28 gray digits
say little anyway. FD-CNN trains a small CNN classifier on the *training* split of a digit set (never the
held-out digits), takes its 64-d penultimate activations as features and reports the Fréchet distance
between the Gaussians fitted to generated and held-out features, exactly the FID formula in another
feature space. Its numbers are NOT comparable with Inception FID (the paper's 3.8 on MNIST); compare them
only with each other and with the floor (real training digits against the same held-out digits, same n).

The trained network is cached under ``<data.root>/cache`` as plain arrays (an .npz written and read with
``allow_pickle=False``: a planted cache cannot run code), keyed on a SHA-256 of the data it was trained
and tested on, so a changed data set trains a new one.
"""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from sinkflow.data.atomic_write import atomic_path

log = logging.getLogger(__name__)
FEATURES = 64
EPOCHS = 8
MIN_STEPS = 500  # a small set gets more epochs: 8 epochs of the 1,438 sklearn digits were 96 steps (accuracy 0.79)
BATCH = 128
SEED = 0
TRAINING = f"e{EPOCHS}s{MIN_STEPS}"  # in the cache's name: a network trained under another rule is not reused


def epochs_for(n: int) -> int:
    """Epochs over ``n`` training images: 8, or as many as make at least MIN_STEPS Adam steps of BATCH.
    MNIST's 8,000 t10k training digits: 8 epochs (504 steps, as before); sklearn's 1,438 digits: 42 (504)."""
    return max(EPOCHS, math.ceil(MIN_STEPS / math.ceil(n / BATCH)))


class DigitCNN(nn.Module):
    """conv 16 - pool - conv 32 - pool - fc 64 (the features) - fc classes. Inputs in [-1, 1]."""

    def __init__(self, shape: tuple[int, int, int], classes: int = 10):
        super().__init__()
        c, h, w = shape
        self.body = nn.Sequential(
            nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(32 * (h // 4) * (w // 4), FEATURES), nn.ReLU())
        self.head = nn.Linear(FEATURES, classes)
        self.num_features = FEATURES

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def data_key(target) -> str:
    """SHA-256 over the training and held-out images and labels: the cache's key (any change retrains)."""
    h = hashlib.sha256()
    for arr in (target.images, target.labels, target.test_images, target.test_labels):
        a = np.ascontiguousarray(arr)
        h.update(f"{a.dtype}{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _unit(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(images, dtype=np.float32) * (2 / 255) - 1)


def cache_path(target, data_root) -> Path:
    shape = "x".join(str(s) for s in target.shape)
    return Path(data_root) / "cache" / f"fdcnn-{target.name}-{shape}-{TRAINING}-{data_key(target)[:16]}.npz"


def _load(path: Path, net: DigitCNN) -> float | None:
    """The cached test accuracy after loading the weights into ``net``; None when the file is absent,
    unreadable or does not fit the network (it is then retrained and replaced)."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        state = net.state_dict()
        weights = {k[2:]: torch.from_numpy(v) for k, v in arrays.items() if k.startswith("w:")}
        if set(weights) != set(state) or any(weights[k].shape != state[k].shape for k in state):
            raise ValueError("the arrays do not match the network")
        net.load_state_dict(weights)
        return float(arrays["accuracy"])
    except (OSError, ValueError, KeyError) as e:
        log.info("FD-CNN cache %s unusable (%s); retraining", path, e)
        return None


def train_cnn(target, data_root) -> tuple[DigitCNN, float]:
    """The classifier for ``target`` (an image distribution with labels) and its held-out accuracy: loaded
    from the cache when it holds one for exactly this data, else trained on the training split (seeded,
    one CPU thread's worth of work: at least MIN_STEPS steps of Adam) and cached."""
    net = DigitCNN(tuple(target.shape), int(max(target.labels.max(), target.test_labels.max())) + 1)
    path = cache_path(target, data_root)
    acc = _load(path, net)
    if acc is None:
        torch.manual_seed(SEED)
        net = DigitCNN(tuple(target.shape), net.head.out_features)
        x, y = _unit(target.images), torch.from_numpy(np.asarray(target.labels, dtype=np.int64))
        opt = torch.optim.Adam(net.parameters(), 1e-3)
        gen = torch.Generator().manual_seed(SEED)
        net.train()
        for _ in range(epochs_for(len(x))):
            for idx in torch.randperm(len(x), generator=gen).split(BATCH):
                loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
        net.eval()
        with torch.no_grad():
            pred = torch.cat([net(c).argmax(1) for c in _unit(target.test_images).split(1000)])
        acc = float((pred.numpy() == np.asarray(target.test_labels)).mean())
        arrays = {f"w:{k}": v.detach().cpu().numpy() for k, v in net.state_dict().items()}
        try:
            with atomic_path(path) as tmp, open(tmp, "wb") as f:
                np.savez(f, accuracy=np.float64(acc), **arrays)
            log.info("FD-CNN classifier trained on %d training images of %s: held-out accuracy %.4f (cached in %s)",
                     len(x), target.name, acc, path)
        except OSError as exc:  # a cache: a data.root this machine reads but cannot write (a read-only copy of the
            # data, a folder of the machine the run trained on) failed the evaluation after the classifier was trained
            log.warning("FD-CNN classifier trained on %d training images of %s: held-out accuracy %.4f, not cached (%s "
                        "cannot be written: %s); the next evaluation trains it again (seeded: the same network); a "
                        "writable data.root keeps it", len(x), target.name, acc, path.parent,
                        exc.strerror or type(exc).__name__)
    net.eval().requires_grad_(False)
    return net, acc


@torch.no_grad()
def features(net: DigitCNN, x) -> np.ndarray:
    """(N, 64) float64 features of images in [-1, 1] (tensor or uint8 array), in chunks of 1000."""
    if isinstance(x, torch.Tensor) and x.dtype == torch.uint8:  # a uint8 tensor of pixels, as a uint8 array
        x = x.cpu().numpy()
    x = _unit(x) if isinstance(x, np.ndarray) and x.dtype == np.uint8 else torch.as_tensor(x).float().cpu()
    return torch.cat([net.features(c.clamp(-1, 1)) for c in x.split(1000)]).double().numpy()


def gaussian(feats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and (unbiased, N-1) covariance of (N, d) features, as FID computes them."""
    return feats.mean(0), np.atleast_2d(np.cov(feats, rowvar=False))


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    """||mu1 - mu2||^2 + tr(S1 + S2 - 2 (S1 S2)^1/2), the Fréchet (2-Wasserstein) distance between two
    Gaussians. tr (S1 S2)^1/2 = sum of sqrt(eigenvalues of S1^1/2 S2 S1^1/2), a symmetric PSD matrix, by two
    ``eigh``: exact where ``scipy.linalg.sqrtm`` of the non-symmetric S1 S2 warns and needs a diagonal offset
    (feature covariances are singular when a feature is constant, e.g. a ReLU that never fires)."""
    mu1, mu2, sigma1, sigma2 = (np.atleast_1d(np.asarray(a, np.float64)) for a in (mu1, mu2, sigma1, sigma2))
    sigma1, sigma2 = np.atleast_2d(sigma1), np.atleast_2d(sigma2)
    w, v = np.linalg.eigh((sigma1 + sigma1.T) / 2)
    root1 = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    inner = root1 @ sigma2 @ root1
    tr_covmean = np.sqrt(np.clip(np.linalg.eigvalsh((inner + inner.T) / 2), 0, None)).sum()
    diff = mu1 - mu2
    return float(max(0.0, diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2 * tr_covmean))


def fd(feats_a: np.ndarray, feats_b: np.ndarray) -> float:
    """FD between two feature sets."""
    return frechet_distance(*gaussian(feats_a), *gaussian(feats_b))
