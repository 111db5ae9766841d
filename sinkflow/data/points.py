"""A user's own point cloud (``data.target=points.npy`` or ``points.csv``), validated before any work starts."""

from __future__ import annotations

import array
import hashlib
import logging
import math
import os

import numpy as np
import torch

from sinkflow.data.base import DEFAULT_TEST_SEED, Distribution, check_sample_args
from sinkflow.errors import DataNotFound, SinkflowError

MIN_POINT_ROWS = 16
# the spread (root-mean-square of the coordinates' standard deviations) outside which a point file is warned about:
# the recipes (a N(0, I) source, sinkhorn.blur, the networks' initialisation and learning rates) are set for the
# built-in targets' 1.0 (normal) to 3.6 (8gaussians). Moons (2.1) scaled, NSGF 1000 steps, W2 / scale against its
# held-out rows: 0.51 as it is, 0.56-0.65 at x0.3-x10, 0.90 at x0.03 and 0.81 at x30; at 300 steps 4.5 at x0.01 and
# 1.3 at x100 (0.65 as it is), OT-CFM alike (3.8, 1.3, 0.70)
POINT_SPREAD = (0.1, 30.0)
NPY_MAGIC = b"\x93NUMPY"
POINT_SUFFIXES = (".npy", ".csv", ".tsv", ".txt")
DELIMITERS = {".csv": ",", ".tsv": "\t", ".txt": None}  # None: any whitespace
# a separator a line may hold instead of its file type's: its name, and the suffix that reads it (None: none does);
# semicolons first: their lines hold decimal commas (Excel's CSV in a decimal-comma locale)
SEPARATORS = {";": ("semicolons", None), "\t": ("tabs", ".tsv"), ",": ("commas", ".csv"), " ": ("spaces", ".txt")}

log = logging.getLogger(__name__)


def load_table(path: str, binary: bool = False) -> np.ndarray:
    """A text table of points as float64 (N, D): one point per line, an optional header line, ``#`` comments.
    Parsed once, here, so that a bad value (a word, an empty cell, NaN or Inf) is named by its line in the file
    (numpy.loadtxt counts rows after the header and comments). The header is a first line with no number in it: a
    first line with one bad cell is data, refused, not dropped in silence as a header (a typo, an empty cell); a
    UTF-8 byte-order mark (Excel's "CSV UTF-8") is not part of the first value. Streamed a line at a time into one
    flat float64 buffer: every line and row held as Python lists took 68 s and 5.7 GB for a 10-million-row CSV
    (190 MB); so, about 20 s and the array's size."""
    fix = "write one point per line, its coordinates separated by the file type's delimiter"
    if binary:
        raise SinkflowError(f"point file {path} is a .npy array named {os.path.splitext(path)[1]}",
                            "rename it to .npy")
    delimiter = DELIMITERS[os.path.splitext(path)[1].lower()]
    values, first, width, started, header = array.array("d"), 0, 0, False, None
    try:
        with open(path, encoding="utf-8-sig") as f:
            for n, line in enumerate(f, 1):
                text = line.split("#")[0].strip()
                if not text:
                    continue
                # a quoted cell ("0.5", csv.QUOTE_ALL / pandas' quoting=1) is its value: the quotes are the CSV's
                fields = [v.strip().strip('"') for v in text.split(delimiter)]
                if not started:
                    started = True
                    if not any(is_number(v) for v in fields):
                        header = (n, fields)
                        continue  # a first line of column names
                if not first:
                    first, width = n, len(fields)
                row = table_row(path, n, fields, n == first, delimiter, fix)
                if len(row) != width:
                    raise SinkflowError(f"point file {path} has {len(row)} values on line {n} and {width} on "
                                        f"line {first}", "give every point the same number of coordinates")
                if not all(map(math.isfinite, row)):
                    raise SinkflowError(f"point file {path} has NaN or Inf on line {n}", "drop or fix that line")
                values.extend(row)
    except UnicodeDecodeError:
        raise SinkflowError(f"point file {path} is not a text file", fix) from None
    if not values:
        raise SinkflowError(f"point file {path} holds no points", fix)
    points = np.frombuffer(values, dtype=np.float64).reshape(-1, width)
    if header is not None:
        check_index_column(path, *header, points, delimiter)
        warn_label_columns(path, header[1], points)
    return points


