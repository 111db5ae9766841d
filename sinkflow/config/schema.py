"""The config schema: every key declared once, with its type, range or choices, default and one-line doc.

Modelled on scikit-learn's ``_parameter_constraints``: one declaration that everything else reads, so
defaults, validation, ``presets/_base.yaml`` and docs/config.md cannot drift apart (tests regenerate the
last two and compare). ``SCHEMA`` is the tree of sections; a model section (``model.<phase>``) has a
``kind`` and the keys of that kind only (``MODEL_KINDS``), because an MLP has no ``channel_mult``.

Nothing here imports torch: ``sinkflow config`` and the CLI's argument checks stay fast. Where a choice
list also lives next to the code that implements it (activations, flow memory modes...), a test checks
that the two agree.
"""

from __future__ import annotations

import difflib
import math
import numbers
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import yaml

IMAGE_TARGETS = ("digits", "mnist", "cifar10", "folder")  # = sinkflow.data.images.IMAGE_SETS (a test checks)
POINT_TARGETS_2D = ("8gaussians", "8gaussians-qmc", "moons", "scurve", "checkerboard")  # = sinkflow.data.TOY2D's
POINT_FILE_SUFFIXES = (".npy", ".csv", ".tsv", ".txt")  # = sinkflow.data.points.POINT_SUFFIXES (a test checks)


# ---- constraints -------------------------------------------------------------------------------------

class Constraint:
    """A value rule: ``coerce`` converts a parsed value to the key's type (or raises TypeError), ``violation``
    names the broken range or choice (or returns None)."""

    type_name = "value"

    def coerce(self, value: Any) -> Any:
        raise NotImplementedError

    def violation(self, value: Any) -> str | None:
        return None

    def describe(self) -> str:
        return self.type_name


def is_number(value: Any) -> bool:
    """A real number of any type (numpy's too, as the API passes them), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy's bool is no Real


@dataclass(frozen=True)
class _Ranged(Constraint):
    """A number with optional bounds ``lo``/``hi`` (declared by the subclass) and a ``rule()`` saying them."""

    def describe(self):
        return self.type_name if self.lo is None and self.hi is None else f"{self.type_name} {self.rule()}"


@dataclass(frozen=True)
class Int(_Ranged):
    lo: int | None = None
    hi: int | None = None
    exclude: tuple = ()
    type_name = "int"

    def coerce(self, value):
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)  # numpy's as Python's: what config.yaml holds
        if isinstance(value, float) and value.is_integer():  # 1e3 parses as a float
            return int(value)
        raise TypeError

    def violation(self, value):
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi) \
                or value in self.exclude:
            return f"must be {self.rule()}"
        return None

    def rule(self) -> str:
        if self.lo is not None and self.hi is not None:
            text = f"in [{self.lo}, {self.hi}]"
        elif self.lo is not None:
            text = f">= {self.lo}"
        elif self.hi is not None:
            text = f"<= {self.hi}"
        else:
            text = "an integer"
        return text + "".join(f" and != {x}" for x in self.exclude)


@dataclass(frozen=True)
class Float(_Ranged):
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    type_name = "float"

    def coerce(self, value):
        if is_number(value) and math.isfinite(value):
            return float(value)
        raise TypeError

    def violation(self, value):
        low = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        high = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        return f"must be {self.rule()}" if low or high else None

    def rule(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return "a finite number"


@dataclass(frozen=True)
class Real(Float):
    """A number kept as written: UNet width multipliers read better as ``[1, 2, 2]`` than ``[1.0, 2.0, 2.0]``."""

    type_name = "number"

    def coerce(self, value):
        if is_number(value) and math.isfinite(value):
            return value
        raise TypeError


@dataclass(frozen=True)
class Bool(Constraint):
    type_name = "bool"

    def coerce(self, value):
        if isinstance(value, bool):
            return value
        raise TypeError


@dataclass(frozen=True)
class AutoBool(Constraint):
    """``auto`` (decided where the key is read: for the device, sinkflow.engine.fast_path; per UNet block) or a
    boolean."""

    type_name = "auto | bool"

    def coerce(self, value):
        if isinstance(value, bool) or value == "auto":
            return value
        raise TypeError

    def describe(self):
        return "`auto` | bool"


@dataclass(frozen=True)
class Str(Constraint):
    type_name = "str"

    def coerce(self, value):
        if isinstance(value, str):
            return value
        if is_number(value):  # experiment.name=2024 is a name, not a number
            return str(value)
        raise TypeError


@dataclass(frozen=True)
class Options(Constraint):
    """One of a fixed set of values (strings, or ints such as data.channels 1 | 3)."""

    choices: tuple = ()

    def __init__(self, *choices):
        object.__setattr__(self, "choices", tuple(choices))

    @property
    def type_name(self):
        return "int" if all(isinstance(c, int) for c in self.choices) else "str"

    def coerce(self, value):
        return (Int() if self.type_name == "int" else Str()).coerce(value)

    def violation(self, value):
        if value in self.choices:
            return None
        return f"must be one of {', '.join(map(str, self.choices))}"

    def closest(self, value) -> str | None:
        close = difflib.get_close_matches(str(value), [str(c) for c in self.choices], n=1)
        return close[0] if close else None

    def describe(self):
        return " | ".join(f"`{c}`" for c in self.choices)


class TextNumbers(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.1's numbers and dates left as text (``config._ConfigLoader`` builds on it):
    ``as_decimal`` then reads them decimal as typed, the one rule of every value a user writes."""


TextNumbers.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag.rsplit(":", 1)[-1] not in ("int", "float", "timestamp")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}

_DECIMAL_INT = re.compile(r"[-+]?\d+")
_DECIMAL_FLOAT = re.compile(r"[-+]?(\.\d+|\d+(\.\d*)?)([eE][-+]?\d+)?")


