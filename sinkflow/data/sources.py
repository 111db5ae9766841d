"""Image sources: where the pixels come from (sklearn digits, torchvision MNIST / CIFAR-10, a folder).

Each source decodes a split *once* into the cache of ``sinkflow.data.cache``; on a cache hit nothing
here is called beyond the cheap file fingerprint. ``DECODES`` counts real decodes (tests use it).
"""

from __future__ import annotations

import collections
import errno
import gzip
import hashlib
import logging
import os
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from sinkflow.data.atomic_write import atomic_path
from sinkflow.data.base import warn_once
from sinkflow.errors import DataNotFound, SinkflowError

log = logging.getLogger(__name__)
DECODES: collections.Counter = collections.Counter()
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
# images of kinds a folder does not read (animations, TIFF's float and multi-page modes...): said, not skipped in silence
OTHER_IMAGE_EXTENSIONS = (".gif", ".tif", ".tiff", ".heic", ".heif", ".avif", ".jp2", ".ppm", ".pgm", ".pbm", ".tga")
# JPEGs under other names (a browser's "Save image as" writes .jfif): left out, since a run's recorded file list must
# not change under it, but said with the fix, a rename (they were left out in silence, a class of downloads gone)
JPEG_ALIASES = (".jfif", ".jpe", ".pjpeg", ".pjp")


def fit_image(img: Image.Image, channels: int, image_size: int | None) -> np.ndarray:
    """PIL image -> uint8 (C, H, W): convert to L/RGB, resize the shorter side, center-crop to a square.

    16-bit ("I;16*") and 32-bit integer ("I") images are brought to 8 bits by their high byte first: PIL's own
    convert clips every sample above 255, so a 16-bit PNG came out nearly white. "I" holds 16-bit samples when
    they all lie in 0..65535 (a 16-bit grayscale PNG in Pillow before "I;16"), 8-bit ones when all lie in 0..255,
    else the int32 range."""
    if img.mode.startswith("I;16"):
        img = Image.fromarray((np.asarray(img).astype(np.uint16) >> 8).astype(np.uint8), "L")
    elif img.mode == "I":
        a = np.asarray(img)
        top = int(a.max()) if a.size else 0
        bits = 8 if top <= 0xFF else 16 if top <= 0xFFFF else 31
        img = Image.fromarray((np.clip(a, 0, None) >> (bits - 8)).astype(np.uint8), "L")
    img = over_white(img).convert("L" if channels == 1 else "RGB")
    if image_size is not None and img.size != (image_size, image_size):
        w, h = img.size
        scale = image_size / min(w, h)
        nw, nh = max(image_size, round(w * scale)), max(image_size, round(h * scale))
        img = img.resize((nw, nh), Image.Resampling.BICUBIC, reducing_gap=None)
        left, top = (nw - image_size) // 2, (nh - image_size) // 2
        img = img.crop((left, top, left + image_size, top + image_size))
    a = np.asarray(img, dtype=np.uint8)
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


def over_white(img: Image.Image) -> Image.Image:
    """A transparent image composited over white, as a viewer on a page shows it: ``convert`` dropped the alpha, so a
    sprite or logo's transparent pixels came out as whatever colour they stored (often black, often noise), and a
    palette image with transparency also printed PIL's raw UserWarning. Images without transparency pass as they are."""
    if img.mode not in ("RGBA", "LA", "PA", "RGBa", "La") and "transparency" not in img.info:
        return img
    rgba = img.convert("RGBA")  # palette / L / RGB with a transparent colour: PIL's own way to an alpha band
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)


# EXIF orientation (tag 0x0112) -> the transpose a viewer applies to the stored pixels
UPRIGHT = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
           5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
           8: Image.Transpose.ROTATE_90}


def orientation(img: Image.Image) -> int:
    """The EXIF orientation of an opened image's header, 1 (as stored) where it holds none or a broken one. Only the
    header's block is read: a PNG's ``getexif()`` without one decodes the whole image to look past its pixels. A value
    outside 1-8 (0, 9: written by some cameras) turns nothing (``UPRIGHT``); the size check took 9 for a quarter turn
    and a native-size folder stopped on numpy's "could not broadcast" traceback."""
    if "exif" not in img.info:
        return 1
    try:
        return int(img.getexif().get(0x0112, 1))
    except Exception:  # a broken EXIF block leaves the pixels as they are stored
        return 1


