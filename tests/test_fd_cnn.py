"""FD-CNN (sinkflow.eval.fd_cnn): the Fréchet formula against direct numpy computations, its classifier cache
(arrays only, keyed on the data), and the Inception-FID path through a tiny network of the same interface."""

import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sinkflow.errors import SinkflowError
from sinkflow.eval import fd_cnn


def direct_fd(a: np.ndarray, b: np.ndarray) -> float:
    """The Fréchet distance by an eigen-decomposition: tr (S1 S2)^1/2 = sum sqrt(eig(S1^1/2 S2 S1^1/2))."""
    m1, m2 = a.mean(0), b.mean(0)
    s1, s2 = np.atleast_2d(np.cov(a, rowvar=False)), np.atleast_2d(np.cov(b, rowvar=False))
    w, v = np.linalg.eigh(s1)
    root = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    cross = np.linalg.eigvalsh(root @ s2 @ root)
    return float(((m1 - m2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.sqrt(np.clip(cross, 0, None)).sum())


def test_frechet_distance_is_zero_for_identical_sets():
    a = np.random.default_rng(0).normal(size=(200, 8))
    assert fd_cnn.fd(a, a) == pytest.approx(0.0, abs=1e-8)
    assert fd_cnn.fd(a, a + 0.5) == pytest.approx(8 * 0.25, rel=1e-6)  # a shift costs exactly |shift|^2


def test_frechet_distance_matches_a_direct_numpy_computation():
    rng = np.random.default_rng(1)
    for d in (1, 3, 6):
        mix = rng.normal(size=(d, d))
        a = rng.normal(size=(300, d)) @ mix + 1.0
        b = rng.normal(size=(250, d)) * rng.uniform(0.5, 2, size=d)
        assert fd_cnn.fd(a, b) == pytest.approx(direct_fd(a, b), rel=1e-6, abs=1e-8)
    # closed forms: 1-d Gaussians (m1 - m2)^2 + (s1 - s2)^2; diagonal covariances sum (sqrt(a) - sqrt(b))^2
    assert fd_cnn.frechet_distance([1.0], [[4.0]], [3.0], [[9.0]]) == pytest.approx(4 + 1)
    assert fd_cnn.frechet_distance(np.zeros(2), np.diag([1.0, 4.0]), np.zeros(2), np.diag([9.0, 1.0])) == pytest.approx(4 + 1)


def test_frechet_distance_agrees_with_scipy_sqrtm_and_is_silent_on_singular_covariances():
    """The usual FID formula (scipy.linalg.sqrtm of S1 S2) on full-rank sets; on sets with a constant feature
    (a dead ReLU: singular covariance, where sqrtm warns) no warning and the same value as without the feature."""
    import warnings

    from scipy import linalg

    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(400, 5)) @ rng.normal(size=(5, 5)), rng.normal(size=(300, 5)) + 0.3
    (m1, s1), (m2, s2) = fd_cnn.gaussian(a), fd_cnn.gaussian(b)
    scipy_fd = ((m1 - m2) ** 2).sum() + np.trace(s1 + s2) - 2 * np.trace(np.real(linalg.sqrtm(s1 @ s2)))
    assert fd_cnn.fd(a, b) == pytest.approx(scipy_fd, rel=1e-8)
    dead_a, dead_b = np.hstack([a, np.zeros((400, 2))]), np.hstack([b, np.zeros((300, 2))])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fd_cnn.fd(dead_a, dead_b) == pytest.approx(fd_cnn.fd(a, b), rel=1e-8)


def toy_target(seed=0, n=1024, n_test=60):
    """A labelled 8x8 'digit' set the CNN can learn: class c lights row c of the image."""
    rng = np.random.default_rng(seed)

    def make(k):
        y = rng.integers(0, 8, size=k)
        x = rng.integers(0, 60, size=(k, 1, 8, 8)).astype(np.uint8)
        x[np.arange(k), 0, y, :] = 255
        return x, y

    (x, y), (xt, yt) = make(n), make(n_test)
    return SimpleNamespace(name="toy", shape=(1, 8, 8), images=x, labels=y, test_images=xt, test_labels=yt)


def test_classifier_cache_is_arrays_only_and_rebuilt_when_the_data_changes(tmp_path, monkeypatch):
    target = toy_target()
    net, acc = fd_cnn.train_cnn(target, tmp_path)
    assert acc > 0.5  # the held-out accuracy it reports is real (chance: 1/8)
    (cache,) = (tmp_path / "cache").glob("fdcnn-toy-*.npz")
    with np.load(cache, allow_pickle=False) as z:  # plain arrays: loads with pickles refused
        assert all(z[k].dtype != object for k in z.files) and "accuracy" in z.files
    feats = fd_cnn.features(net, target.test_images)
    assert feats.shape == (60, fd_cnn.FEATURES)

    trained = []
    real_adam = torch.optim.Adam
    monkeypatch.setattr(torch.optim, "Adam", lambda *a, **k: trained.append(1) or real_adam(*a, **k))
    again, acc2 = fd_cnn.train_cnn(target, tmp_path)  # same data: read back, not retrained
    assert not trained and acc2 == acc
    np.testing.assert_array_equal(fd_cnn.features(again, target.test_images), feats)

    changed = toy_target()
    changed.images = changed.images.copy()
    changed.images[0, 0, 0, 0] ^= 1  # one pixel of one training digit
    fd_cnn.train_cnn(changed, tmp_path)
    assert trained and len(list((tmp_path / "cache").glob("fdcnn-toy-*.npz"))) == 2  # a new key, a new network

    marker = tmp_path / "pwned"
    cache.write_bytes(pickle.dumps(_Planted(marker)))  # a planted pickle under the cache's name is never unpickled
    _, acc3 = fd_cnn.train_cnn(target, tmp_path)
    assert not marker.exists() and acc3 == acc  # retrained (seeded: the same network) and rewritten
    with np.load(cache, allow_pickle=False) as z:
        assert "accuracy" in z.files


class _Planted:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class TinyExtractor(torch.nn.Module):
    """torchmetrics' custom feature-extractor interface, as the Inception network: (N, 3, H, W) floats in
    [0, 1] -> (N, d) features, ``num_features`` = d."""

    num_features = 4

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3 * 4, 4)
        torch.nn.init.orthogonal_(self.proj.weight)

    def forward(self, x):
        return self.proj(torch.nn.functional.adaptive_avg_pool2d(x.float(), 2).flatten(1))