def as_decimal(value: Any) -> Any:
    """``value`` (from ``TextNumbers``) with its decimal texts as numbers, in lists too: ``010`` is 10, ``1e-3`` and
    ``1.0e3`` floats; ``1:30``, ``0x1F``, ``nan`` and dates stay text."""
    if isinstance(value, list):
        return [as_decimal(v) for v in value]
    if isinstance(value, str):
        text = value.strip()
        if _DECIMAL_INT.fullmatch(text):
            return int(text, 10)
        if _DECIMAL_FLOAT.fullmatch(text):
            return float(text)
    return value


def parse_value(text: str) -> Any:
    """Parse an override's value the way YAML would, numbers decimal as typed: YAML 1.1 read ``010`` as octal 8,
    ``1:30`` as the base-60 90 (it stays a string) and ``1e-3`` as a string (it is a float), in lists too."""
    try:
        return as_decimal(yaml.load(text, Loader=TextNumbers))  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError:
        return text


@dataclass(frozen=True)
class ListOf(Constraint):
    """A list; a scalar means a list of one, and a string "16,8" the list [16, 8] (torchcfm's spelling)."""

    item: Constraint = field(default_factory=Int)
    min_len: int = 1
    type_name = "list"

    def coerce(self, value):
        if isinstance(value, str) and "," in value:
            value = [parse_value(v.strip()) for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            if isinstance(value, bool) or value is None or isinstance(value, dict):
                raise TypeError
            value = [value]
        return [self.item.coerce(v) for v in value]

    def violation(self, value):
        if len(value) < self.min_len:
            return f"must have at least {self.min_len} element{'s' if self.min_len > 1 else ''}"
        for v in value:
            bad = self.item.violation(v)
            if bad:
                return "must have every element " + bad.removeprefix("must be ")
        return None

    def describe(self):
        return f"list of {self.item.describe()}"


# ---- keys ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class When:
    """Where a key matters: ``sinkflow config`` hides the keys a run does not use; docs print ``text``."""

    text: str
    test: Callable[[dict], bool]

    def __call__(self, tree: dict) -> bool:
        return self.test(tree)


def both(a: When | None, b: When | None) -> When | None:
    """``a`` and ``b`` (either may be None: always)."""
    if a is None or b is None:
        return a or b
    return When(f"{a.text}; {b.text}", lambda t: a(t) and b(t))


@dataclass(frozen=True)
class Key:
    default: Any
    rule: Constraint
    doc: str
    nullable: bool = False
    when: When | None = None  # besides which methods read it (below): a data kind, a solver...
    opt_in: bool = False  # a shared key that only the methods listing it in their ``reads`` read


def _method(tree: dict) -> str:
    return tree["experiment"]["method"]


def _with_when(key: Key, when: When | None) -> Key:
    """``key`` read only when ``when`` holds too."""
    return key if when is None else replace(key, when=both(when, key.when))


IMAGES = When("an image target (" + ", ".join(IMAGE_TARGETS) + ")", lambda t: t["data"]["target"] in IMAGE_TARGETS)
POINTS = When("a point target (2D, .npy)", lambda t: t["data"]["target"] not in IMAGE_TARGETS)
FOLDER = When("data.target=folder", lambda t: t["data"]["target"] == "folder")
POINT_FILE = When("a point file as data.target", lambda t: str(t["data"]["target"]).lower().endswith(POINT_FILE_SUFFIXES))
GEOMLOSS = When("sinkhorn.solver=geomloss", lambda t: t["sinkhorn"]["solver"] == "geomloss")
CONVERGED = When("sinkhorn.solver=converged", lambda t: t["sinkhorn"]["solver"] == "converged")

POS_INT = Int(lo=1)
# Euler steps a sampler takes: 10^5 is far past any use, and a typo past it (sample.steps=1000000000) ran for days or
# ran out of memory; `sinkflow sample --steps`, Run.sample(steps=) and every steps key share the bound
MAX_EULER_STEPS = 100_000
EULER_STEPS = Int(lo=1, hi=MAX_EULER_STEPS)
NONNEG_INT = Int(lo=0)
POS_FLOAT = Float(lo=0, lo_open=True)
NONNEG_FLOAT = Float(lo=0)

EXPERIMENT = {
    "method": Key("nsgf", Str(), "what trains: one of the registered methods (docs/config.md, Methods)"),
    "preset": Key("", Str(), "filled in with the preset's name"),
    "seed": Key(0, Int(0, 2**63 - 1), "seed of every random number generator of the run"),
    "device": Key("auto", Str(), "auto (cuda if available) | cpu | cuda | cuda:N"),
    "runs_dir": Key("runs", Str(), "run folders are created under this directory"),
    "name": Key(None, Str(), "run folder name; null = <preset>-<method>-<timestamp> (seconds; `-2`, `-3`, ... after "
                "it for a second run started in the same second)", nullable=True),
}

DATA = {
    "source": Key("normal", Str(), "normal | 8gaussians | moons | scurve | checkerboard | path/to/points.npy (or .csv / .tsv / .txt) "
                  "(the shape of normal follows the target)"),
    "target": Key("moons", Str(), "as source, or an image set: digits | mnist | cifar10 | folder"),
    "test_rows": Key(0, NONNEG_INT, "a target point file: its last test_rows rows are held out, never trained on, "
                     "and are the W2 test points (0 = nothing held out)", when=POINT_FILE),
    "root": Key("data", Str(), "where image sets are downloaded to and cached", when=IMAGES),
    "path": Key(None, Str(), "image folder for target=folder", nullable=True, when=FOLDER),
    "holdout": Key("every_tenth", Options("every_tenth", "last_tenth"), "an image folder's test split, in sorted "
                   "order: every tenth image (the 10th, 20th, ...: a tenth of each class subfolder) or the last tenth "
                   "(runs made before this key: with class subfolders, the last class alone)", when=FOLDER),
    "image_size": Key(None, POS_INT, "resize + center-crop the images (of any image set) to this size "
                      "(null = native)", nullable=True, when=IMAGES),
    "channels": Key(None, Options(1, 3), "1 = grayscale, 3 = RGB, null = native", nullable=True, when=IMAGES),
    "flip": Key(False, Bool(), "random horizontal flip, per sample, on the device", when=IMAGES),
    "split": Key("train", Options("train", "test"), "which split of the image set trains", when=IMAGES),
    "val_fraction": Key(0.0, Float(0, 0.5), "image sets: this fraction of the train split is held out as "
                        "validation (fixed seed)", when=IMAGES),
    "download": Key(True, Bool(), "torchvision download of mnist/cifar10 when missing", when=IMAGES),
}

# Opt-in sections: the Sinkhorn flow's trajectory pool (sinkflow/methods/pool.py), read by the methods that
# list them in their ``reads``.
SINKHORN = {
    "blur": Key(0.05, POS_FLOAT, "Sinkhorn blur: eps = blur^2 (cost |x-y|^2/2); paper candidates 0.5, 1, 2"),
    "scaling": Key(0.9, Float(0, 1, lo_open=True, hi_open=True), "eps-annealing ratio per Sinkhorn stage"),
    "diameter": Key(None, POS_FLOAT, "cost diameter for eps-annealing: null = one bounding box of all pool batches "
                    "(fixed per build); else this value for every batch", nullable=True),
    "backend": Key("tensorized", Options("tensorized", "online"), "GeomLoss's backend (online needs pykeops)",
                   when=GEOMLOSS),
    "solver": Key("geomloss", Options("geomloss", "converged"),
                  "geomloss: one pass of eps-annealing | converged: then iterate at the final eps to tol"),
    "max_iters": Key(200, POS_INT, "most over-relaxed Sinkhorn iterations at the final eps", when=CONVERGED),
    "tol": Key(0.001, POS_FLOAT, "stop when no potential moves by more than tol * eps", when=CONVERGED),
}

POOL_KEYS = {
    "batches": Key(200, POS_INT, "pool batches (independent trajectories of batch_size particles)"),
    "batch_size": Key(256, Int(lo=2), "particles per pool batch = the Sinkhorn batch (>= 2 points a side)"),
    "steps": Key(100, EULER_STEPS, "T Euler steps per trajectory"),
    "eta": Key(0.02, POS_FLOAT, "Euler step size of the Sinkhorn flow"),
    "eta_growth": Key(0.0, NONNEG_FLOAT, "incremental schedule's rate r: eta_k = eta*exp(r(k-T)/T) "
                      "(the dev code's \"incremental lr\" hint, r=4)"),
    "schedule": Key(None, Options("constant", "incremental", "harmonic"), "harmonic: eta_k = eta/(T-k); "
                    "null = incremental if eta_growth > 0, else constant", nullable=True),
    "qmc": Key(False, Bool(), "draw each batch's source points by randomised QMC (scrambled Sobol) where the source "
               "has a twin (normal, 8gaussians): even coverage of the source in every Sinkhorn batch"),
    "landing": Key("sinkhorn", Options("sinkhorn", "exact"), "the flow's last step: a Sinkhorn step, or exact = onto "
                   "each particle's exact-OT partner in the target batch (the blur -> 0 limit; harmonic schedule)"),
    "storage": Key("memory", Options("memory", "disk"), "where the pool lives: memory, or disk (a numpy memmap in the run folder)"),
    "dtype": Key("float32", Options("float32", "float16"), "dtype the pool is stored in (training computes in float32)"),
    "chunk": Key(50, POS_INT, "pool batches per resumable chunk"),
    "in_flight": Key(0, NONNEG_INT, "pool batches solved at once (at most pool.chunk); 0 = chosen from the "
                     "memory budget"),
    "seed": Key(None, Int(0, 2**63 - 1), "seed of the pool's source and target draws (null: experiment.seed); fix it "
                "to train networks of several experiment seeds on one pool", nullable=True),
    "ram_gb": Key(8.0, POS_FLOAT, "the pool must fit this much RAM when storage=memory"),
    "disk_gb": Key(64.0, POS_FLOAT, "... and this much disk when storage=disk"),
}

NSGF = {
    "time": Key("flow", Options("flow", "fraction"), "flow: t_k = eta_0+..+eta_{k-1}, target v_k | "
                "fraction: s_k = k/T, target T*eta_k*v_k"),
    "segment": Key(0.0, Float(0, 1), "probability that a training point is drawn on its Euler segment "
                   "x_k + u*eta_k*v_k, u~U[0,1)"),
}

# ---- model kinds: the keys of a model section depend on its kind ----------------------------------------

ACTIVATIONS = ("selu", "silu", "relu", "gelu")  # = sinkflow.models.mlp.ACTIVATIONS (a test checks)


class Network(dict):
    """A model kind: its keys (``{name: Key}``, the dict itself) and the ``role`` it can play in a phase
    (``velocity``: forward(x, t); ``time``: forward(x) -> t; ``flow``: an invertible density). A phase offers
    every kind of its role, so a new network is its file ``models/<kind>.py`` plus one entry here."""

    def __init__(self, role: str, keys: dict[str, Key]):
        super().__init__(keys)
        self.role = role


MODEL_KINDS: dict[str, dict[str, Key]] = {
    "mlp": Network("velocity", {
        "hidden": Key(256, POS_INT, "units per hidden layer (paper: 256)"),
        "depth": Key(3, POS_INT, "hidden layers (paper: 3)"),
        "activation": Key("selu", Options(*ACTIVATIONS), "nonlinearity after each hidden layer"),
        "time_freqs": Key(0, NONNEG_INT, "0: the raw t is one extra input; K > 0: also sin/cos(2^k pi t) for k < K"),
        "time_bins": Key(0, NONNEG_INT, "K > 0: also a one-hot of t's bin [k/K, (k+1)/K) (NSGF: K = pool.steps "
                         "with nsgf.time=fraction, so the field can jump at the pool's grid times)"),
    }),
    "unet": Network("velocity", {
        "channels": Key(32, POS_INT, "base channels"),
        "res_blocks": Key(1, POS_INT, "residual blocks per level"),
        "channel_mult": Key([1, 2, 2], ListOf(Real(lo=0, lo_open=True)), "width multiplier per level"),
        "num_heads": Key(1, POS_INT, "attention heads (when num_head_channels = -1)"),
        "num_head_channels": Key(-1, Int(lo=-1, exclude=(0,)), "channels per attention head; -1 = use num_heads"),
        "attention_resolutions": Key([16], ListOf(POS_INT, min_len=0), "torchcfm rule: attention at downsample "
                                     "image_size // r"),
        "dropout": Key(0.0, Float(0, 1, hi_open=True), "dropout in the residual blocks"),
        "use_scale_shift_norm": Key("auto", AutoBool(), "time conditioning by FiLM scale-shift after the norm (true) "
                                    "or added before it (false); auto: FiLM in the blocks whose GroupNorm has one "
                                    "channel per group, which would cancel an added embedding (widths <= 32 under "
                                    "ADM's groups), added elsewhere (docs/models.md)"),
        "norm_min_channels": Key(1, POS_INT, "fewest channels in a GroupNorm group (ADM's 32 groups, fewer where a "
                                 "group would hold less): 1 = ADM; with additive conditioning (use_scale_shift_norm: "
                                 "false) its one-channel groups at widths <= 32 cancel t (docs/models.md)"),
        "pad_mode": Key("reflect", Options("reflect", "replicate", "zeros"),
                        "padding to a multiple of 2^(levels-1)"),
    }),
    "time_predictor": Network("time", {
        "channels": Key([32, 64, 128, 256], ListOf(POS_INT), "images: filters of the conv layers (paper: 4 layers)",
                        when=IMAGES),
        "hidden": Key(256, POS_INT, "points: MLP width", when=POINTS),
        "depth": Key(3, POS_INT, "points: MLP hidden layers", when=POINTS),
        "activation": Key("selu", Options(*ACTIVATIONS), "points: MLP nonlinearity", when=POINTS),
    }),
    "flow": Network("flow", {
        "arch": Key("glow", Options("glow", "realnvp"), "flow architecture"),
        "levels": Key(3, POS_INT, "multi-scale levels: image sides must be divisible by 2**levels"),
        "depth_per_level": Key(8, POS_INT, "flow steps per level (glow: ActNorm, 1x1 conv, coupling)"),
        "hidden_channels": Key(64, POS_INT, "coupling conditioner width"),
        "coupling": Key("affine", Options("affine", "additive"), "coupling type (additive: glow only)"),
        "scale": Key(None, Options("sigmoid", "tanh"), "coupling scale map: null = sigmoid (glow) / tanh (realnvp)",
                     nullable=True),
        "prior": Key(None, Options("learned", "standard"), "null = learned (glow) / standard (realnvp)",
                     nullable=True),
        "squeeze": Key(True, Bool(), "space-to-depth at each level"),
        "memory": Key("standard", Options("standard", "checkpoint", "invertible"),
                      "checkpoint: O(sqrt L) activations | invertible: O(1) in depth, fp32 only"),
        "drift_tol": Key(1e-4, POS_FLOAT, "invertible: largest accepted relative error of a rebuilt layer input"),
        "checkpoint_segments": Key(None, POS_INT, "checkpoint: segments per level (null = round(sqrt(layers)))",
                                   nullable=True),
        "logit_alpha": Key(0.0, Float(0, 0.5, hi_open=True), "> 0: RealNVP logit preprocessing of pixels "
                           "before the levels (0 = off)"),
        "n_bins": Key(256, Int(2, 256), "pixel levels the density is over (bits/dim convention): 256 = 8-bit"),
    }),
}


def kinds_of(role: str, default: str | None = None) -> tuple[str, ...]:
    """Every model kind that plays ``role``, ``default`` first."""
    kinds = [k for k, net in MODEL_KINDS.items() if getattr(net, "role", None) == role]
    return tuple(sorted(kinds, key=lambda k: k != default))


def _train(iters=20000, batch_size=256, lr=0.001, warmup=0, schedule="cosine", grad_clip=0.0):
    """One training phase's keys; phases differ only in a few defaults (the paper's time predictor, Glow)."""
    return {
        "iters": Key(iters, POS_INT, "optimizer steps"),
        "batch_size": Key(batch_size, POS_INT, "batch per process (the global batch is this x the number of processes)"),
        "lr": Key(lr, POS_FLOAT, "Adam learning rate"),
        "lr_scaling": Key("sqrt", Options("none", "linear", "sqrt"), "how lr follows the number of processes"),
        "warmup": Key(warmup, NONNEG_INT, "linear lr warm-up steps"),
        "schedule": Key(schedule, Options("constant", "cosine"), "cosine: decay to 0 at iters, after warmup"),
        "grad_clip": Key(grad_clip, NONNEG_FLOAT, "gradient norm clip (0 = off)"),
        "ema": Key(0.0, Float(0, 1, hi_open=True), "EMA decay of the weights the sampler uses (0 = off)"),
        "ema_warmup": Key(True, Bool(), "update t of the EMA uses min(ema, (1 + t) / (10 + t)) (torch_ema's and "
                          "diffusers' warm-up: about the last tenth of the steps so far); false = ema from the first "
                          "update, which keeps ema^iters of the first step's weights (0.9999 over 20k steps: 13.5 %, "
                          "warned about above 1 %)"),
        "accum": Key(1, POS_INT, "gradient accumulation micro-batches"),
        "precision": Key("auto", Options("auto", "fp32", "bf16", "fp16"), "autocast dtype; master weights stay fp32; "
                         "fp16 scales the loss (GradScaler); auto: fp16 for a UNet on a CUDA card of compute "
                         "capability 8.0+ (Ampere on: bf16's speed, fp32's loss curve), else fp32 "
                         "(docs/performance.md)"),
        "ckpt_every": Key(1000, POS_INT, "checkpoint every N steps"),
        "log_every": Key(100, POS_INT, "metrics every N steps"),
        "hist_every": Key(0, NONNEG_INT, "TensorBoard weight/grad histograms every N steps (0 = off)"),
        "channels_last": Key(False, Bool(), "NHWC model + inputs; only takes effect on CUDA with image batches "
                             "(off: measured slower for sinkflow's GroupNorm UNets, docs/performance.md)"),
        "compile": Key("auto", AutoBool(), "torch.compile the model; auto: on for a UNet on CUDA in one process "
                       "or in a torchrun job's captured step (graph: step; tens of seconds of compiling, measured to "
                       "pay back within a phase), off elsewhere"),
        "compile_mode": Key("auto", Options("auto", "default", "reduce-overhead", "max-autotune",
                                            "max-autotune-no-cudagraphs"), "torch.compile's "
                            "mode when compile: reduce-overhead = CUDA graphs, one replay per step instead of a launch "
                            "per kernel (launch-bound steps; fixed batch shapes); max-autotune-no-cudagraphs: kernels "
                            "chosen by timing (minutes of compiling), no graphs of its own, so it runs inside graph: "
                            "step; auto: default inside a whole-step "
                            "graph (graph: step), else reduce-overhead on CUDA in one process, default otherwise"),
        "graph": Key("auto", Options("auto", "none", "step"), "step: capture the whole step (forward, backward, "
                     "clip, non-finite guard, fused Adam) as one CUDA graph and replay it, one launch a step; fixed "
                     "batch shapes (sinkflow/engine/step_graph.py); under torchrun two graphs with one all-reduce of "
                     "the gradients between them in place of DDP's hooks (grad_sync.py; unmeasured on cards: "
                     "opt-in there); auto: step for a UNet or the time predictor on CUDA in one process (measured "
                     "1.5-3.6x faster, same loss), none elsewhere; where the capture fails, auto trains on without "
                     "it after a warning, step stops"),
        "prefetch": Key("auto", Options("auto", "always", "never"), "draw the next batch on a background thread while "
                        "the step runs (auto: on CUDA only; same batches either way)"),
    }


@dataclass(frozen=True)
class Phase:
    """A training phase: its network section ``model.<name>`` (a kind of ``role``, ``kind`` by default) and
    its optimiser section ``train.<name>`` (the common keys, ``train`` changes their defaults)."""

    role: str
    kind: str
    doc: str
    train_doc: str
    train: dict = field(default_factory=dict)


# Phases more than one method trains; a method declares its own phases in its ``MethodSpec``.
PHASES: dict[str, Phase] = {
    "velocity": Phase("velocity", "mlp", "the NSGF velocity network v_theta(x, t) (also FM / OT-CFM's)",
                      "the velocity network (NSGF: velocity matching on the pool; FM / OT-CFM: on the interpolant)"),
}

SAMPLE = {
    "steps": Key(100, EULER_STEPS, "Euler steps of the velocity network at sampling time", opt_in=True),
    "time_warp": Key(1.0, POS_FLOAT, "Euler grid t_i = 1 - (1 - i/N)^warp: 1 = uniform (the paper's); < 1 makes the "
                     "early steps shorter and the last one a longer jump to the end point", opt_in=True),
    "batch_size": Key(500, POS_INT, "samples generated per network call (eval.n is split into chunks of this): the "
                                 "same samples for any value up to float rounding, not bit for bit (a kernel's "
                                 "reduction order may follow the batch; measured below 2e-6)"),
    "compile": Key(False, Bool(), "torch.compile the networks the sampler calls (CUDA: each batch shape captured "
                   "once as a CUDA graph and replayed at every Euler step); opt-in: one compile per batch shape "
                   "first, paid back on long evaluations (docs/performance.md)", opt_in=True),
    "precision": Key("auto", Options("auto", "fp32", "bf16", "fp16"), "autocast dtype of the sampled networks (the "
                     "Euler state and every step's update stay float32): auto = fp32 on a CPU; on a CUDA card the "
                     "sampled network's train.<phase>.precision where it is set (train.velocity.precision for the "
                     "built-in methods), else fp16 for a UNet on a CUDA card with bf16 tensor cores (as training's auto; 1.56x fp32's images/s on an H200, the samples "
                     "fp32's to a paired FD-CNN change <= 0.05: docs/performance.md), else fp32; bf16 / fp16 / fp32 "
                     "force one",
                     opt_in=True),
    "qmc": Key(False, Bool(), "`sinkflow sample` / Run.sample draw the source by randomised QMC (scrambled Sobol, "
               "where the source has a twin: normal, 8gaussians) instead of i.i.d.; the evaluation has its own "
               "eval.protocol"),
}

EVAL = {
    "n": Key(1024, POS_INT, "test samples for W2 / FID / bits/dim"),
    "steps": Key([10, 100], ListOf(EULER_STEPS), "Euler steps to evaluate at", opt_in=True),
    "seeds": Key(3, POS_INT, "sampling seeds: mean and spread"),
    "protocol": Key("qmc", Options("qmc", "iid"), "qmc = scrambled-Sobol source draws (2D: against stratified test "
                    "draws, a low W2 floor) | iid = i.i.d. source draws (2D: against i.i.d. test draws, a point file's "
                    "held-out rows): the draws a user makes (sinkflow sample draws i.i.d. unless sample.qmc)"),
    "class_n": Key(None, POS_INT, "generated samples per seed for the classifier's class-histogram TV and confidence "
                   "(null = eval.n): a perfect sampler's TV is ~1.2/sqrt(n) at 10 classes, 0.06 at n = 359",
                   nullable=True, when=IMAGES),
    "inception_weights": Key(None, Str(), "local Inception-v3 weights file (pt_inception-2015-12-05) for FID; "
                             "null = FID skipped", nullable=True, when=IMAGES),
}

CHECKPOINT = {
    "keep": Key(3, POS_INT, "keep-last-k rotation inside a phase"),
}

# Keys added with a default that changes what a run does: a run's config.yaml written before the key was added ran
# with this value, which ``read_run_config`` gives it (every other key is added with the default that keeps the
# behaviour before it).
# A ``*`` matches one level (each training phase). ``ema_warmup`` came in at 54b8e19 with the default true: a run made
# before it averaged without the warm-up, and a resume switched it on in silence (its samples moved: FD-CNN 17.11 ->
# 16.06 on a digits run resumed at step 243 of 400). ``sample.precision`` came in at caf769c (2026-11-26) with the
# default fp32, which became ``auto`` at 5e5c576: a run made before caf769c sampled in fp32, and an evaluation, or its
# NSGF++ states on a resume, on a CUDA card switched its UNet to fp16 in silence (a run made between the two wrote
# fp32 and kept it).
BEFORE_ADDED = {"data.holdout": "last_tenth", "train.*.ema_warmup": False, "sample.precision": "fp32"}

# Shared sections in order: (doc, keys). The methods' own sections go before ``model``.
SHARED: dict[str, tuple[str, dict[str, Key]]] = {
    "experiment": ("what runs, where it writes", EXPERIMENT),
    "data": ("source and target distributions", DATA),
    "sinkhorn": ("GeomLoss SamplesLoss(loss=\"sinkhorn\", p=2) of the pool's Sinkhorn flow",
                 {k: replace(v, opt_in=True) for k, v in SINKHORN.items()}),
    "pool": ("NSGF trajectory pool (Algorithm 1)",
             {k: replace(v, opt_in=True) for k, v in POOL_KEYS.items()}),
    "nsgf": ("how the velocity network reads the pool (NSGF, and NSGF++'s NSGF phase): docs/nsgf.md",
             {k: replace(v, opt_in=True) for k, v in NSGF.items()}),
    "sample": ("sampling", SAMPLE),
    "eval": ("evaluation", EVAL),
    "checkpoint": ("checkpoints", CHECKPOINT),
}


# ---- methods: each declares its phases, its own keys and the opt-in shared keys it reads -------------------

@dataclass(frozen=True)
class MethodSpec:
    """What the config needs to know of a method, without importing it (config sits below the methods).

    ``where``: ``"module:attribute"`` of its ``Method`` instance (``module`` relative to ``sinkflow.methods``
    unless it holds a dot). ``phases``: the names its ``phases()`` returns, in order; a training phase has
    sections ``model.<name>`` / ``train.<name>`` (shared ``PHASES`` or its own ``new_phases``). ``reads``: the
    opt-in shared keys it reads, as sections (``"pool"``) or keys (``"sample.steps"``). ``keys``: its own keys,
    ``{section: {name: Key}}``, read by it alone (a new section needs a line in ``section_docs``). ``images_only``:
    it models (C, H, W) images, so a built-in 2D target is refused when the config resolves (a point file's
    shape is known only once it is read: the method's own check). ``doc``: one line of what it trains, its row in
    docs/config.md's method table."""

    where: str
    phases: tuple[str, ...]
    reads: tuple[str, ...] = ()
    images_only: bool = False
    keys: dict[str, dict[str, Key]] = field(default_factory=dict)
    new_phases: dict[str, Phase] = field(default_factory=dict)
    section_docs: dict[str, str] = field(default_factory=dict)
    doc: str = ""


NSGF_READS = ("pool", "sinkhorn", "nsgf")
EULER_READS = ("sample.steps", "sample.time_warp", "eval.steps", "sample.compile", "sample.precision")

# The one method registry: adding a method is its file plus one entry here.
METHOD_REGISTRY: dict[str, MethodSpec] = {
    "nsgf": MethodSpec("nsgf:METHOD", ("pool", "velocity"), NSGF_READS + EULER_READS,
                       doc="Neural Sinkhorn Gradient Flow: a Sinkhorn-flow trajectory pool, then velocity matching"),
    "nsgfpp": MethodSpec(
        "nsgfpp:METHOD", ("pool", "velocity", "nsf", "time"), NSGF_READS + ("sample.compile", "sample.precision"),
        keys={
            "nsgf": {
                "nsf_pairs": Key("independent", Options("independent", "ot"), "NSGF++'s straight flow and time "
                                 "predictor pair their source and target samples independently (paper) or by an "
                                 "exact minibatch OT plan (as OT-CFM)"),
                "nsf_init": Key("random", Options("random", "velocity"), "NSGF++'s straight flow starts from a "
                                "fresh init (paper) or from the trained velocity network's weights (needs model.nsf "
                                "equal to model.velocity)"),
                "nsf_t_min": Key(0.0, Float(0, 1, hi_open=True), "NSGF++'s straight flow is trained on times t ~ "
                                 "U[nsf_t_min, 1): it only runs from the predictor's t_hat to 1, so 0 (paper) spends "
                                 "most of its steps on times it never sees"),
                "nsf_source": Key("noise", Options("noise", "velocity"), "where NSGF++'s straight-flow and "
                                  "predictor paths start: source noise (paper) or the trained velocity network's own "
                                  "NSGF states from fresh noise (near the authors' dev code: the straight flow then "
                                  "learns the way from where the NSGF part really ends; needs nsgf.nsf_t_min=0)"),
                "nsf_states": Key(16384, POS_INT, "with nsgf.nsf_source=velocity: how many NSGF states are computed "
                                  "once when the straight-flow phase starts (RUN/nsf_states.npy, float32)"),
            },
            "sample": {
                "nsf_steps": Key(50, EULER_STEPS, "Euler steps of the straight flow from t_hat to 1"),
                "nsgf_steps": Key(None, EULER_STEPS, "Euler steps of the NSGF part (null or pool.steps: the pool's own "
                                  "grid; else uniform steps, needs nsgf.segment > 0)", nullable=True),
                "t_shift": Key(0.0, Float(-1, 1), "added to the time predictor's t_hat before the straight flow "
                               "starts (then clamped to [nsgf.nsf_t_min, 1]): 0 is the paper's Algorithm 4; < 0 starts "
                               "it earlier, so it corrects more of the NSGF part's error (a velocity network short of "
                               "its budget leaves states the predictor places late; benchmarks/RESULTS.md)"),
            },
        },
        new_phases={
            "nsf": Phase("velocity", "mlp", "NSGF++ Neural Straight Flow u_delta(x, t)",
                         "NSGF++ straight flow (velocity matching on X_t = t Y + (1-t) X0)"),
            "time": Phase("time", "time_predictor", "NSGF++ phase-transition time predictor t_phi(x) in [0, 1]",
                          "NSGF++ time predictor (regress t from X_t, MSE); paper: batch 128, lr 1e-4, 40k",
                          {"iters": 40000, "batch_size": 128, "lr": 0.0001}),
        },
        doc="NSGF++: a <=5-step NSGF, a time predictor, then a Neural Straight Flow"),
    "fm": MethodSpec("flow_matching:FM", ("velocity",), EULER_READS,
                     doc="flow matching, independent pairs"),
    "otcfm": MethodSpec("flow_matching:OTCFM", ("velocity",), EULER_READS,
                        doc="OT-CFM, exact minibatch OT pairs"),
    "flow": MethodSpec(
        "normalizing_flow:METHOD", ("flow",), images_only=True,
        keys={"sample": {"temperature": Key(1.0, NONNEG_FLOAT, "prior std multiplier when sampling (1 = the model; "
                                                                "Glow shows 0.7)")}},
        new_phases={"flow": Phase("flow", "flow", "normalizing flow (docs/flows.md)",
                                  "maximum likelihood with uniform dequantisation; the logged loss is bits/dim",
                                  {"batch_size": 64, "warmup": 500, "schedule": "constant", "grad_clip": 100.0})},
        doc="a normalizing flow (Glow / RealNVP) by maximum likelihood"),
}


# ---- the schema, assembled from the shared declarations and the registry ------------------------------------

@dataclass(frozen=True)
class ModelSection:
    """``model.<phase>``: a ``kind`` (one of ``kinds``) and that kind's keys."""

    kinds: tuple[str, ...]
    doc: str
    when: When

    @property
    def default_kind(self) -> str:
        return self.kinds[0]

    def kind_key(self) -> Key:
        return Key(self.default_kind, Options(*self.kinds), "network kind; the other keys of this section are "
                   "this kind's", when=self.when)

    def keys(self, kind: str) -> dict[str, Key]:
        return {"kind": self.kind_key(), **{k: _with_when(v, self.when) for k, v in MODEL_KINDS[kind].items()}}


def _readers_when(readers: list[str]) -> When:
    names = tuple(readers)
    return When(f"method {', '.join(names)}", lambda t: _method(t) in names)


def _reads(spec: MethodSpec, section: str, name: str) -> bool:
    return section in spec.reads or f"{section}.{name}" in spec.reads


def _assemble() -> None:
    """Build ``SECTIONS``, ``MODEL``, ``TRAIN`` and friends from ``SHARED``, ``PHASES`` and ``METHOD_REGISTRY``.

    Which methods read a key is decided here, once, from the declarations: a shared key every method, an
    opt-in key the methods whose ``reads`` name it, a method's own key that method; no method is named."""
    global SECTIONS, MODEL, TRAIN, TRAIN_DOCS, PHASE_WHEN, METHOD_PHASES, METHODS
    registry = METHOD_REGISTRY
    METHOD_PHASES = {m: spec.phases for m, spec in registry.items()}
    METHODS = tuple(registry)
    phases: dict[str, Phase] = dict(PHASES)
    for spec in registry.values():
        for name, phase in spec.new_phases.items():
            if phases.setdefault(name, phase) != phase:
                raise ValueError(f"phase {name!r} is declared twice with different sections")
    sections: dict[str, tuple[str, dict[str, Key]]] = {s: (doc, dict(keys)) for s, (doc, keys) in SHARED.items()
                                                       if s not in ("sample", "eval", "checkpoint")}
    owned: dict[str, dict[str, str]] = {}
    for m, spec in registry.items():
        for section, keys in spec.keys.items():
            if section not in sections and section not in SHARED:
                sections[section] = (spec.section_docs.get(section, section), {})
            for k in keys:
                owned.setdefault(section, {})[k] = m
    for s in ("sample", "eval", "checkpoint"):
        doc, keys = SHARED[s]
        sections[s] = (doc, dict(keys))
    for m, spec in registry.items():
        for section, keys in spec.keys.items():
            sections[section][1].update(keys)
    readers: dict[str, tuple[str, ...] | None] = {}
    out: dict[str, tuple[str, dict, When | None]] = {}
    for section, (doc, keys) in sections.items():
        composed = {}
        for k, key in keys.items():
            owner = owned.get(section, {}).get(k)
            if owner is not None:  # another method may name it in ``reads``, but not by its section
                who = [owner] + [m for m, spec in registry.items() if m != owner and f"{section}.{k}" in spec.reads]
            elif key.opt_in:
                who = [m for m, spec in registry.items() if _reads(spec, section, k)]
            else:
                who = None
            readers[f"{section}.{k}"] = tuple(who) if who is not None else None
            composed[k] = key if who is None else _with_when(key, _readers_when(who))
        who_all = [readers[f"{section}.{k}"] for k in keys]
        when = None  # the section's own "read when" (docs): only where no key of it is read by every method
        if who_all and all(w is not None for w in who_all):
            when = _readers_when([m for m in registry if any(m in w for w in who_all)])
        out[section] = (doc, composed, when)
    MODEL = {}
    TRAIN = {}
    TRAIN_DOCS = {}
    for name, phase in phases.items():
        users = [m for m, spec in registry.items() if name in spec.phases]
        when = _readers_when(users)
        MODEL[name] = ModelSection(kinds_of(phase.role, phase.kind), phase.doc, when)
        TRAIN[name] = _train(**phase.train)
        TRAIN_DOCS[name] = phase.train_doc
    PHASE_WHEN = {name: sec.when for name, sec in MODEL.items()}
    order = [s for s in out if s not in ("sample", "eval", "checkpoint")]
    SECTIONS = {s: out[s] for s in order}
    SECTIONS["model"] = ("one network per training phase; its keys depend on its kind", MODEL, None)
    SECTIONS["train"] = ("one optimiser setup per training phase", TRAIN, None)
    for s in ("sample", "eval", "checkpoint"):
        SECTIONS[s] = out[s]
    EXPERIMENT["method"] = Key(EXPERIMENT["method"].default, Options(*METHODS), EXPERIMENT["method"].doc)
    SECTIONS["experiment"] = (SECTIONS["experiment"][0], dict(EXPERIMENT), None)


SECTIONS: dict[str, tuple[str, dict, When | None]] = {}
MODEL: dict[str, ModelSection] = {}
TRAIN: dict[str, dict[str, Key]] = {}
TRAIN_DOCS: dict[str, str] = {}
PHASE_WHEN: dict[str, When] = {}
METHOD_PHASES: dict[str, tuple[str, ...]] = {}
METHODS: tuple[str, ...] = ()
_assemble()


def register_method(name: str, spec: MethodSpec) -> None:
    """Add a method at run time (a plugin, a test): the schema, ``sinkflow config`` and validation follow.

    A method shipped with sinkflow is an entry of ``METHOD_REGISTRY`` instead (one line)."""
    METHOD_REGISTRY[name] = spec
    _assemble()


def unregister_method(name: str) -> None:
    METHOD_REGISTRY.pop(name, None)
    _assemble()


def _section_keys(section: str, tree: dict | None) -> dict[str, Key]:
    """Flat ``{"sub.key": Key}`` of one section for ``tree`` (model kinds read from it; defaults if None)."""
    _, keys, when = SECTIONS[section]
    out: dict[str, Key] = {}
    if section == "model":
        for phase, sec in keys.items():
            kind = _tree_kind(tree, phase)
            for k, key in sec.keys(kind if kind in sec.kinds else sec.default_kind).items():
                out[f"{phase}.{k}"] = key
    elif section == "train":
        for phase, sub in keys.items():
            for k, key in sub.items():
                out[f"{phase}.{k}"] = _with_when(key, PHASE_WHEN[phase])
    else:
        out.update(keys)
    return out


def _tree_kind(tree: dict | None, phase: str) -> str:
    try:
        return tree["model"][phase]["kind"]
    except (TypeError, KeyError):
        return MODEL[phase].default_kind


def keys(tree: dict | None = None) -> dict[str, Key]:
    """Every key of a config tree as ``{"section.sub.key": Key}``, in declaration order.

    Model sections list the keys of the kind ``tree`` gives them (the default kinds when ``tree`` is None)."""
    return {f"{s}.{k}": key for s in SECTIONS for k, key in _section_keys(s, tree).items()}


def all_keys() -> dict[str, Key]:
    """Every key of every model kind too: what a user can ever set (for did-you-mean hints and docs)."""
    out = keys()
    for phase, sec in MODEL.items():
        for kind in sec.kinds:
            for k, key in sec.keys(kind).items():
                out.setdefault(f"model.{phase}.{k}", key)
    return out


def defaults(tree: dict | None = None) -> dict:
    """The default tree (model sections of the kinds ``tree`` names, else the default kinds)."""
    out: dict = {}
    for name, key in keys(tree).items():
        node = out
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = _copy(key.default)
    return out


def model_defaults(kind: str) -> dict:
    """The defaults of one model kind, without ``kind``: what ``build_model`` fills in."""
    return {k: _copy(key.default) for k, key in MODEL_KINDS[kind].items()}


def _copy(value):
    return list(value) if isinstance(value, list) else value


def kinds_with(phase: str, name: str) -> list[str]:
    """The kinds of ``model.<phase>`` that have key ``name`` (for the hint of a key set on the wrong kind)."""
    return [k for k in MODEL[phase].kinds if name in MODEL_KINDS[k]]


def used(tree: dict) -> dict[str, Key]:
    """The keys a run of ``tree`` reads: its method's sections and phases, its model kinds, its data kind."""
    return {name: key for name, key in keys(tree).items() if key.when is None or key.when(tree)}