def upright(img: Image.Image, turn: int) -> Image.Image:
    """``img`` as a viewer shows it, for its ``orientation`` ``turn``: a phone photo is stored sideways with an EXIF
    tag saying how to turn it, and was trained on sideways (orientations 5-8 also swap width and height)."""
    method = UPRIGHT.get(turn)
    return img if method is None else img.transpose(method)


def size_tag(h: int, w: int) -> str:
    return str(h) if h == w else f"{h}x{w}"


def _file_stats(paths, stats=None) -> str:
    """A hash of the files' names, sizes, mtimes and ctimes (``stats``: their ``os.stat`` results where the caller has
    them): the decoded cache's key. The ctime because an mtime can be set back: a file replaced by one of the same
    size with its mtime kept (``cp -p``, ``rsync -a``, an unzip) kept the old pixels; no call sets a ctime, a write or
    a rename moves it. The price: a folder copied or ``chmod``-ed is decoded once more. Names are hashed as their bytes
    on disk (``os.fsencode``: the UTF-8 of every name that is UTF-8): a name that is not (``caf\\xe9.png`` from a zip
    made on Windows) was a UnicodeEncodeError traceback."""
    h = hashlib.sha1()
    for p, st in zip(paths, stats or map(os.stat, paths)):
        h.update(os.fsencode(f"{os.path.basename(p)}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns};"))
    return h.hexdigest()


def _unlistable(error: OSError):
    """``os.walk``'s onerror: it skipped a subfolder it cannot list (no read permission) in silence, and a class
    of images was left out of the set without a word."""
    raise SinkflowError(f"image folder {error.filename} cannot be listed ({error.strerror or error})",
                        "check its permissions, or move it out of data.path")


def files_under(folder: Path, dangling: list | None = None):
    """Every file under ``folder``, following linked subfolders (a data set assembled from class folders linked
    into one tree: ``Path.rglob`` skipped them in silence); a link back to a folder already walked is not
    walked again. A subfolder that cannot be listed is an error (``_unlistable``). Links that point nowhere (to a
    drive not mounted, a folder moved) are appended to ``dangling``."""
    seen = set()
    for root, dirs, files in os.walk(folder, followlinks=True, onerror=_unlistable):
        real = os.path.realpath(root)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs.sort()
        for name in files:
            path = Path(root) / name
            if path.is_file():
                yield path
            elif dangling is not None and path.is_symlink() and not path.exists():
                dangling.append(path)


def _may_hold_images(link: Path) -> bool:
    """Whether a link that points nowhere could have been images of the set: one named as an image, or as a folder
    (no extension, or one no file type has: ``class.1``). A dangling ``notes.txt`` or ``labels.csv`` would never have
    been read; it refused a folder of images as if it were a class folder gone."""
    suffix = link.suffix.lower()
    return (suffix in IMAGE_EXTENSIONS or suffix in OTHER_IMAGE_EXTENSIONS or suffix in JPEG_ALIASES
            or not re.fullmatch(r"\.[a-z][a-z0-9]{0,4}", suffix))


