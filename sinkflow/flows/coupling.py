"""Affine and additive coupling layers (RealNVP / Glow).

The input is split along channels into a conditioning part ``xa`` (passed through unchanged) and a
transformed part ``xb``; a small conv net ``h = NN(xa)`` gives a shift and (affine only) a log-scale:

    affine:   yb = (xb + shift) * scale,   logdet = sum(log scale)
    additive: yb =  xb + shift,            logdet = 0

Scale maps (bounded on purpose: an unbounded ``exp`` overflows and its inverse explodes):

- ``"sigmoid"`` (Glow): ``scale = sigmoid(raw + 2)`` in (0, 1), ~0.88 at init. Forward-contractive, so the
  *inverse* expands; the drift guard watches for that.
- ``"tanh"`` (RealNVP-style soft clamp): ``log scale = clamp * tanh(raw / clamp)``, scale in
  [e^-clamp, e^clamp] (clamp 2 by default).

The last conv of ``NN`` is zero-initialised, so every coupling starts as (almost) the identity.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from sinkflow.errors import SinkflowError
from sinkflow.flows.layers import InvertibleLayer

SCALE_MAPS = ("sigmoid", "tanh")


class ConditionerNet(nn.Sequential):
    """conv k -> ReLU -> conv 1x1 -> ReLU -> zero-initialised conv k (Glow's coupling network)."""

    def __init__(self, c_in: int, c_out: int, hidden: int, kernel: int = 3):
        pad = kernel // 2
        last = nn.Conv2d(hidden, c_out, kernel, padding=pad)
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)
        super().__init__(
            nn.Conv2d(c_in, hidden, kernel, padding=pad), nn.ReLU(),
            nn.Conv2d(hidden, hidden, 1), nn.ReLU(), last,
        )
        self.pad = pad

    @property
    def param_list(self) -> list[nn.Parameter]:
        """The three convs' (weight, bias), read from the modules each time (never a stale copy after a
        ``to()``, a ``load_state_dict`` or a deepcopy)."""
        m = self._modules
        return [m["0"].weight, m["0"].bias, m["2"].weight, m["2"].bias, m["4"].weight, m["4"].bias]

    def functional(self, x):
        """The same net without ``nn.Module`` call overhead (no hooks): the constant-memory backward re-runs
        every conditioner once per step, and at small sizes the per-module dispatch is a visible share."""
        w0, b0, w1, b1, w2, b2 = self.param_list
        h = F.relu(F.conv2d(x, w0, b0, padding=self.pad))
        h = F.relu(F.conv2d(h, w1, b1))
        return F.conv2d(h, w2, b2, padding=self.pad)


