"""Invertible layers with exact log-determinants: ActNorm, LU 1x1 convolution, squeeze.

Every layer maps ``x -> (y, logdet)`` with ``logdet`` of shape ``(N,)`` (log|det dy/dx| per sample) and has
an exact ``inverse(y) -> x``. Tensors are ``(N, C, H, W)``; vector data is carried as ``(N, D, 1, 1)``.

``rebuild(y)`` is what the constant-memory backward calls: it rebuilds the input from the output and re-runs
the forward *with* autograd so parameter and input gradients can be taken. The default is
inverse-then-forward; couplings override it to evaluate their conditioner only once.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn


class InvertibleLayer(nn.Module):
    """Base class: ``forward(x) -> (y, logdet)``, ``inverse(y) -> x``, ``rebuild(y)``."""

    #: True when ``inverse`` is exact in any precision (pure reshapes); the drift guard skips those.
    exact_inverse = False

    def inverse(self, y: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def drop_cache(self) -> None:
        """Forget values derived from the parameters. ``FlowSequence`` calls it at the start of every pass,
        because a fused optimizer step (``Adam(fused=True)``, the Trainer's kernel) writes the
        parameters without moving their version counter: a cache keyed on that counter alone served the first
        step's 1x1-conv weights to every later step."""

    def rebuild(self, y: torch.Tensor):
        """Rebuild the input from ``y`` and re-run forward with grad.

        Returns ``(x, leaves, y_re, logdet_re)``: ``x`` the rebuilt input (no graph), ``leaves`` the tensors
        that require grad and whose channel-wise concatenation is the input, ``y_re``/``logdet_re`` the
        re-run forward attached to ``leaves`` and the parameters.
        """
        with torch.no_grad():
            x = self.inverse(y)
        leaf = x.detach().requires_grad_(True)
        with torch.enable_grad():
            y_re, ld_re = self(leaf)
        return x, [leaf], y_re, ld_re

    #: Layers that compute their own backward set this and implement ``grad_from_output``: the
    #: constant-memory backward then skips the generic re-forward + ``autograd.grad`` for them (ActNorm and
    #: the 1x1 conv in closed form; couplings by hand around a single autograd call on their conditioner).
    direct_grad = False

    def grad_from_output(self, y, g_y, g_logdet):  # pragma: no cover - abstract
        """``(x, g_x, grads)``: the rebuilt input, its gradient and ``{param: grad}`` (no autograd)."""
        raise NotImplementedError


def _per_sample(value: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Broadcast a scalar log-det to shape (N,)."""
    return value.expand(x.shape[0])


class ActNorm(InvertibleLayer):
    """Per-channel affine ``y = (x + b) * exp(s)`` with data-dependent init (Glow).

    The first batch seen sets ``b, s`` so the output has zero mean and unit variance per channel. The
    ``initialized`` flag is a registered buffer, so it is saved in ``state_dict`` and a loaded model does
    *not* re-initialise on its next batch (the bug several flow libraries shipped).
    """

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.bias = nn.Parameter(torch.zeros(1, channels, 1, 1))
        self.log_scale = nn.Parameter(torch.zeros(1, channels, 1, 1))
        self.register_buffer("initialized", torch.tensor(False))
        self._init_seen = False  # host-side mirror of the buffer: avoids a GPU sync on every forward

    def _load_from_state_dict(self, *args, **kwargs):
        self._init_seen = False  # re-read the loaded buffer on the next forward
        super()._load_from_state_dict(*args, **kwargs)

    MIN_STD = 1e-4  # below it a channel's spread says nothing (dequantisation noise alone is ~1e-3 at 256 bins)

    @torch.no_grad()
    def initialize(self, x: torch.Tensor) -> None:
        """Zero mean, unit variance per channel over the first batch; a channel whose values do not spread (one value
        per channel: a batch of 1 at a 1x1 level) keeps scale 1: ``-log(0 + eps)`` = 13.8 scaled it by 1e6, logged
        -2 bits/dim on the first step and diverged on the next."""
        mean = x.mean(dim=(0, 2, 3), keepdim=True)
        std = x.std(dim=(0, 2, 3), keepdim=True, unbiased=False)
        self.bias.copy_(-mean)
        self.log_scale.copy_(torch.where(std > self.MIN_STD, -torch.log(std + self.eps), torch.zeros_like(std)))
        self.initialized.fill_(True)

    def forward(self, x):
        if not self._init_seen:
            if not bool(self.initialized):
                self.initialize(x)
            self._init_seen = True
        y = (x + self.bias) * torch.exp(self.log_scale)
        logdet = x.shape[2] * x.shape[3] * self.log_scale.sum()
        return y, _per_sample(logdet, x)

    def inverse(self, y):
        return y * torch.exp(-self.log_scale) - self.bias

    direct_grad = True

    @torch.no_grad()
    def grad_from_output(self, y, g_y, g_logdet):
        """``y = (x + b) e^s``: ``dL/dx = g e^s``, ``dL/db = sum g e^s``, ``dL/ds = sum g y + H W sum g_logdet``."""
        scale = torch.exp(self.log_scale)
        x = y / scale - self.bias
        g_x = g_y * scale
        g_s = (g_y * y).sum(dim=(0, 2, 3), keepdim=True) + y.shape[2] * y.shape[3] * g_logdet.sum()
        return x, g_x, {self.bias: g_x.sum(dim=(0, 2, 3), keepdim=True), self.log_scale: g_s}


class InvConv1x1(InvertibleLayer):
    """Invertible 1x1 convolution, LU-parameterised (Glow): ``W = P L (U + diag(sign(s) exp(log|s|)))``.

    ``P`` and ``sign(s)`` are fixed buffers; log|det W| = sum(log|s|) costs O(C). Initialised from a random
    rotation. The inverse weight is computed in float64 and cast back, which keeps float32 reconstruction
    close to exact for moderately conditioned ``W``. Parameters and buffers take torch's default dtype, as every
    other layer's do: hard float32 factors beside a float64 mask made a flow built under
    ``torch.set_default_dtype(torch.float64)`` fail its first forward (``float != double``).
    """

    def __init__(self, channels: int):
        super().__init__()
        dtype = torch.get_default_dtype()
        w = torch.linalg.qr(torch.randn(channels, channels, dtype=torch.float64))[0]
        p, lower, upper = torch.linalg.lu(w)
        s = torch.diagonal(upper)
        self.register_buffer("perm", p.to(dtype))
        self.register_buffer("sign_s", torch.sign(s).to(dtype))
        self.register_buffer("lower_mask", torch.tril(torch.ones(channels, channels, dtype=dtype), -1))
        self.lower = nn.Parameter(lower.to(dtype))
        self.upper = nn.Parameter(torch.triu(upper, 1).to(dtype))
        self.log_s = nn.Parameter(torch.log(torch.abs(s)).to(dtype))
        self._eye_cache = None
        self._fcache = None

    def drop_cache(self) -> None:
        self._fcache = None

    def _eye(self) -> torch.Tensor:
        eye = self._eye_cache
        if eye is None or eye.dtype != self.lower.dtype or eye.device != self.lower.device:
            eye = self._eye_cache = torch.eye(self.lower.shape[0], dtype=self.lower.dtype, device=self.lower.device)
        return eye

    def _factors(self):
        """``(P L, U, sign(s) e^log|s|, W)``. Without grad they are cached for one pass of the chain (dropped by
        ``drop_cache``, and whenever a parameter's version counter moves: an in-place update, a load), so the
        constant-memory backward reuses the forward's ``W`` and the float64 inverse is built once per step."""
        grad = torch.is_grad_enabled()
        key = None
        if not grad:
            key = (torch.is_autocast_enabled(self.lower.device.type),
                   *((p._version, p.data_ptr(), p.dtype) for p in (self.lower, self.upper, self.log_s)))
            if self._fcache is not None and self._fcache[0] == key:
                return self._fcache[1]
        lower = self.lower * self.lower_mask + self._eye()
        s_diag = self.sign_s * torch.exp(self.log_s)
        upper = self.upper * self.lower_mask.T + torch.diag(s_diag)
        pl = self.perm @ lower
        out = [pl, upper, s_diag, pl @ upper, None]  # the last slot: the inverse, filled on demand
        if not grad:
            self._fcache = (key, out)
        return out

    def weight(self) -> torch.Tensor:
        return self._factors()[3]

    def _inverse_weight(self) -> torch.Tensor:
        with torch.no_grad():
            f = self._factors()
            if f[4] is None:
                f[4] = self._inv(f[3])
            return f[4]

    @staticmethod
    def _mix(w, x):
        """1x1 conv as a channel matmul: full float32 on GPUs, where cuDNN convs may run in TF32."""
        return (w @ x.reshape(x.shape[0], x.shape[1], -1)).view(x.shape)

    @staticmethod
    def _inv(w):
        # float64 inverse; inv_ex skips the singularity check (a host sync on GPUs)
        return torch.linalg.inv_ex(w.detach().double())[0].to(w.dtype)

    def forward(self, x):
        y = self._mix(self.weight(), x)
        logdet = x.shape[2] * x.shape[3] * self.log_s.sum()
        return y, _per_sample(logdet, x)

    def inverse(self, y):
        return self._mix(self._inverse_weight(), y)

    def rebuild(self, y):
        """Build ``W`` once (with grad) for both the inverse and the re-run forward."""
        with torch.enable_grad():
            w = self.weight()
        with torch.no_grad():
            x = self._mix(self._inv(w), y)
        leaf = x.detach().requires_grad_(True)
        with torch.enable_grad():
            y_re = self._mix(w, leaf)
            logdet = _per_sample(y.shape[2] * y.shape[3] * self.log_s.sum(), y)
        return x, [leaf], y_re, logdet

    direct_grad = True

    @torch.no_grad()
    def grad_from_output(self, y, g_y, g_logdet):
        """``y = W x`` with ``W = P L U``: ``dL/dx = W^T g``, ``dL/dW = sum_n g x^T``, then through the LU
        factors: ``dL/dL = P^T G U^T`` (strictly lower part), ``dL/dU = (P L)^T G`` (strictly upper part; its
        diagonal gives ``dL/dlog|s| = diag * sign(s) e^log|s| + H W sum g_logdet``)."""
        pl, upper, s_diag, w, _ = self._factors()
        n, c = y.shape[:2]
        yf, gf = y.reshape(n, c, -1), g_y.reshape(n, c, -1)
        x = self._inverse_weight() @ yf
        g_x = w.T @ gf
        g_w = torch.matmul(gf, x.transpose(1, 2)).sum(0)
        g_upper_full = pl.T @ g_w
        g_lower = (self.perm.T @ g_w @ upper.T) * self.lower_mask
        g_log_s = torch.diagonal(g_upper_full) * s_diag + y.shape[2] * y.shape[3] * g_logdet.sum()
        return (x.view(y.shape), g_x.view(y.shape),
                {self.lower: g_lower, self.upper: g_upper_full * self.lower_mask.T, self.log_s: g_log_s})


class Squeeze(InvertibleLayer):
    """Space-to-depth: ``(N, C, H, W) -> (N, 4C, H/2, W/2)``; volume preserving (logdet 0)."""

    exact_inverse = True

    def forward(self, x):
        n, c, h, w = x.shape
        y = x.reshape(n, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(n, 4 * c, h // 2, w // 2)
        return y, x.new_zeros(n)

    def inverse(self, y):
        n, c, h, w = y.shape
        x = y.reshape(n, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(n, c // 4, 2 * h, 2 * w)
        return x


class Logit(InvertibleLayer):
    """RealNVP's logit preprocessing of model-space pixels ``z`` in [-0.5, 0.5):

        p = alpha + (1 - 2 alpha) (z + 0.5),   y = log p - log(1 - p),
        log|dy/dz| = log(1 - 2 alpha) - log p - log(1 - p)   per dimension.

    A fixed bijection from the bounded pixel cube to all of R^D, so the flow never has to model the cube's
    hard walls (where most digit pixels sit, at level 0). The log-det is exact and part of ``log_prob``, so the
    bits/dim convention is unchanged. No parameters.
    """

    def __init__(self, alpha: float = 1e-3):
        super().__init__()
        self.alpha = float(alpha)

    def forward(self, x):
        p = self.alpha + (1 - 2 * self.alpha) * (x + 0.5)
        log_p, log_q = torch.log(p), torch.log1p(-p)
        ld = (math.log1p(-2 * self.alpha) - log_p - log_q).flatten(1).sum(1)
        return log_p - log_q, ld

    def inverse(self, y):
        return (torch.sigmoid(y) - self.alpha) / (1 - 2 * self.alpha) - 0.5