def test_inception_fid_path_with_a_tiny_network_of_the_same_interface():
    pytest.importorskip("torchmetrics")
    from sinkflow.eval.images import fid

    torch.manual_seed(0)
    net = TinyExtractor()
    real = torch.rand(64, 1, 8, 8) * 2 - 1
    fake = (torch.rand(64, 1, 8, 8) * 1.5 - 0.9).clamp(-1, 1)
    with torch.no_grad():
        feats = lambda x: net(((x + 1) / 2).expand(-1, 3, -1, -1)).double().numpy()  # noqa: E731
        want = direct_fd(feats(fake), feats(real))
    assert fid(fake, real, None, extractor=net) == pytest.approx(want, rel=1e-4)
    assert fid(real, real, None, extractor=net) == pytest.approx(0.0, abs=1e-6)


def test_one_fid_reference_scores_each_generated_set_alone():
    """InceptionFID keeps the real features and drops the previous generated set's: scoring a sequence of sets
    against one reference gives each set's one-off FID (sinkflow tune scores every candidate so)."""
    pytest.importorskip("torchmetrics")
    from sinkflow.eval.images import InceptionFID, fid

    torch.manual_seed(1)
    net = TinyExtractor()
    real = torch.rand(64, 1, 8, 8) * 2 - 1
    sets = [(torch.rand(64, 1, 8, 8) * s - 0.9).clamp(-1, 1) for s in (0.5, 1.5, 1.0)]
    ref = InceptionFID(real, None, extractor=net)
    got = [ref(x) for x in sets]
    assert got == pytest.approx([fid(x, real, None, extractor=net) for x in sets], rel=1e-6)
    assert len({round(g, 6) for g in got}) == 3
    assert ref(real) == pytest.approx(0.0, abs=1e-6)