class ArraySource:
    """A labelled set that torchvision/sklearn hands over as one uint8 array per split."""

    name = ""
    native_chw: tuple[int, int, int] = (1, 1, 1)

    def __init__(self, root: str, channels: int | None, image_size: int | None, download: bool):
        self.root, self.download = root, download
        self.channels = channels or self.native_chw[0]
        self.image_size = image_size
        side = image_size or self.native_chw[1]
        self.chw = (self.channels, side, image_size or self.native_chw[2])
        self.size = size_tag(*self.chw[1:])

    def prepare(self) -> None:
        """Check (or fetch) the files; raise a SinkflowError naming the folder and the fix."""

    def online_fix(self) -> str:
        """The end of a missing-files fix: how the download could help (it was on and failed, or it was off)."""
        return (" or run once on a machine with internet (data.download=true, as here, fetches them)" if self.download
                else " or set data.download=true on a machine with internet")

    def _fetch(self, label: str, folder: Path, missing: list[str], how: str, download) -> None:
        """Files are ``missing`` from ``folder``: refuse unless data.download, else call ``download()``; either
        way a failure is one SinkflowError naming the folder, with ``how`` as the fix."""
        if not self.download:  # none of its files here: not on this machine; some: a damaged copy
            absent = not folder.is_dir() or not any(folder.iterdir())
            raise (DataNotFound if absent else SinkflowError)(
                f"{label} not found in {folder} (missing {', '.join(missing)}) and data.download is false", how)
        made = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
        try:
            download()
        except Exception as e:  # offline, mirror down, bad checksum: all end the same way for the user
            for p in made:  # the folders the failed download made, where it left nothing (torchvision makes them first)
                try:
                    p.rmdir()
                except OSError:  # not empty (a partial file stays for the user to see), or gone
                    break
            raise SinkflowError(f"{label} download into {folder} failed ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''})", how) from None

    def fingerprint(self, split: str) -> str:
        raise NotImplementedError

    def load(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """uint8 images (N, H, W) or (N, H, W, C) and int labels (N,)."""
        raise NotImplementedError

    def count(self, split: str) -> int | None:
        return None

    def decode_into(self, split: str, write):
        arr, labels = self.load(split)
        DECODES[self.name] += 1
        if arr.ndim == 3:
            arr = arr[..., None]
        n = len(arr)
        native = arr.shape[-1] == self.channels and self.image_size in (None, arr.shape[1]) and arr.shape[1] == arr.shape[2]

        def fill(out):
            if native:
                out[:] = arr.transpose(0, 3, 1, 2)
            else:
                for i in range(n):
                    a = arr[i, :, :, 0] if arr.shape[-1] == 1 else arr[i]
                    out[i] = fit_image(Image.fromarray(a), self.channels, self.image_size)
            return labels

        return write((n, *self.chw), fill)


class DigitsSource(ArraySource):
    """scikit-learn's bundled 8x8 digits (1797 images, values 0..16 scaled to 0..255).

    Held-out split: the last 20% (rounded) of each class in file order, so both splits are stratified.
    """

    name = "digits"
    native_chw = (1, 8, 8)
    TEST_FRACTION = 0.2

    def fingerprint(self, split):
        import sklearn

        return f"sklearn-digits:{sklearn.__version__}:last20pct-per-class"

    @classmethod
    def split_indices(cls, labels: np.ndarray, split: str) -> np.ndarray:
        test = []
        for c in np.unique(labels):
            idx = np.flatnonzero(labels == c)
            k = int(round(cls.TEST_FRACTION * len(idx)))
            test.extend(idx[len(idx) - k:])
        mask = np.zeros(len(labels), bool)
        mask[test] = True
        return np.flatnonzero(mask if split == "test" else ~mask)

    def load(self, split):
        from sklearn.datasets import load_digits

        d = load_digits()
        images = np.clip(np.rint(d.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
        idx = self.split_indices(d.target, split)
        return images[idx], d.target[idx].astype(np.int64)


T10K_SPLIT_SEED = 20261125  # fixed: the t10k-only split depends on nothing but the file's 10,000 digits
T10K_TEST = 2000  # held-out digits of the t10k-only split; the other 8,000 train


def t10k_split_indices(n: int, split: str) -> np.ndarray:
    """Sorted indices into MNIST's t10k file for the ``split`` ("train" or "test") of the t10k-only layout: a
    permutation seeded with ``T10K_SPLIT_SEED``; its first ``T10K_TEST`` digits are the test split, the rest
    train. Disjoint, together they cover the file; the same on every machine (numpy's PCG64 stream is fixed)."""
    if n <= T10K_TEST:
        raise SinkflowError(f"MNIST t10k file has {n} digits; the t10k-only split needs more than {T10K_TEST}",
                            "place the original t10k files (10,000 digits)")
    perm = np.random.Generator(np.random.PCG64(T10K_SPLIT_SEED)).permutation(n)
    return np.sort(perm[:T10K_TEST] if split == "test" else perm[T10K_TEST:])


def indices_sha256(idx) -> str:
    return hashlib.sha256(np.asarray(idx, dtype="<i8").tobytes()).hexdigest()


class MNISTSource(ArraySource):
    """torchvision MNIST under ``<root>/MNIST/raw``; ``.gz`` files placed there are unpacked first.

    Two layouts, one loader: the official one (train-* and t10k-* files: 60,000 train / 10,000 test digits),
    and t10k-only (just the two t10k-* files, e.g. when only the test set can be had): then the 10,000 digits
    are split once, by ``t10k_split_indices``, into 8,000 train and 2,000 test digits, and a warning says so.
    ``split_info()`` describes the layout (seed and index hashes for t10k-only); training records it in the run
    folder (data_split.json).
    """

    name = "mnist"
    native_chw = (1, 28, 28)
    FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}

    @property
    def raw(self) -> Path:
        return Path(self.root) / "MNIST" / "raw"

    def _missing(self, splits=("train", "test")) -> list[str]:
        return [f for s in splits for f in self.FILES[s] if not (self.raw / f).is_file()]

    def _has(self, split: str) -> bool:
        return all((self.raw / f).is_file() or (self.raw / f"{f}.gz").is_file() for f in self.FILES[split])

    @property
    def t10k_only(self) -> bool:
        """Only the test files are there (unpacked or .gz): serve the fixed 8,000 / 2,000 split of them."""
        return self._has("test") and not self._has("train")

    def prepare(self):
        for f in self._missing():
            gz = self.raw / f"{f}.gz"
            if gz.is_file():  # the files as distributed; torchvision reads them unpacked
                with atomic_path(self.raw / f) as tmp:
                    try:
                        with gzip.open(gz, "rb") as src, open(tmp, "wb") as dst:
                            shutil.copyfileobj(src, dst)
                    except (OSError, EOFError) as e:
                        raise SinkflowError(f"MNIST file {gz} is not a valid gzip file ({e})",
                                            "delete it and place the original file there") from None
        if self.t10k_only:
            warn_once(log, self.raw, "MNIST: only the t10k files are in %s; training on a fixed split of them (%d "
                      "train / %d test digits, seed %d); place the train-* files there for the official 60k/10k split",
                      self.raw, 10000 - T10K_TEST, T10K_TEST, T10K_SPLIT_SEED)
            return
        missing = self._missing()
        if not missing:
            return
        how = (f"place {', '.join(f for pair in self.FILES.values() for f in pair)} (or their .gz) in {self.raw}, "
               f"or the two t10k-* files alone (a fixed {10000 - T10K_TEST:,} / {T10K_TEST:,} split of their digits),"
               + self.online_fix())
        from torchvision.datasets import MNIST

        self._fetch("MNIST", self.raw, missing, how, lambda: MNIST(self.root, train=True, download=True))

    def fingerprint(self, split):
        if self.t10k_only:
            return (f"mnist-t10k-split:{T10K_SPLIT_SEED}:{T10K_TEST}:"
                    + _file_stats([self.raw / f for f in self.FILES["test"]]))
        return "mnist-idx:" + _file_stats([self.raw / f for f in self.FILES[split]])

    def split_info(self) -> dict:
        """What a run trained on: the layout, and for t10k-only the split's seed, sizes and index hashes."""
        if not self.t10k_only:
            return {"set": "mnist", "layout": "official", "train_file": self.FILES["train"][0],
                    "test_file": self.FILES["test"][0]}
        n = self._read(False)[0].shape[0]
        train, test = t10k_split_indices(n, "train"), t10k_split_indices(n, "test")
        return {"set": "mnist", "layout": "t10k-only", "file": self.FILES["test"][0], "seed": T10K_SPLIT_SEED,
                "rule": "numpy PCG64(seed).permutation(n): the first n_test indices are the test split, sorted",
                "n_train": len(train), "n_test": len(test), "train_indices_sha256": indices_sha256(train),
                "test_indices_sha256": indices_sha256(test)}

    def _read(self, train: bool) -> tuple[np.ndarray, np.ndarray]:
        """The IDX files of one official split, by torchvision's MNIST readers (the class itself insists on all
        four files, which the t10k-only layout lacks)."""
        from torchvision.datasets.mnist import read_image_file, read_label_file

        images, labels = self.FILES["train" if train else "test"]
        try:
            data, targets = read_image_file(str(self.raw / images)), read_label_file(str(self.raw / labels))
        except Exception as e:
            raise SinkflowError(f"MNIST files in {self.raw} cannot be read ({type(e).__name__}: {e})",
                                "replace them with the original IDX files") from None
        if len(data) != len(targets):
            raise SinkflowError(f"MNIST files in {self.raw}: {images} has {len(data)} digits, {labels} {len(targets)}",
                                "replace them with the original IDX files")
        return data.numpy(), targets.numpy().astype(np.int64)

    def load(self, split):
        if self.t10k_only:
            images, labels = self._read(False)
            idx = t10k_split_indices(len(images), split)
            return images[idx], labels[idx]
        return self._read(split == "train")


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, strings, numbers and numpy arrays only: any other global (a function that
    a crafted file would call) is refused, so reading a CIFAR-10 batch can never run code."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a CIFAR-10 batch file")


def _str_keys(entry):
    """A batch's dict with str keys. The official (Python 2) files unpickle with str keys; a copy re-pickled after
    CIFAR-10's own Python 3 recipe, ``pickle.load(fh, encoding="bytes")``, has bytes keys (b"data", b"labels") and
    was refused as "KeyError: 'data'"."""
    if not isinstance(entry, dict):
        return entry
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in entry.items()}