class _Coupling(InvertibleLayer):
    affine = True

    def __init__(self, channels: int, hidden: int, swap: bool = False, kernel: int = 3,
                 scale: str = "sigmoid", clamp: float = 2.0):
        super().__init__()
        if channels < 2:
            raise SinkflowError(f"coupling layer needs at least 2 channels, got {channels}",
                                "squeeze first or use more input channels")
        if scale not in SCALE_MAPS:
            raise SinkflowError(f"unknown coupling scale map {scale!r}", f"use one of {SCALE_MAPS}")
        self.c_first = channels // 2
        self.swap = swap  # False: condition on the first half; True: on the second half
        self.scale_map, self.clamp = scale, clamp
        c_cond = channels - self.c_first if swap else self.c_first
        c_act = channels - c_cond
        self.c_act = c_act
        self.net = ConditionerNet(c_cond, c_act * (2 if self.affine else 1), hidden, kernel)

    # -- channel bookkeeping -------------------------------------------------------------------
    def _split(self, x):
        a, b = x[:, : self.c_first], x[:, self.c_first:]
        return (b, a) if self.swap else (a, b)  # (cond, act)

    def _merge(self, cond, act):
        return torch.cat([act, cond] if self.swap else [cond, act], dim=1)

    # -- the coupling law ----------------------------------------------------------------------
    def _params(self, cond):
        """Return ``(shift, scale, log_scale)`` (scale/log_scale None for additive)."""
        h = self.net(cond)
        if not self.affine:
            return h, None, None
        shift, raw = h[:, 0::2], h[:, 1::2]
        if self.scale_map == "sigmoid":
            return shift, torch.sigmoid(raw + 2.0), F.logsigmoid(raw + 2.0)
        log_scale = self.clamp * torch.tanh(raw / self.clamp)
        return shift, torch.exp(log_scale), log_scale

    def _couple(self, act, shift, scale, log_scale, n):
        if scale is None:
            return act + shift, act.new_zeros(n)
        return (act + shift) * scale, log_scale.sum(dim=(1, 2, 3))

    def forward(self, x):
        cond, act = self._split(x)
        shift, scale, log_scale = self._params(cond)
        y_act, logdet = self._couple(act, shift, scale, log_scale, x.shape[0])
        return self._merge(cond, y_act), logdet

    def inverse(self, y):
        cond, y_act = self._split(y)
        shift, scale, _ = self._params(cond)
        act = y_act - shift if scale is None else y_act / scale - shift
        return self._merge(cond, act)

    def rebuild(self, y):
        """Fused inverse + re-forward: the conditioner runs once (with grad) and serves both."""
        cond_y, y_act = self._split(y)
        cond = cond_y.detach().requires_grad_(True)
        with torch.enable_grad():
            shift, scale, log_scale = self._params(cond)
            with torch.no_grad():
                act_x = y_act - shift if scale is None else y_act / scale - shift
            act = act_x.detach().requires_grad_(True)
            y_act_re, logdet = self._couple(act, shift, scale, log_scale, y.shape[0])
            y_re = self._merge(cond, y_act_re)
        x = self._merge(cond.detach(), act_x)
        leaves = [act, cond] if self.swap else [cond, act]
        return x, leaves, y_re, logdet


    direct_grad = True

    def grad_from_output(self, y, g_y, g_logdet):
        """Backward by hand around one autograd call on the conditioner (no graph for the elementwise law).

        With ``h = NN(cond) = (shift, raw)`` and ``y_act = (act + shift) * scale``, ``logdet = sum log scale``:
        ``dL/dact = g scale``, ``dL/dshift = g scale``, ``dL/draw = (g y_act + g_logdet) dlog(scale)/draw``, where
        ``dlog(scale)/draw = 1 - scale`` (sigmoid) or ``1 - (log scale / clamp)^2`` (tanh).
        """
        cond_y, y_act = self._split(y)
        cond = cond_y.detach().requires_grad_(True)
        g_cond_y, g_yact = self._split(g_y)
        with torch.enable_grad():
            h = self.net.functional(cond)
        with torch.no_grad():
            if not self.affine:
                act, g_act, g_h = y_act - h, g_yact, g_yact
            else:
                shift, raw = h[:, 0::2], h[:, 1::2]
                if self.scale_map == "sigmoid":
                    scale = torch.sigmoid(raw + 2.0)
                    dlog = 1.0 - scale
                else:
                    log_scale = self.clamp * torch.tanh(raw / self.clamp)
                    scale = torch.exp(log_scale)
                    dlog = 1.0 - (log_scale / self.clamp) ** 2
                act = y_act / scale - shift
                g_act = g_yact * scale
                g_raw = (g_yact * y_act + g_logdet.view(-1, *([1] * (y.dim() - 1)))) * dlog
                g_h = torch.stack([g_act, g_raw], dim=2).flatten(1, 2)
        params = [p for p in self.net.param_list if p.requires_grad]
        g = torch.autograd.grad(h, [cond, *params], g_h, allow_unused=True)
        with torch.no_grad():
            g_cond = g_cond_y if g[0] is None else g_cond_y + g[0]
            return self._merge(cond_y, act), self._merge(g_cond, g_act), dict(zip(params, g[1:]))


class AffineCoupling(_Coupling):
    """``yb = (xb + shift(xa)) * scale(xa)``; see module docstring for the bounded scale maps."""

    affine = True


class AdditiveCoupling(_Coupling):
    """``yb = xb + shift(xa)`` (NICE); volume preserving."""

    affine = False
