"""Multi-scale flow models (Glow, RealNVP-style) and builders, including ``build_flow(cfg, sample_shape)``.

Structure (Glow): for each level, ``[squeeze, K x (ActNorm, InvConv1x1, coupling)]`` then, except at the last
level, a split that factors out half the channels as a latent scored by a Gaussian prior conditioned on
the kept half (Glow's ``split2d``) or by N(0, I). The last level's output is scored by a learned diagonal
Gaussian (Glow's ``learntop``) or N(0, I).

Each level's chain of layers is a :class:`FlowSequence`, so the memory mode applies per level. In
``invertible`` mode a level stores its input and output only; the factored-out halves are slices of the
stored output, so total activation memory is about (input + sum of level outputs), independent of depth.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from sinkflow.config.schema import MODEL_KINDS, model_defaults
from sinkflow.config.checks import is_real, is_whole, shown
from sinkflow.data.base import check_sample_size
from sinkflow.errors import SinkflowError, require
from sinkflow.flows.coupling import SCALE_MAPS, AdditiveCoupling, AffineCoupling
from sinkflow.flows.layers import ActNorm, InvConv1x1, Logit, Squeeze
from sinkflow.flows.memory_modes import FlowSequence, check_memory_mode

LOG_2PI = math.log(2 * math.pi)


def gaussian_log_prob(z, mean, log_std):
    """Sum over all but the batch dim of log N(z; mean, exp(log_std)^2)."""
    lp = -0.5 * (LOG_2PI + 2 * log_std + ((z - mean) * torch.exp(-log_std)) ** 2)
    return lp.flatten(1).sum(1)


class Split(nn.Module):
    """Factor-out: keep the first ``C - C//2`` channels, emit the rest as a latent with its log-prior."""

    def __init__(self, channels: int, learned_prior: bool = True, kernel: int = 3):
        super().__init__()
        self.c_out = channels // 2
        self.c_keep = channels - self.c_out
        self.prior = None
        if learned_prior:
            self.prior = nn.Conv2d(self.c_keep, 2 * self.c_out, kernel, padding=kernel // 2)
            nn.init.zeros_(self.prior.weight)
            nn.init.zeros_(self.prior.bias)

    def _prior(self, z1):
        if self.prior is None:
            shape = (z1.shape[0], self.c_out, *z1.shape[2:])
            zero = z1.new_zeros(shape)
            return zero, zero
        h = self.prior(z1)
        return h[:, 0::2], h[:, 1::2]

    def forward(self, x):
        z1, z2 = x[:, : self.c_keep], x[:, self.c_keep:]
        mean, log_std = self._prior(z1)
        return z1, z2, gaussian_log_prob(z2, mean, log_std)

    def inverse(self, z1, z2=None, temperature: float = 1.0, generator=None):
        if z2 is None:
            mean, log_std = self._prior(z1)
            eps = normal_noise(mean.shape, mean, generator)
            z2 = mean + temperature * torch.exp(log_std) * eps
        return torch.cat([z1, z2], dim=1)


def normal_noise(shape, like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """N(0, I) noise of ``shape`` in ``like``'s dtype on its device, drawn on the ``generator``'s device: torch refuses
    a CPU generator for CUDA tensors, and a seeded CPU generator gives the same samples whatever the model's device
    (``losses.dequantize`` draws its noise so too)."""
    device = generator.device if generator is not None else like.device
    return torch.randn(shape, generator=generator, device=device, dtype=like.dtype).to(like.device)


class TopPrior(nn.Module):
    """Diagonal Gaussian on the last latent: learned mean/log-std (zero-initialised) or N(0, I)."""

    def __init__(self, shape, learned: bool = True):
        super().__init__()
        if learned:
            self.mean = nn.Parameter(torch.zeros(1, *shape))
            self.log_std = nn.Parameter(torch.zeros(1, *shape))
        else:
            self.register_buffer("mean", torch.zeros(1, *shape))
            self.register_buffer("log_std", torch.zeros(1, *shape))

    def log_prob(self, z):
        return gaussian_log_prob(z, self.mean, self.log_std)

    def sample(self, n: int, temperature: float = 1.0, generator=None):
        eps = normal_noise((n, *self.mean.shape[1:]), self.mean, generator)
        return self.mean + temperature * torch.exp(self.log_std) * eps


class FlowModel(nn.Module):
    """Multi-scale normalizing flow.

    ``forward(x) -> (zs, log_prob)``: latents (factored-out ones first, the top one last) and the exact
    log-density of ``x`` (shape ``(N,)``). ``log_prob(x)``, ``inverse(zs)``, ``sample(n, temperature)``.
    ``x`` has shape ``(N, *in_shape)``; vector data ``(N, D)`` is carried internally as ``(N, D, 1, 1)``.
    """

    def __init__(self, in_shape, levels: list[FlowSequence], splits: list[Split], top: TopPrior,
                 pre: nn.Module | None = None):
        super().__init__()
        self.in_shape = tuple(in_shape)
        self.pre = pre  # a fixed bijection applied before the levels (Logit), or None
        self.levels = nn.ModuleList(levels)
        self.splits = nn.ModuleList(splits)
        self.top = top
        for i, seq in enumerate(self.levels):
            seq._flow_name = f"levels.{i}"

    # -- memory mode / drift reporting ---------------------------------------------------------
    @property
    def memory(self) -> str:
        return self.levels[0].memory

    def set_memory(self, mode: str, drift_tol: float | None = None) -> "FlowModel":
        check_memory_mode(mode)
        for seq in self.levels:
            seq.memory = mode
            if drift_tol is not None:
                seq.drift_tol = float(drift_tol)
        return self

    @property
    def fallen_back(self) -> list[str]:
        """Layers the drift guard switched to storing their input (survives save/load)."""
        return [f"levels.{i}.layers.{j} ({type(seq.layers[j]).__name__})"
                for i, seq in enumerate(self.levels) for j in seq.keep_input.nonzero().flatten().tolist()]

    @property
    def drift_events(self) -> list[dict]:
        return [e for seq in self.levels for e in seq.drift_events]

    @property
    def max_drift(self) -> float:
        return max(seq.max_drift for seq in self.levels)

    def drift_state(self) -> dict:
        """The drift guard's counts per level, for a step checkpoint: they live in memory, while the layers it made
        fall back are buffers the weights keep (``keep_input``)."""
        return {"drift_events": [list(seq.drift_events) for seq in self.levels],
                "max_drift": [float(seq.max_drift) for seq in self.levels]}

    def load_drift_state(self, state: dict) -> None:
        """Put back ``drift_state``'s counts (a resume); an empty ``state`` (a checkpoint without them) keeps these."""
        for seq, events, worst in zip(self.levels, state.get("drift_events", []), state.get("max_drift", [])):
            seq.drift_events, seq.max_drift = list(events), float(worst)

    # -- density -------------------------------------------------------------------------------
    def _to4d(self, x):
        if x.shape[1:] != self.in_shape:
            raise SinkflowError(f"flow input has shape {tuple(x.shape[1:])}, model expects {self.in_shape}",
                                "build the flow with the data's sample shape")
        return x.reshape(x.shape[0], -1, 1, 1) if len(self.in_shape) == 1 else x

    def encode(self, x):
        """Return ``(zs, logdet, log_prior)``: the change-of-variables pieces, kept apart for tests."""
        h = self._to4d(x)
        zs, logdet, log_prior = [], 0.0, 0.0
        if self.pre is not None:
            h, logdet = self.pre(h)
        for i, seq in enumerate(self.levels):
            h, ld = seq(h)
            logdet = logdet + ld
            if i < len(self.splits):
                h, z, lp = self.splits[i](h)
                zs.append(z)
                log_prior = log_prior + lp
        zs.append(h)
        return zs, logdet, log_prior + self.top.log_prob(h)

    def forward(self, x):
        zs, logdet, log_prior = self.encode(x)
        return zs, log_prior + logdet

    def log_prob(self, x):
        return self.forward(x)[1]

    def inverse(self, zs, temperature: float = 1.0, generator=None):
        """Map latents back to data. Missing factored-out latents (``None``) are sampled from their prior."""
        h = zs[-1]
        for i in reversed(range(len(self.levels))):
            if i < len(self.splits):
                h = self.splits[i].inverse(h, zs[i], temperature, generator)
            h = self.levels[i].inverse(h)
        return self.unpre(h)

    def unpre(self, h):
        """The last step of every inverse: undo ``pre`` and restore the sample shape."""
        if self.pre is not None:
            h = self.pre.inverse(h)
        return h.reshape(h.shape[0], *self.in_shape)

    @torch.no_grad()
    def sample(self, n: int, temperature: float = 1.0, generator=None):
        """Draw ``n`` samples; ``temperature`` scales every prior's std (Glow uses ~0.7 for images). ``n`` < 1 is
        refused as every sampler refuses it (``check_sample_size``), not left to fail as a reshape of 0 elements."""
        check_sample_size(n)
        require(is_real(temperature) and temperature >= 0, f"temperature must be a number >= 0, got {shown(temperature)}",
                "e.g. temperature=0.7 (Glow's) or 1 (the model's own prior)")  # NaN drew NaN images, < 0 flipped z
        z_top = self.top.sample(n, temperature, generator)
        return self.inverse([None] * len(self.splits) + [z_top], temperature, generator)


# -- builders ----------------------------------------------------------------------------------

def _level_shapes(in_shape, levels: int, squeeze: bool):
    """(channels, H, W) after the squeeze of each level, validating divisibility."""
    vector = len(in_shape) == 1
    if vector:
        c, h, w, squeeze = in_shape[0], 1, 1, False  # nothing to squeeze: model.flow.squeeze is ignored
    elif len(in_shape) == 3:
        c, h, w = in_shape
    else:
        raise SinkflowError(f"flow sample shape must be (C, H, W) or (D,), got {tuple(in_shape)}",
                            "reshape the data or pass its per-sample shape")
    require(levels >= 1, f"flow levels must be >= 1, got {levels}", "set levels: 1 or more")
    shapes = []
    for i in range(levels):
        if squeeze:
            require(h % 2 == 0 and w % 2 == 0,
                    f"flow level {i} cannot squeeze a {h}x{w} image (needs even sides)",
                    f"use fewer levels or a size divisible by 2**levels ({2 ** levels})")
            c, h, w = 4 * c, h // 2, w // 2
        require(c >= 2, f"flow level {i} has {c} channel(s); coupling needs >= 2",
                # a later level lost its channels to the split: squeezing then asks for sides divisible by 2**levels,
                # whose hint sent the user back here; fewer levels is the fix
                f"use {i} level(s)" if i else
                "set model.flow.squeeze=true (the squeeze makes 4 channels of each)" if not (squeeze or vector) else
                f"give the data 2 or more {'coordinates' if vector else 'channels'}")
        shapes.append((c, h, w))
        if i < levels - 1:
            c = c - c // 2
    return shapes, squeeze


def _build(in_shape, levels, depth_per_level, step, squeeze, prior, memory, drift_tol, checkpoint_segments,
           logit_alpha=0.0):
    require(depth_per_level >= 1, f"flow depth_per_level must be >= 1, got {depth_per_level}",
            "set depth_per_level: 1 or more")
    if prior not in ("learned", "standard"):
        raise SinkflowError(f"unknown flow prior {prior!r}", "use 'learned' or 'standard'")
    shapes, squeeze = _level_shapes(tuple(in_shape), levels, squeeze)
    seqs, splits = [], []
    for i, (c, h, w) in enumerate(shapes):
        kernel = 3 if h > 1 or w > 1 else 1
        layers = [Squeeze()] if squeeze else []
        for k in range(depth_per_level):
            layers += step(c, k, kernel)
        seqs.append(FlowSequence(layers, memory, drift_tol, checkpoint_segments))
        if i < levels - 1:
            splits.append(Split(c, learned_prior=prior == "learned", kernel=kernel))
    c, h, w = shapes[-1]
    require(0 <= logit_alpha < 0.5, f"flow logit_alpha must be in [0, 0.5), got {logit_alpha}",
            "use 0 (off) or a small value such as 0.001")
    pre = Logit(logit_alpha) if logit_alpha > 0 else None
    return FlowModel(in_shape, seqs, splits, TopPrior((c, h, w), learned=prior == "learned"), pre)


def build_glow(in_shape, levels: int = 3, depth_per_level: int = 8, hidden_channels: int = 64,
               coupling: str = "affine", *, scale: str = "sigmoid", prior: str = "learned",
               squeeze: bool = True, memory: str = "standard", drift_tol: float = 1e-4,
               checkpoint_segments: int | None = None, logit_alpha: float = 0.0) -> FlowModel:
    """Glow (Kingma & Dhariwal 2018): flow step = ActNorm -> LU 1x1 conv -> affine/additive coupling."""
    if coupling not in ("affine", "additive"):
        raise SinkflowError(f"unknown coupling {coupling!r}", "use 'affine' or 'additive'")
    cls = AffineCoupling if coupling == "affine" else AdditiveCoupling

    def step(c, k, kernel):
        return [ActNorm(c), InvConv1x1(c), cls(c, hidden_channels, kernel=kernel, scale=scale)]

    return _build(in_shape, levels, depth_per_level, step, squeeze, prior, memory, drift_tol,
                  checkpoint_segments, logit_alpha)


def build_realnvp(in_shape, levels: int = 2, depth_per_level: int = 4, hidden_channels: int = 64, *,
                  scale: str = "tanh", prior: str = "standard", squeeze: bool = True,
                  memory: str = "standard", drift_tol: float = 1e-4,
                  checkpoint_segments: int | None = None, logit_alpha: float = 0.0) -> FlowModel:
    """RealNVP-style (Dinh et al. 2017): ActNorm -> affine coupling, alternating halves, channel masks only.

    Differences from the paper: channel-wise masks instead of checkerboard ones, ActNorm instead of batch
    norm, and a small conv conditioner instead of a ResNet.
    """

    def step(c, k, kernel):
        return [ActNorm(c), AffineCoupling(c, hidden_channels, swap=k % 2 == 1, kernel=kernel, scale=scale)]

    return _build(in_shape, levels, depth_per_level, step, squeeze, prior, memory, drift_tol,
                  checkpoint_segments, logit_alpha)


# Keys and defaults of a flow, from the config schema (model kind "flow"; n_bins is the likelihood's, not the
# architecture's, so build_flow does not take it).
FLOW_DEFAULTS = {k: v for k, v in model_defaults("flow").items() if k != "n_bins"}


def build_flow(cfg: dict, sample_shape) -> FlowModel:
    """Build a flow from a plain config dict (keys and defaults: :data:`FLOW_DEFAULTS`) for samples shaped
    ``sample_shape`` ((C, H, W) or (D,), a tuple or list of whole numbers; numpy's count)."""
    from sinkflow.config import check_value

    require(isinstance(cfg, dict), f"build_flow's config is {type(cfg).__name__}, not a dict",
            "pass a dict of flow keys, e.g. {'levels': 2} ({} for the defaults)")
    require(isinstance(sample_shape, (tuple, list)) and all(is_whole(s) for s in sample_shape),
            f"build_flow's sample_shape is {shown(sample_shape)}, not a tuple of sizes",
            "pass the per-sample shape, e.g. (1, 28, 28) for images or (2,) for points")
    sample_shape = tuple(int(s) for s in sample_shape)
    unknown = sorted(set(cfg) - set(FLOW_DEFAULTS))
    if unknown:
        raise SinkflowError(f"unknown flow config key(s) {unknown}", f"valid keys: {sorted(FLOW_DEFAULTS)}")
    # each value against the config schema's type and range, as `sinkflow train` checks it: a string level count
    # was a TypeError, a negative width a RuntimeError, a negative drift_tol disabled invertible mode in silence
    c = {**FLOW_DEFAULTS, **{k: check_value(f"model.flow.{k}", MODEL_KINDS["flow"][k], v) for k, v in cfg.items()}}
    common = dict(squeeze=c["squeeze"], memory=c["memory"], drift_tol=c["drift_tol"],
                  checkpoint_segments=c["checkpoint_segments"], logit_alpha=float(c["logit_alpha"]))
    if c["scale"] is not None and c["scale"] not in SCALE_MAPS:
        raise SinkflowError(f"unknown coupling scale map {c['scale']!r}", f"use one of {SCALE_MAPS}")
    if c["arch"] == "glow":
        return build_glow(sample_shape, c["levels"], c["depth_per_level"], c["hidden_channels"], c["coupling"],
                          scale=c["scale"] or "sigmoid", prior=c["prior"] or "learned", **common)
    if c["arch"] == "realnvp":
        require(c["coupling"] == "affine", "realnvp uses affine couplings only", "set coupling: affine")
        return build_realnvp(sample_shape, c["levels"], c["depth_per_level"], c["hidden_channels"],
                             scale=c["scale"] or "tanh", prior=c["prior"] or "standard", **common)
    raise SinkflowError(f"unknown flow arch {c['arch']!r}", "use 'glow' or 'realnvp'")