def read_cifar10_batches(folder: Path, files: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The CIFAR-10 python batches (N, 32, 32, 3) uint8 and labels, read with ``_ArrayUnpickler``."""
    datas, labels = [], []
    for name in files:
        with open(Path(folder) / name, "rb") as fh:
            entry = _str_keys(_ArrayUnpickler(fh, encoding="latin1").load())
        data = np.asarray(entry["data"])
        batch_labels = entry["labels"] if "labels" in entry else entry["fine_labels"]
        fix = "replace it with the file of the official cifar-10-python.tar.gz"
        if data.dtype != np.uint8:  # float pixels in [0, 1] were cast to black images, values past 255 wrapped
            raise SinkflowError(f"CIFAR-10 file {Path(folder) / name} holds {data.dtype} pixels, not uint8 (0-255)",
                                fix)
        if data.shape[1:] not in ((3072,), (3, 32, 32)):  # (N, 32, 32, 3) images read as planes came out scrambled
            raise SinkflowError(f"CIFAR-10 file {Path(folder) / name} holds pixels of shape {data.shape}, not (N, 3072) "
                                "rows (the R, G and B planes of a 32x32 image, row by row)", fix)
        if len(batch_labels) != len(data):  # a traceback from the cache's own check, on every later run too
            raise SinkflowError(f"CIFAR-10 file {Path(folder) / name} holds {len(data)} images but "
                                f"{len(batch_labels)} labels", fix)
        datas.append(data.reshape(len(data), 3072))
        labels.extend(batch_labels)
    data = np.vstack(datas).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return data, np.asarray(labels, dtype=np.int64)


class CIFAR10Source(ArraySource):
    """torchvision CIFAR-10 under ``<root>/cifar-10-batches-py``.

    torchvision checks each pickle's md5 against the official archive before unpickling it. When the files
    are all present but differ (a subset, a re-pickled copy, the tiny files of the tests), they are read by
    ``read_cifar10_batches``, whose unpickler builds only numbers, strings, lists, dicts and numpy arrays
    (a crafted file cannot run code), and a warning says so.
    """

    name = "cifar10"
    native_chw = (3, 32, 32)
    FILES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}

    @property
    def folder(self) -> Path:
        return Path(self.root) / "cifar-10-batches-py"

    def _missing(self) -> list[str]:
        return [f for f in [*self.FILES["train"], *self.FILES["test"], "batches.meta"]
                if not (self.folder / f).is_file()]

    def prepare(self):
        missing = self._missing()
        if not missing:
            return
        how = (f"extract cifar-10-python.tar.gz so that {self.folder} holds data_batch_1..5, test_batch and "
               "batches.meta," + self.online_fix())
        from torchvision.datasets import CIFAR10

        self._fetch("CIFAR-10", self.folder, missing, how, lambda: CIFAR10(self.root, train=True, download=True))

    def fingerprint(self, split):
        return "cifar10-pickle:" + _file_stats([self.folder / f for f in [*self.FILES[split], "batches.meta"]])

    def load(self, split):
        from torchvision.datasets import CIFAR10

        try:
            try:
                ds = CIFAR10(self.root, train=split == "train", download=False)
            except RuntimeError:  # md5 mismatch with every file present (see class docstring)
                warn_once(log, self.folder, "CIFAR-10 files in %s do not match the official checksums; loading them "
                          "as they are (numbers and arrays only, never code)", self.folder)
                return read_cifar10_batches(self.folder, self.FILES[split])
        except SinkflowError:  # a batch's own problem, named with its file
            raise
        except Exception as e:  # torchvision's error names no file: the first one that does not read is named
            where, fix = f"CIFAR-10 files in {self.folder}", "replace them with the files"
            for name in self.FILES[split]:
                try:
                    read_cifar10_batches(self.folder, [name])
                except Exception:
                    where, fix = f"CIFAR-10 file {self.folder / name}", "replace it with the file"
                    break
            raise SinkflowError(f"{where} cannot be read ({type(e).__name__}: {e})",
                                f"{fix} of the official cifar-10-python.tar.gz") from None
        return np.asarray(ds.data, dtype=np.uint8), np.asarray(ds.targets, dtype=np.int64)


def _mac_metadata(path: Path) -> bool:
    """An AppleDouble file (``._name.png``, a ``__MACOSX/`` folder): what unzipping a macOS archive leaves beside
    each image. Named like an image but holding none, each stopped a run, one run each."""
    return path.name.startswith("._") or "__MACOSX" in path.parts


class FolderSource:
    """Every png/jpg/jpeg/bmp/webp under ``path`` (recursive), sorted by relative path.

    Test split (``holdout``): every tenth image in that order, the 10th, 20th, ... (the last one when there are
    fewer than 10), so a folder of class subfolders holds out a tenth of each class; ``last_tenth``, the rule
    before, held out the last tenth, which in the ImageFolder layout is the last class alone (a model scored on a
    class it never saw). Images are converted to RGB (``channels`` None or 3) or L (1), resized on the shorter side
    and center-cropped to ``image_size``; without ``image_size`` all images must share one size.
    """

    name = "folder"
    RULES = {"every_tenth": "image files sorted by relative path; every tenth (the 10th, 20th, ...; the last one "
                            "when fewer than 10) is in the test split",
             "last_tenth": "image files sorted by relative path; the last 10% (at least one) are the test split"}

    def __init__(self, path: str | None, channels: int | None, image_size: int | None,
                 holdout: str = "every_tenth"):
        if not path:
            raise DataNotFound("data.path is not set for the image folder", "set data.path=/path/to/images")
        self.holdout = holdout
        self.path = Path(path).expanduser()  # `data.path=~/imgs`: the shell leaves a ~ after `=` as it is
        if not self.path.is_dir():
            what = "is a file, not a folder" if self.path.exists() else "does not exist"
            fix = ("set data.path to a folder of images" if not self.path.is_absolute() else
                   "set data.path to a folder of images; for a run whose folder moved, name its new place once, "
                   "`sinkflow train --resume RUN data.path=NEW_PATH --no-report` (its files must match the hashes "
                   "in RUN/data_split.json), and eval reads it there")
            raise (SinkflowError if self.path.exists() else DataNotFound)(f"image folder {self.path} {what}", fix)
        self.channels = channels or 3
        self.image_size = image_size
        dangling = []
        found = list(files_under(self.path, dangling))
        self._refuse_dangling(dangling)
        images = [p for p in found if p.suffix.lower() in IMAGE_EXTENSIONS and not _mac_metadata(p)]
        hidden = [p for p in images if self._hidden(p)]
        self.files = sorted(set(images) - set(hidden), key=lambda p: p.relative_to(self.path).as_posix())
        self._say_left_out(found, hidden)
        stats = [os.stat(p) for p in self.files]  # one stat a file: the twin check and the fingerprint
        self._say_linked_twice(stats)
        if not self.files:
            others = len(found)
            raise SinkflowError(f"image folder {self.path} holds no images ({others} other files)",
                                f"put {'/'.join(e[1:] for e in IMAGE_EXTENSIONS)} files in it (subfolders are searched)")
        if len(self.files) < 2:
            raise SinkflowError(f"image folder {self.path} holds only 1 image; a train and a test split need 2",
                                "add more images")
        n = len(self.files)
        if holdout == "last_tenth":
            self._test = set(range(n - max(1, int(n * 0.1)), n))
        else:
            self._test = set(range(9, n, 10)) or {n - 1}
        self.n_test = len(self._test)
        if image_size is None:
            self.hw = self._common_size()
        else:
            self.hw = (image_size, image_size)
        self.chw = (self.channels, *self.hw)
        self.size = size_tag(*self.hw)
        digest = hashlib.sha1(os.fsencode(self.path.resolve())).hexdigest()[:8]
        safe = "".join(c if c.isalnum() or c in "_." else "_" for c in self.path.resolve().name) or "root"
        self.name = f"folder_{safe}_{digest}"
        self._fp = "folder:" + _file_stats(self.files, stats) + ":" + hashlib.sha1(os.fsencode(  # bytes: see _file_stats
            "\n".join(p.relative_to(self.path).as_posix() for p in self.files))).hexdigest()

    def _refuse_dangling(self, dangling: list[Path]) -> None:
        """Links under ``path`` that point nowhere (not hidden ones): a class folder or images linked in from a drive
        that is not mounted, or moved since, were left out in silence, and the run trained on the other classes
        (all of them dangling: "holds no images (0 other files)")."""
        dangling = sorted((p for p in dangling if _may_hold_images(p) and not self._hidden(p) and not _mac_metadata(p)),
                          key=lambda p: p.relative_to(self.path).as_posix())
        if dangling:
            first, n = dangling[0], len(dangling)
            raise SinkflowError(f"image folder {self.path} holds {n} link{'s' if n > 1 else ''} that point"
                                f"{'' if n > 1 else 's'} nowhere ({first.relative_to(self.path).as_posix()} -> "
                                f"{os.readlink(first)}{', ...' if n > 1 else ''})",
                                "mount or restore what they point to, or remove the links from data.path")

    def _say_linked_twice(self, stats: list[os.stat_result]) -> None:
        """Warn of images read twice: a link under ``path`` to an image already in the set (a linked folder already
        walked is not walked again: ``files_under``), a hard link too. Each copy is an image of the set, and the
        held-out tenth can hold one whose twin is trained on; said, not dropped, so that a run's recorded file list
        stays the same."""
        first: dict[tuple[int, int], Path] = {}
        twice = []
        for p, st in zip(self.files, stats):  # a stat, not a realpath (one a path part): symbolic and hard links alike
            real = (st.st_dev, st.st_ino)
            if not st.st_ino:  # no identity (os.stat_result: st_ino identifies a file "if non-zero"): some network
                continue       # and FAT drives give every file 0, and every image after the first read as a twin
            if real in first:
                twice.append((p, first[real]))
            else:
                first[real] = p
        if twice:
            p, q = (x.relative_to(self.path).as_posix() for x in twice[0])
            warn_once(log, self.path, "image folder %s: %d image(s) are read twice, through links (%s and %s are one "
                      "file%s): a twin can be trained on and held out; remove the links to count each image once",
                      self.path, len(twice), q, p, ", ..." if len(twice) > 1 else "")

    def _hidden(self, path: Path) -> bool:
        """A file whose name, or a folder's under ``path``, starts with a dot: a desktop's trash (``.Trash-1000/``), a
        thumbnail cache (``.thumbnails/``), a tool's checkpoints (``.ipynb_checkpoints/``) hold copies and previews of
        images, which were trained on as images of the set. Left out, as Hugging Face's imagefolder does."""
        return any(part.startswith(".") for part in path.relative_to(self.path).parts)

    def _say_left_out(self, found: list[Path], hidden: list[Path]) -> None:
        """Warn of images left out: of a kind the folder does not read (``OTHER_IMAGE_EXTENSIONS``: a folder of jpg
        and gif trained on its jpg alone without a word), and under hidden names (``_hidden``)."""
        for kinds, what, fix in ((OTHER_IMAGE_EXTENSIONS, "image(s) of a kind it does not read", "convert them to png"),
                                 (JPEG_ALIASES, "JPEG(s) under another extension", "rename them to .jpg")):
            left = collections.Counter(p.suffix.lower() for p in found
                                       if p.suffix.lower() in kinds and not _mac_metadata(p))
            if left:  # a message of its own each (warn_once says each message once)
                warn_once(log, self.path, f"image folder %s: %d {what} are left out (%s); {fix} to train on them",
                          self.path, sum(left.values()), ", ".join(f"{n} {ext}" for ext, n in left.most_common()))
        if hidden:
            warn_once(log, self.path, "image folder %s: %d image(s) under hidden names are left out (e.g. "
                      "%s); rename them without the leading dot to train on them", self.path, len(hidden),
                      hidden[0].relative_to(self.path).as_posix())

    def _open(self, p: Path) -> Image.Image:
        try:
            img = Image.open(p)
        except UnidentifiedImageError:
            raise SinkflowError(f"{p} is not an image file although it is named {p.suffix}",
                                "delete or rename it, or move it out of data.path") from None
        except Image.DecompressionBombError as e:  # PIL's guard, not an OSError: it was a traceback
            raise SinkflowError(f"image {p} is too large to decode ({e})", "downscale it (every image is resized to "
                                "data.image_size anyway) or remove it from data.path") from None
        except OSError as e:
            if e.errno == errno.ENOENT:  # listed, then gone: "corrupt or truncated" sent the user to a file not there
                raise SinkflowError(f"image {p} was removed after data.path was listed", "leave the folder unchanged "
                                    "while a run reads it, then run again") from None
            if e.errno in (errno.EACCES, errno.EPERM):
                raise SinkflowError(f"{p} cannot be read ({e.strerror})", "check the file's permissions or remove "
                                    "it") from None
            raise SinkflowError(f"image {p} is corrupt or truncated ({e})", "re-export it or remove it from "
                                "data.path") from None  # PIL's own errors carry no errno
        return img

    def _common_size(self) -> tuple[int, int]:
        first = None
        for p in self.files:  # headers only: cheap, and fails before any decoding
            with self._open(p) as img:
                size = img.size[::-1] if orientation(img) in (5, 6, 7, 8) else img.size  # as ``upright`` turns it
                if first is None:
                    first = (p, size)
                elif size != first[1]:
                    (w0, h0), (w1, h1) = first[1], size
                    a, b = (q.relative_to(self.path).as_posix() for q in (first[0], p))  # nested: names repeat
                    raise SinkflowError(f"images in {self.path} have different sizes ({a} is {w0}x{h0}, {b} is "
                                        f"{w1}x{h1})", "set data.image_size=N to resize and center-crop them all to NxN")
        w, h = first[1]
        return h, w

    def prepare(self):
        pass

    def split_files(self, split: str) -> list[Path]:
        return [p for i, p in enumerate(self.files) if (i in self._test) == (split == "test")]

    def split_info(self) -> dict:
        """What a run trained on (RUN/data_split.json): the folder, the split rule and, per split, a hash of its files'
        relative paths and sizes, so a file added, removed, renamed or replaced by one of another size is noticed
        before a resume trains or an evaluation scores on other images (the bytes themselves are not read here; one
        replaced by another of the same size is caught by the decoded pixels' hash, ``cache.cached_pixels_sha256``)."""
        def files_sha256(split: str) -> str:
            lines = (f"{p.relative_to(self.path).as_posix()}:{p.stat().st_size}" for p in self.split_files(split))
            return hashlib.sha256(os.fsencode("\n".join(lines))).hexdigest()  # names as bytes: see _file_stats

        return {"set": "folder", "path": str(self.path.resolve()),
                "rule": self.RULES[self.holdout],
                "train_files_sha256": files_sha256("train"), "test_files_sha256": files_sha256("test")}

    def fingerprint(self, split):  # "decode4": transparency over white ("decode3": EXIF orientation applied;
        # "decode2": 16-bit images scaled, not clipped)
        rule = "" if self.holdout == "last_tenth" else f":{self.holdout}"  # the caches of last_tenth runs stay valid
        return f"{self._fp}:{split}:{self.n_test}{rule}:decode4"

    def _decode(self, p: Path) -> np.ndarray:
        """One image as a uint8 (C, H, W) array, or a one-line SinkflowError naming the file."""
        with self._open(p) as img:
            turn = orientation(img)  # the header's, as _common_size read it
            try:
                img.load()
                return fit_image(upright(img, turn), self.channels, self.image_size)
            except (OSError, SyntaxError, ValueError) as e:
                raise SinkflowError(f"image {p} is corrupt or truncated ({e})",
                                    "re-export it or remove it from data.path") from None

    def decode_into(self, split: str, write):
        files = self.split_files(split)
        DECODES[self.name] += 1

        def fill(out):
            bad = []  # every unreadable file in one message: one a run, a run each, was the way to find them
            for i, p in enumerate(files):
                try:
                    out[i] = self._decode(p)
                except SinkflowError as exc:
                    bad.append((p, exc))
            if not bad:
                return None
            # the other split too: a broken file among the held-out tenth was found only by the next run, after the
            # train split's ones were fixed (the train split is decoded, and fails, first)
            checked = files
            if split == "train":
                other = self.split_files("test")
                checked = self.files
                for p in other:
                    try:
                        self._decode(p)
                    except SinkflowError as exc:
                        bad.append((p, exc))
                bad.sort(key=lambda b: b[0].relative_to(self.path).as_posix())
            if len(bad) == 1:
                raise bad[0][1]
            names = ", ".join(p.relative_to(self.path).as_posix() for p, _ in bad[:3])
            raise SinkflowError(f"{len(bad)} of {len(checked)} images in {self.path} cannot be read ({names}"
                                f"{', ...' if len(bad) > 3 else ''}; the first: {bad[0][1].problem})",
                                "re-export them or remove them from data.path")

        return write((len(files), *self.chw), fill)
