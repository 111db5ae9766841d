"""A chain of invertible layers run in one of three memory modes, with a drift guard.

- ``standard``: plain autograd; every layer's intermediates are stored (O(L) activations).
- ``checkpoint``: ``torch.utils.checkpoint`` (non-reentrant) over ~sqrt(L) segments: the segment inputs are
  stored and each segment is recomputed during backward (O(sqrt L)).
- ``invertible``: one ``torch.autograd.Function`` over the whole chain. Forward runs under ``no_grad`` and
  keeps only the chain's input and output (plus a per-layer checksum of a few numbers per sample). Backward
  walks the layers in reverse: it rebuilds each layer's input from its output with the layer's inverse,
  re-runs that layer with grad and back-propagates through it alone (memcnn/revlib style), so activation
  memory does not grow with depth.

Drift guard (invertible mode): each rebuilt input is compared with a checksum taken in forward (``k``
fixed random +-1 projections per sample, a few numbers per layer). An error ``e`` in the rebuilt input moves
a projection by about ``|e|``, so ``|checksum change| / |x|`` estimates the relative rebuild error. A re-run
of the forward would not do: for a forward-contractive layer (Glow's sigmoid scale) a large input error
maps to a tiny output error, which is exactly the exploding-inverse case. Errors are checked with one host
sync per chain; if any exceeds ``drift_tol`` the chain's backward is redone layer by layer: the drifting
layer's true input is recomputed from the stored chain input by a forward pass (so this step's gradients
are still right), the layer is flagged in ``keep_input`` (a buffer, so it survives save/load) and stores its
input from then on, and a warning is logged. Gradients are never silently wrong.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from sinkflow.errors import SinkflowError

log = logging.getLogger(__name__)

MEMORY_MODES = ("standard", "checkpoint", "invertible")
N_PROBES = 2


def check_memory_mode(mode: str) -> str:
    if mode not in MEMORY_MODES:
        raise SinkflowError(f"unknown flow memory mode {mode!r}", f"use one of {MEMORY_MODES}")
    return mode


def _row_norm(x: torch.Tensor) -> torch.Tensor:
    """Per-sample L2 norm (``torch.linalg`` directly: ``Tensor.norm``'s Python wrapper costs more than the op
    at the drift guard's sizes)."""
    return torch.linalg.vector_norm(x.reshape(x.shape[0], -1), dim=1)


class FlowSequence(nn.Module):
    """Invertible layers applied in order; ``forward(x) -> (y, logdet)``, ``inverse(y) -> x``."""

    def __init__(self, layers, memory: str = "standard", drift_tol: float = 1e-4,
                 checkpoint_segments: int | None = None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.memory = check_memory_mode(memory)
        self.drift_tol = float(drift_tol)
        self.checkpoint_segments = checkpoint_segments
        self.register_buffer("keep_input", torch.zeros(len(self.layers), dtype=torch.bool))
        self.drift_events: list[dict] = []  # one dict per fallback: layer index, name, error
        self.max_drift = 0.0  # largest relative rebuild error seen by the guard
        self._probes: dict = {}
        self._param_list = None

    # -- plain evaluation ----------------------------------------------------------------------
    def run_layers(self, x, start: int = 0, stop: int | None = None):
        logdet = x.new_zeros(x.shape[0])
        for layer in self.layers[start:stop]:
            x, ld = layer(x)
            logdet = logdet + ld
        return x, logdet

    def drop_caches(self) -> None:
        """A new pass: the parameters may have changed since the last (see ``InvertibleLayer.drop_cache``)."""
        for layer in self.layers:
            layer.drop_cache()

    def forward(self, x):
        self.drop_caches()
        if self.memory == "standard" or not torch.is_grad_enabled() or len(self.layers) == 0:
            return self.run_layers(x)
        if self.memory == "checkpoint":
            return self._checkpointed(x)
        if torch.is_autocast_enabled(x.device.type):
            raise SinkflowError("flow memory mode 'invertible' does not support autocast",
                                "train the flow in float32 or use memory: checkpoint")
        if self._param_list is None:  # the module tree is fixed after construction: walk it once
            self._param_list = list(self.parameters())
        params = [p for p in self._param_list if p.requires_grad]
        return _InvertibleChain.apply(self, x, *params)

    def inverse(self, y):
        self.drop_caches()
        for layer in reversed(self.layers):
            y = layer.inverse(y)
        return y

    def recompute_units(self) -> list[tuple[int, int]]:
        """The layer ranges ``[a, b)`` backward re-runs with grad, one at a time (their saved tensors are a transient
        on top of what the forward kept: ``sinkflow.models.footprint.recompute_terms``): a checkpoint segment, one
        layer in invertible mode, none in standard mode."""
        if self.memory == "checkpoint":
            return self.segments()
        return [(i, i + 1) for i in range(len(self.layers))] if self.memory == "invertible" else []

    # -- checkpoint mode -----------------------------------------------------------------------
    def segments(self) -> list[tuple[int, int]]:
        n = len(self.layers)
        k = self.checkpoint_segments or max(1, round(math.sqrt(n)))
        k = min(k, n)
        bounds = [round(i * n / k) for i in range(k + 1)]
        return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]

    def _checkpointed(self, x):
        logdet = x.new_zeros(x.shape[0])
        for a, b in self.segments():
            x, ld = checkpoint(self.run_layers, x, a, b, use_reentrant=False)
            logdet = logdet + ld
        return x, logdet

    # -- drift guard helpers -------------------------------------------------------------------
    def _probe(self, x):
        """``k`` fixed random +-1 projections per sample: a checksum that any sizeable error moves."""
        key = (tuple(x.shape[1:]), x.dtype, x.device)
        r = self._probes.get(key)
        if r is None:
            g = torch.Generator().manual_seed(0)
            r = torch.randint(0, 2, (x[0].numel(), N_PROBES), generator=g).to(x.dtype) * 2 - 1
            r = self._probes[key] = r.to(x.device)
        return x.reshape(x.shape[0], -1) @ r

    def _drift(self, x_re, checksum) -> torch.Tensor:
        """Relative error of a rebuilt input, estimated from the forward-time checksum (a 0-d tensor).

        Samples whose forward input was already non-finite are skipped: standard mode is garbage there too.
        A non-finite rebuild of a finite input gives inf/nan, which never passes ``err <= tol``.
        """
        tiny = torch.finfo(x_re.dtype).tiny
        err = (self._probe(x_re) - checksum).abs().amax(1) / (_row_norm(x_re) + tiny)
        return torch.where(torch.isfinite(checksum).all(1), err, torch.zeros_like(err)).max()

    def _fall_back(self, i: int, err: float) -> None:
        self.keep_input[i] = True
        name = f"{getattr(self, '_flow_name', 'flow')}.layers.{i} ({type(self.layers[i]).__name__})"
        self.drift_events.append({"layer": i, "name": name, "error": err, "tol": self.drift_tol})
        log.warning("drift guard: %s rebuilt its input with relative error %.3g > drift_tol %.3g; "
                    "gradients for this step were recomputed from the stored chain input and this layer "
                    "keeps its input from now on", name, err, self.drift_tol)


class _InvertibleChain(torch.autograd.Function):
    """O(1)-in-depth backprop through ``seq.layers``; parameters are explicit inputs so grads attach."""

    @staticmethod
    def forward(ctx, seq: FlowSequence, x, *params):
        keep = seq.keep_input.tolist()
        checks, kept = [], []
        with torch.no_grad():
            h, logdet = x, x.new_zeros(x.shape[0])
            for i, layer in enumerate(seq.layers):
                if keep[i]:
                    kept.append(h)
                # exact inverses (squeeze) are never checked: a placeholder row keeps the indexing
                checks.append(seq._probe(h) if not layer.exact_inverse else h.new_zeros(h.shape[0], N_PROBES))
                h, ld = layer(h)
                logdet = logdet + ld
        ctx.seq, ctx.keep, ctx.params = seq, keep, params
        ctx.save_for_backward(x, h, torch.stack(checks), *kept)
        return h, logdet

    @staticmethod
    def backward(ctx, g_y, g_logdet):
        if torch.is_grad_enabled():
            raise SinkflowError("double backward through an invertible flow chain is not supported",
                                "use memory: standard for higher-order gradients")
        seq = ctx.seq
        x0, y, checks, *kept_list = ctx.saved_tensors
        kept = dict(zip([i for i, k in enumerate(ctx.keep) if k], kept_list))
        # Optimistic pass: drift errors stay on the device and are checked once at the end (one host
        # sync per chain instead of one per layer). If any layer drifted, the pass is redone carefully.
        grads, errs, g_x = _walk(ctx, seq, y, x0, checks, kept, g_y, g_logdet, careful=False)
        if errs:
            worst = float(torch.stack(errs).max())
            seq.max_drift = max(seq.max_drift, worst if math.isfinite(worst) else math.inf)
            if not worst <= seq.drift_tol:
                grads, _, g_x = _walk(ctx, seq, y, x0, checks, kept, g_y, g_logdet, careful=True)
        return (None, g_x if ctx.needs_input_grad[1] else None, *[grads[id(p)] for p in ctx.params])


def _walk(ctx, seq, y, x0, checks, kept, g_y, g_logdet, careful: bool):
    """Reverse pass over the layers. ``careful``: check each layer at once and repair a drifted one by
    recomputing its true input from the stored chain input (flagging it to keep its input from now on).

    Optimistic pass: each rebuilt input only records its checksum and norm (two small ops); the errors of
    all layers are computed in one go at the end. Layers with ``direct_grad`` (ActNorm and the 1x1 conv in
    closed form, couplings by hand around one autograd call on their conditioner) skip the generic
    re-forward + ``autograd.grad``.
    """
    grads = {id(p): None for p in ctx.params}
    probes, norms, rows = [], [], []
    h = y.detach()

    def add(p, gp):
        if gp is not None and p.requires_grad:
            grads[id(p)] = gp if grads[id(p)] is None else grads[id(p)] + gp

    for i in reversed(range(len(seq.layers))):
        layer = seq.layers[i]
        if layer.direct_grad and i not in kept:
            x_i, g_x, pgrads = layer.grad_from_output(h, g_y, g_logdet)
            if careful:
                err = float(seq._drift(x_i, checks[i]))
                if not err <= seq.drift_tol:
                    x_i, g_x, pgrads = _repair(seq, layer, i, err, x0, kept, g_y, g_logdet)
            else:
                probes.append(seq._probe(x_i))
                norms.append(_row_norm(x_i))
                rows.append(i)
            for p, gp in pgrads.items():
                add(p, gp)
            g_y, h = g_x, x_i
            continue
        if i in kept:
            x_i, leaves, y_re, ld_re = _reforward(layer, kept[i])
        else:
            x_i, leaves, y_re, ld_re = layer.rebuild(h)
            if not layer.exact_inverse:
                if careful:
                    err = float(seq._drift(x_i, checks[i]))
                    if not err <= seq.drift_tol:
                        seq._fall_back(i, err)
                        x_true = _recompute_input(seq, x0, i, kept)
                        kept[i] = x_true  # a later layer's repair can start from here
                        x_i, leaves, y_re, ld_re = _reforward(layer, x_true)
                else:
                    probes.append(seq._probe(x_i))
                    norms.append(_row_norm(x_i))
                    rows.append(i)
        g_y, pg = _layer_grads(layer, leaves, y_re, ld_re, g_y, g_logdet)
        for p, gp in pg:
            add(p, gp)
        h = x_i.detach()
    errs = []
    if probes:
        c = checks[torch.tensor(rows, device=checks.device)]
        tiny = torch.finfo(c.dtype).tiny
        err = (torch.stack(probes) - c).abs().amax(-1) / (torch.stack(norms) + tiny)
        errs.append(torch.where(torch.isfinite(c).all(-1), err, torch.zeros_like(err)).max())
    return grads, errs, g_y


def _layer_grads(layer, leaves, y_re, ld_re, g_y, g_logdet):
    """Back-propagate ``(g_y, g_logdet)`` through one re-run layer: ``(g_input, [(param, grad)])``."""
    outs, g_outs = [y_re], [g_y]
    if ld_re.requires_grad:
        outs.append(ld_re)
        g_outs.append(g_logdet)
    params = [p for p in layer.parameters() if p.requires_grad]
    with torch.enable_grad():
        g = torch.autograd.grad(outs, leaves + params, g_outs, allow_unused=True)
    g_in = [torch.zeros_like(leaf) if gl is None else gl for leaf, gl in zip(leaves, g[: len(leaves)])]
    return (g_in[0] if len(g_in) == 1 else torch.cat(g_in, dim=1)), list(zip(params, g[len(leaves):]))


def _repair(seq, layer, i, err, x0, kept, g_y, g_logdet):
    """A closed-form layer whose rebuilt input drifted: recompute its true input, keep it from now on, and
    take its gradients by autograd from there."""
    seq._fall_back(i, err)
    x_true = _recompute_input(seq, x0, i, kept)
    kept[i] = x_true
    x_i, leaves, y_re, ld_re = _reforward(layer, x_true)
    g_x, pg = _layer_grads(layer, leaves, y_re, ld_re, g_y, g_logdet)
    return x_i, g_x, dict(pg)


def _reforward(layer, x):
    leaf = x.detach().requires_grad_(True)
    with torch.enable_grad():
        y, ld = layer(leaf)
    return x, [leaf], y, ld


@torch.no_grad()
def _recompute_input(seq: FlowSequence, x0, i: int, kept: dict):
    """Exact input of layer ``i``: forward from the nearest stored input below it (or the chain input)."""
    start = max((j for j in kept if j <= i), default=None)
    h = x0 if start is None else kept[start]
    h, _ = seq.run_layers(h, 0 if start is None else start, i)
    return h