# column names that say a point's label, not a coordinate (scikit-learn's make_moons(...) saved with its y)
LABEL_NAMES = ("label", "labels", "class", "target", "y_true", "cluster", "category")


def warn_label_columns(path: str, names: list[str], points: np.ndarray) -> None:
    """Warn where a column named as a label (``x,y,label``: a labelled data set written whole) holds a few distinct
    integers: it is read as a coordinate, and the (N, 2) points train as 3-D ones, their classes as lines apart. A
    warning, not a refusal: a column so named may be a coordinate (nothing in the file tells)."""
    if len(names) != points.shape[1]:
        return
    for i, name in enumerate(names):
        if name.lower() not in LABEL_NAMES:  # the name first: a wide table's every column was sorted on every load
            continue
        col = points[:, i]
        distinct = len(np.unique(col))
        if bool(np.all(col == np.round(col))) and distinct <= max(2, len(col) // 10):
            log.warning("point file %s: column %r holds %d distinct integers and is read as a coordinate (the points "
                        "are %d-D); if it labels the points, drop it (sinkflow learns where the points lie)", path,
                        name, distinct, points.shape[1])


# first column names that say a row index, not a coordinate: pandas' unnamed index (`df.to_csv(path)` of named
# columns writes ",x,y"), its read-back name ("Unnamed: 0"), and an index named by hand
INDEX_NAMES = ("", "index", "id", "idx")


def check_index_column(path: str, n: int, names: list[str], points: np.ndarray, delimiter: str | None) -> None:
    """Refuse a table whose first column is a row index under its header: pandas' ``df.to_csv(path)`` of columns
    named x, y writes ``,x,y`` over an index column, and the file was read as 3-D points (index, x, y) without a word
    (the ``,0,1`` of unnamed columns was refused already). An empty or "Unnamed: ..." name is pandas' index whatever
    its values (a filtered frame's index skips rows); "index", "id", "idx" are one when the column holds distinct
    integers. A header one name short of the rows is one over an unnamed first column of distinct integers."""
    header = (delimiter or " ").join(names)  # as the file's line reads, quoted in the message
    short = len(names) == points.shape[1] - 1  # the index's empty name stripped off the line (a .tsv's "\tx\ty")
    if short:                                   # or left out (R's write.table puts no name over its row names)
        names = ["", *names]
    if len(names) < 2 or points.shape[1] != len(names):
        return
    name = names[0].lower()
    col = points[:, 0]
    counter = bool(np.all(col == np.round(col))) and len(np.unique(col)) == len(col)
    pandas = (name == "" and not short) or name.startswith("unnamed:")  # its index, whatever the values
    if not (pandas or (name in INDEX_NAMES and counter)):
        return
    named = (f"unnamed: the header on line {n}, {header!r}, names one column fewer than the rows hold" if short else
             f"{names[0]!r} in the header on line {n}, {header!r}")  # the short one's '' is no name of the file's
    raise SinkflowError(f"point file {path}: its first column ({named}) is a row index, not a coordinate; the points "
                        f"would be {points.shape[1]}-D", "write it without the index, e.g. df.to_csv(path, "
                        "index=False), or drop that column")


def table_row(path: str, n: int, fields: list[str], first: bool, delimiter: str | None, fix: str) -> list[float]:
    """Line ``n``'s values, or one line naming what is wrong with it: a trailing delimiter, pandas' index column
    (its ``,0,1`` header is the first line read as data), or the cell that is no number."""
    try:
        return [number(v) for v in fields]
    except ValueError:
        index = first and fields == ["", *map(str, range(len(fields) - 1))]  # pandas' ",0,1" header
        if len(fields) > 1 and fields[-1] == "" and all(is_number(v) for v in fields[:-1]):
            raise SinkflowError(f"point file {path}: line {n} ends with a delimiter (an empty last column)",
                                "drop the trailing delimiter on every line, e.g. write the file with "
                                "numpy.savetxt(path, points, delimiter=',')") from None
        raise SinkflowError(f"point file {path} is not a table of numbers: line {n} holds "
                            f"{(delimiter or ' ').join(fields)!r}",
                            "it has pandas' index column: write it with df.to_csv(path, index=False, "
                            "header=['x', 'y']), or numpy.save" if index else
                            separator_fix(path, fields, delimiter) or fix) from None


def separator_fix(path: str, fields: list[str], delimiter: str | None) -> str | None:
    """The fix for a line whose coordinates are separated otherwise than its file type says (None if they are not):
    a .csv of semicolons (Excel's in a decimal-comma locale) or of spaces was "not a table of numbers" with the fix
    "separated by the file type's delimiter", which named neither."""
    suffix = os.path.splitext(path)[1].lower()
    for sep, (name, reads) in SEPARATORS.items():
        if sep != delimiter and (delimiter or sep not in " \t") and any(sep in v for v in fields):
            own = SEPARATORS[delimiter][0] if delimiter else "spaces or tabs"
            how = (f"rename the file to {reads}" if reads else "write it with commas between coordinates and '.' "
                   "for decimals to a .csv, e.g. numpy.savetxt(path, points, delimiter=',')")
            return f"a {suffix} file separates coordinates by {own}, this line by {name}: {how}"
    return None


def number(text: str) -> float:
    """A cell's number as a table writes it: Python's ``float`` also reads ``1_0`` as 10 and non-ASCII digits, which
    numpy.loadtxt and every other reader of the file refuse (the points would be other numbers than the file's)."""
    if "_" in text or not text.isascii():
        raise ValueError(text)
    return float(text)


def is_number(text: str) -> bool:
    try:
        number(text)
    except ValueError:
        return False
    return True


class PointFile(Distribution):
    """Points from an ``(N, D)`` (or ``(N, *shape)``) float array in a ``.npy`` file, drawn by index.

    ``sample`` draws i.i.d. indices with replacement from the caller's generator. With ``test_rows`` = m > 0
    (``data.test_rows``) the file's last m rows are held out: ``sample`` (every training draw: the NSGF pool,
    the FM / OT-CFM batches) never returns them and ``test_set`` returns only them, so a W2 against them
    measures the model on points it never saw. With m = 0 ``test_set`` draws from all rows with a fixed seed
    (nothing is held out). Whether ``shape`` matches the other side of the transport problem is the
    caller's check: it is exposed here.
    """

    def __init__(self, path: str, min_rows: int = MIN_POINT_ROWS, test_rows: int = 0):
        self.path = str(path)
        self.name = os.path.basename(self.path)
        if isinstance(test_rows, bool) or not isinstance(test_rows, int) or test_rows < 0:
            raise SinkflowError(f"data.test_rows={test_rows!r} is not a row count", "use 0 (nothing held out) or "
                                "the number of rows at the end of the file to hold out, e.g. 1024")
        points = load_points(self.path, min_rows)
        self.test_rows = test_rows
        if len(points) - test_rows < min_rows:
            raise SinkflowError(f"point file {path} has {len(points)} rows; data.test_rows={test_rows} holds out "
                                f"too many to leave {min_rows} for training", "hold out fewer rows or add points")
        cut = len(points) - self.test_rows
        self.points, self.held_out = points[:cut], points[cut:]
        if self.test_rows:
            warn_held_out_unlike(self.path, self.points, self.held_out)
        self.shape = tuple(self.points.shape[1:])
        # RUN/data_split.json: a resume refuses a file whose points changed (the values, not the file's bytes)
        # "shape": what sampling needs of the file when it is not here (``tools.data.sampling_data``)
        self.split_info = {"points": os.path.abspath(self.path), "rows": len(points), "test_rows": test_rows,
                           "shape": list(self.shape),
                           "points_sha256": hashlib.sha256(points.numpy().tobytes()).hexdigest()}

    def sample(self, n, generator, device="cpu"):
        check_sample_args(n, generator, device)
        idx = torch.randint(0, len(self.points), (n,), generator=generator)
        return self.points[idx].to(device)

    def check_test_n(self, n: int, flag: str = "eval.n") -> None:
        """The held-out rows are the only test points: more cannot be drawn (the one check of `train`'s eval.n,
        `sinkflow eval --n` and ``test_set``)."""
        if self.test_rows and n > self.test_rows:
            sep = " " if flag.startswith("-") else "="
            raise SinkflowError(f"{flag}{sep}{n} test points, but {self.path} holds out only data.test_rows="
                                f"{self.test_rows}", f"use {flag}{sep}{self.test_rows} or less, or hold out more rows")

    def test_set(self, n: int, seed: int = DEFAULT_TEST_SEED) -> torch.Tensor:
        """The held-out rows (n of them: all when n = test_rows, else a seeded subset without replacement);
        without held-out rows, ``n`` fixed-seed draws from all rows."""
        if not self.test_rows:
            return super().test_set(n, seed)
        self.check_test_n(n)
        if n == self.test_rows:
            return self.held_out.clone()
        idx = torch.randperm(self.test_rows, generator=torch.Generator().manual_seed(seed))[:n]
        return self.held_out[idx]


class AbsentPointFile(Distribution):
    """A point-file target that is not on this machine, known by the shape its run recorded: sampling a trained run
    draws from the source alone, so it needs no more (``tools.data.sampling_data``); whatever would read the points
    raises the file's own ``missing`` error."""

    def __init__(self, name: str, shape: tuple[int, ...], missing: DataNotFound):
        self.name, self.shape, self.missing = name, tuple(shape), missing

    def sample(self, n, generator, device="cpu"):
        raise self.missing


def load_points(path: str, min_rows: int = MIN_POINT_ROWS) -> torch.Tensor:
    """Load and validate a point file; every problem is a one-line SinkflowError naming file and fix.

    A ``.npy`` array, or a text table (``.csv`` comma-separated, ``.tsv`` tab-separated, ``.txt`` whitespace) of one
    point per line, with an optional header line of column names and ``#`` comments (numpy.loadtxt)."""
    fix_shape = "save an (N, 2) float array with numpy.save(path, points.astype('float32'))"
    path = os.path.expanduser(path)  # `data.target=~/pts.npy`: the shell leaves a ~ after "=" as it is
    if not path.lower().endswith(POINT_SUFFIXES):
        raise SinkflowError(f"point file {path} is not a .npy, .csv, .tsv or .txt file",
                            f"{fix_shape}, or write one point per line to a .csv")
    if os.path.isdir(path):
        raise SinkflowError(f"point file {path} is a folder, not a file", "point data.source/data.target at the "
                            "point file itself")
    if not os.path.isfile(path):
        what = "is not a file" if os.path.exists(path) else "does not exist"
        fix = ("check the path (a typo?), or put the file back there; for a run whose file moved, name its new place "
               "once, `sinkflow train --resume RUN data.target=NEW_PATH --no-report` (or data.source; its points must "
               "match the hashes in RUN/data_split.json), and eval reads it there"
               if os.path.isabs(path) else
               "check data.source/data.target (paths are relative to the directory you run sinkflow from)")
        raise (DataNotFound if what == "does not exist" else SinkflowError)(f"point file {path} {what}", fix)
    try:
        with open(path, "rb") as f:
            magic = f.read(len(NPY_MAGIC))
    except OSError as e:
        raise SinkflowError(f"point file {path} cannot be read ({e.strerror})", "check its permissions") from None
    if not path.lower().endswith(".npy"):
        arr = load_table(path, binary=magic == NPY_MAGIC)
    elif magic != NPY_MAGIC:  # a text/CSV file, an .npz, a pickle renamed to .npy...
        raise SinkflowError(f"point file {path} is not a .npy file (no NumPy header)",
                            f"{fix_shape} (a text table of points is read from a .csv or .txt file)")
    else:
        try:
            arr = np.load(path, allow_pickle=False)
        except ValueError as e:  # object arrays (they would need unpickling: never done), bad headers
            reason = "it holds Python objects, not numbers" if "pickle" in str(e) else str(e)
            raise SinkflowError(f"point file {path} is not a plain numeric .npy array ({reason})", fix_shape) from None
        except (OSError, EOFError) as e:
            raise SinkflowError(f"point file {path} cannot be read as .npy ({e})", fix_shape) from None
    if not isinstance(arr, np.ndarray):
        raise SinkflowError(f"point file {path} holds an archive, not one array", fix_shape)
    if arr.dtype.kind not in "fiu":
        raise SinkflowError(f"point file {path} has dtype {arr.dtype}, not a real number type", fix_shape)
    if arr.ndim < 2:
        raise SinkflowError(f"point file {path} holds an array of shape {arr.shape}, not a 2-D (N, D) array",
                            "reshape it to one point per row, e.g. points.reshape(-1, 2)")
    if any(s == 0 for s in arr.shape[1:]):
        raise SinkflowError(f"point file {path} has shape {arr.shape}: points have no coordinates", fix_shape)
    if len(arr) < min_rows:
        raise SinkflowError(f"point file {path} has {len(arr)} rows; at least {min_rows} are needed",
                            "add more points (each row is one sample)")
    bad = ~np.isfinite(arr.reshape(len(arr), -1)).all(axis=1) if arr.dtype.kind == "f" else np.zeros(len(arr), bool)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise SinkflowError(f"point file {path} has NaN or Inf in {int(bad.sum())} rows (first: row {first})",
                            "drop or fix those rows, e.g. points[np.isfinite(points).all(1)]")
    with np.errstate(over="ignore"):  # values beyond float32 become inf: refused on the next line, in one line
        x = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    if not torch.isfinite(x).all():
        raise SinkflowError(f"point file {path} has values too large for float32",
                            "rescale the points (e.g. standardise them) before saving")
    flat = x.reshape(len(x), -1).double()
    squared = float((flat.amax(0) - flat.amin(0)).pow(2).sum())  # the squared diameter of the cloud
    if squared > torch.finfo(torch.float32).max:  # the Sinkhorn cost |x - y|^2 is float32: inf, after the run folder
        raise SinkflowError(f"point file {path} spans {squared ** 0.5:.3g}: squared distances between its points "
                            "overflow float32 (the Sinkhorn cost |x - y|^2)",
                            "standardise the points before saving, e.g. (points - points.mean(0)) / points.std(0)")
    if squared == 0:  # trains and scores without a word otherwise: a W2 against one point says little
        log.warning("point file %s: all %d rows are the same point (%s): the distribution is a single point",
                    path, len(x), ", ".join(f"{v:.4g}" for v in flat[0].tolist()[:4]))
    else:
        warn_spread(path, float(flat.var(0).mean().sqrt()))
    return x


HELD_OUT_SHIFT = (5.0, 0.25)  # a held-out mean this many standard errors and standard deviations from the rest


def warn_held_out_unlike(path: str, train: torch.Tensor, held: torch.Tensor) -> None:
    """Warn when the held-out rows (``data.test_rows``, the file's last rows) do not look drawn like the rest: a file
    sorted by class or by a coordinate (``make_moons(shuffle=False)``) trained on one part and was scored on another,
    without a word. The test: some coordinate's mean shifted by over ``HELD_OUT_SHIFT`` standard errors and standard
    deviations (a random split of 200 rows shifts by about 0.08 standard deviations; one moon of two by 0.7)."""
    flat_train, flat_held = train.reshape(len(train), -1).double(), held.reshape(len(held), -1).double()
    sd = flat_train.std(0).clamp_min(1e-12)
    shift = (flat_held.mean(0) - flat_train.mean(0)).abs() / sd
    z = shift / math.sqrt(1 / len(flat_held) + 1 / len(flat_train))
    bad = (z > HELD_OUT_SHIFT[0]) & (shift > HELD_OUT_SHIFT[1])
    if bool(bad.any()):
        j = int(torch.where(bad, shift, torch.zeros_like(shift)).argmax())
        log.warning("point file %s: its held-out rows (the last %d, data.test_rows) do not look drawn like the rest "
                    "(coordinate %d's mean is %.2g standard deviations away): a file sorted by class or coordinate "
                    "is scored on a part the model never trained on; shuffle its rows", path, len(held), j,
                    float(shift[j]))


def warn_spread(path: str, spread: float) -> None:
    """Warn when the points spread far from the unit scale the recipes are set for (``POINT_SPREAD``): a run on
    moons x 0.01 or x 1e4 trained, exited 0 and scored a W2 of several times the data's own size without a word
    (NSGF's pool warns only beyond 10^4 blurs, FM / OT-CFM never)."""
    low, high = POINT_SPREAD
    if not low <= spread <= high:
        log.warning("point file %s: its points spread %.3g (the RMS of the coordinates' standard deviations), far "
                    "from the unit scale sinkflow's recipes are set for (%g to %g: a N(0, I) source, sinkhorn.blur, "
                    "the networks' initialisation), so a run on them learns little; standardise them, e.g. (points - "
                    "points.mean(0)) / points.std(0), and map the samples back", path, spread, low, high)