def test_features_read_uint8_pixels_alike_as_array_or_tensor():
    """uint8 pixels were scaled to [-1, 1] only as a numpy array: a uint8 tensor went in as 0..255 (FD of a test
    set against itself, passed so, was 141.6)."""
    net = fd_cnn.DigitCNN((1, 8, 8))
    pixels = np.random.default_rng(0).integers(0, 256, size=(16, 1, 8, 8)).astype(np.uint8)
    as_array = fd_cnn.features(net, pixels)
    np.testing.assert_array_equal(fd_cnn.features(net, torch.from_numpy(pixels)), as_array)
    np.testing.assert_allclose(fd_cnn.features(net, torch.from_numpy(pixels / 127.5 - 1).float()), as_array, atol=1e-5)


def test_a_small_training_set_still_gets_min_steps_of_adam(tmp_path, monkeypatch):
    """8 epochs of sklearn's 1,438 digits were 96 Adam steps (held-out accuracy 0.79): the classifier now trains
    for at least MIN_STEPS steps whatever the set's size, and MNIST's 8,000 t10k training digits keep 8 epochs."""
    assert fd_cnn.epochs_for(8000) == fd_cnn.EPOCHS  # 63 batches x 8 = 504 steps: the MNIST scorer is unchanged
    assert fd_cnn.epochs_for(1438) * -(-1438 // fd_cnn.BATCH) >= fd_cnn.MIN_STEPS
    steps = []
    real_step = torch.optim.Adam.step
    monkeypatch.setattr(torch.optim.Adam, "step", lambda self, *a, **k: steps.append(1) or real_step(self, *a, **k))
    target = toy_target(n=300)  # 3 batches an epoch: 8 epochs would be 24 steps
    fd_cnn.train_cnn(target, tmp_path)
    assert fd_cnn.MIN_STEPS <= len(steps) < fd_cnn.MIN_STEPS + 3
    (cache,) = (tmp_path / "cache").glob("fdcnn-toy-*.npz")
    assert fd_cnn.TRAINING in cache.name  # a network cached under the old 8-epoch rule is not read back


class RecordedFID:
    """Stands in for torchmetrics' FrechetInceptionDistance with Inception (``feature=2048``): records the uint8
    pixels its Inception would read, by torchmetrics' own input rule (``normalize=True``: floats in [0, 1] as
    ``(x * 255).byte()``; else the uint8 images as given)."""

    seen: list = []

    def __init__(self, feature, normalize=False, reset_real_features=True, feature_extractor_weights_path=None):
        self.normalize = normalize

    def update(self, imgs, real):
        RecordedFID.seen.append(((imgs * 255).byte() if self.normalize else imgs, real))

    def reset(self):
        pass

    def compute(self):
        return torch.tensor(0.0)


def test_inception_reads_the_pixels_of_the_png_folder(tmp_path, monkeypatch):
    """Inception's input is the images' uint8 pixels rounded as `sinkflow sample --out DIR/` writes them (what
    clean-fid / torch-fidelity read): torchmetrics' normalize=True truncated float pixels, so 47 of 256 real levels
    (k / 255 in float32 just below k) reached Inception as k - 1 and generated pixels were floored, not rounded."""
    tm = pytest.importorskip("torchmetrics.image.fid")
    from sinkflow.data.images import to_unit_range
    from sinkflow.eval.images import InceptionFID, to_uint8

    monkeypatch.setattr(tm, "FrechetInceptionDistance", RecordedFID)
    RecordedFID.seen = []
    weights = tmp_path / "pt_inception.pth"
    weights.write_bytes(b"")  # a file must be there; the stand-in never reads it
    levels = torch.arange(256, dtype=torch.uint8).reshape(4, 1, 8, 8)
    fid = InceptionFID(to_unit_range(levels), str(weights))
    generated = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    fid(generated)
    (real, is_real), (fake, is_fake) = RecordedFID.seen
    assert is_real and not is_fake and real.dtype == fake.dtype == torch.uint8 and real.shape == (4, 3, 8, 8)
    assert torch.equal(real[:, :1], levels)  # every level as itself
    assert torch.equal(fake[:, :1].permute(0, 2, 3, 1), torch.from_numpy(to_uint8(generated)))  # as its PNG


def test_fid_without_torch_fidelity_is_one_line(tmp_path, monkeypatch):
    """torchmetrics installed without torch-fidelity imports, then its FrechetInceptionDistance(feature=2048) raises a
    raw ModuleNotFoundError: the evaluation said so in a traceback."""
    tm = pytest.importorskip("torchmetrics.image.fid")
    from sinkflow.eval.images import InceptionFID

    def missing(*args, **kwargs):
        raise ModuleNotFoundError("FrechetInceptionDistance metric requires that `Torch-fidelity` is installed.")

    monkeypatch.setattr(tm, "FrechetInceptionDistance", missing)
    weights = tmp_path / "pt_inception.pth"
    weights.write_bytes(b"")
    with pytest.raises(SinkflowError, match="FID needs torch-fidelity.*pip install torchmetrics torch-fidelity"):
        InceptionFID(torch.zeros(2, 1, 8, 8), str(weights))


def test_fid_weights_that_are_not_the_fid_inception_are_one_line(tmp_path, monkeypatch):
    """torch-fidelity loads eval.inception_weights strictly: torchvision's ImageNet Inception-v3 (AuxLogits, 1000
    classes) or a file that is not a state dict raised a multi-line RuntimeError / UnpicklingError traceback."""
    import pickle

    tm = pytest.importorskip("torchmetrics.image.fid")
    from sinkflow.eval.images import InceptionFID

    weights = tmp_path / "inception_v3_google.pth"
    weights.write_bytes(b"")
    for exc in (RuntimeError('Error(s) in loading state_dict for FeatureExtractorInceptionV3:\n\tUnexpected key(s) '
                             'in state_dict: "AuxLogits.conv0.conv.weight"'),
                pickle.UnpicklingError("invalid load key, 'x'.")):
        def wrong(*args, exc=exc, **kwargs):
            raise exc

        monkeypatch.setattr(tm, "FrechetInceptionDistance", wrong)
        with pytest.raises(SinkflowError, match="is not the FID Inception-v3 weights") as info:
            InceptionFID(torch.zeros(2, 1, 8, 8), str(weights))
        assert "\n" not in str(info.value) and str(exc).splitlines()[0] in str(info.value)


def test_classifiers_trained_where_their_cache_cannot_be_written_still_score(tmp_path, caplog):
    """The FD-CNN and the digit classifier are cached under the run's data.root; a data.root this machine reads but
    cannot write (a read-only copy of the data, a folder of the machine the run trained on) failed the evaluation
    after the classifier had been trained (ENOTDIR / EACCES from the cache's write). The cache is a cache: the
    classifier scores, a warning says it was not kept. (A file where the cache folder goes: mkdir fails as in a
    read-only folder, for root too.)"""
    import logging

    from sinkflow.eval.images import digit_classifier

    (tmp_path / "cache").write_text("")
    target = toy_target(n=300)
    with caplog.at_level(logging.WARNING):
        net, acc = fd_cnn.train_cnn(target, tmp_path)
        clf = digit_classifier(SimpleNamespace(**{**vars(target), "name": "digits"}), tmp_path)
    assert acc > 0.5 and fd_cnn.features(net, target.test_images).shape == (60, fd_cnn.FEATURES)
    assert clf is not None and clf.predict(target.test_images.reshape(60, -1)).shape == (60,)
    said = [r.getMessage() for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(said) == 2 and "not cached" in said[0] and "not cached" in said[1], said
