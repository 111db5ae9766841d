"""Euler integration with per-sample time spans and NFE counted by instrumentation."""

from __future__ import annotations

import contextlib

import torch

from sinkflow.config.checks import float_tensor, is_whole, shown
from sinkflow.errors import SinkflowError, require


class NFECounter:
    """Counts forward calls of the given modules through forward hooks (not inferred from settings)."""

    def __init__(self, *modules: torch.nn.Module):
        self.count = 0
        self._handles = [m.register_forward_hook(self._hook) for m in modules]

    def _hook(self, module, args, output):
        self.count += 1

    def close(self) -> None:
        for h in self._handles:
            h.remove()


@contextlib.contextmanager
def count_nfe(*modules: torch.nn.Module):
    counter = NFECounter(*modules)
    try:
        yield counter
    finally:
        counter.close()


def network_evaluations(nfe: int) -> str:
    """``nfe`` in words for a sample line or a figure title: "1 network evaluation", "14 network evaluations"."""
    return f"{nfe} network evaluation{'' if nfe == 1 else 's'}"


def compiled_for_sampling(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` wrapped by torch.compile for a sampler's calls: many calls of one shape per batch. On CUDA the
    mode is "reduce-overhead": each batch shape is captured once as a CUDA graph and every Euler step replays
    it, so a step costs the network's kernels, not one Python-dispatched launch per kernel (the cost that
    dominates small batches). Elsewhere inductor's default. Shapes are static: one compile per batch shape (an
    evaluation's smaller last chunk adds one). Forward hooks on the returned module fire at every call, so
    ``count_nfe`` counts it as it counts the eager network; a replay's output lives in the graph's memory until
    the next replay, which is why the samplers use each call's output before the next call."""
    mode = "reduce-overhead" if torch.device(device).type == "cuda" else "default"
    return torch.compile(model, mode=mode, dynamic=False)


def compile_failures() -> tuple[type[BaseException], ...]:
    """What torch.compile raises at a compiled module's first call when it cannot compile (no Triton for this card,
    no C++ compiler, an unsupported op): dynamo's errors, and the no-Triton error where this torch has it."""
    from torch._dynamo import exc as dynamo_exc

    return (dynamo_exc.TorchDynamoException,
            getattr(dynamo_exc, "TritonUnavailableError", dynamo_exc.TorchDynamoException))


def compile_failure_line(exc: BaseException) -> str:
    """The first line of a compile failure (dynamo's messages run to pages), at most 200 characters."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def time_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the times given to a network computing in ``dtype``: float32 (a half-precision time grid
    would round t + k h), float64 for a float64 network (whose time embedding would refuse float32)."""
    return torch.promote_types(torch.float32, dtype)


def _expand(t, x: torch.Tensor, name: str = "t") -> torch.Tensor:
    t = torch.as_tensor(t, dtype=time_dtype(x.dtype), device=x.device)
    require(t.ndim == 0 or tuple(t.shape) == (x.shape[0],), f"{name} has shape {tuple(t.shape)} but x holds "
            f"{x.shape[0]} samples", f"pass {name} as a number, or one time per sample, shaped ({x.shape[0]},)")
    return t.expand(x.shape[0]).clone() if t.ndim == 0 else t


def warped_fractions(steps: int, warp: float = 1.0) -> list[float]:
    """Grid points f_i = 1 - (1 - i/steps)^warp on [0, 1]: ``warp`` 1 is uniform; below 1 the early steps
    are shorter and the last one longer (it jumps to the network's estimate of the end point), above 1
    the reverse. The same NFE either way; ``sample.time_warp`` (docs/nsgfpp.md, the digits benchmark)."""
    require(warp > 0, f"time warp must be > 0, got {warp!r}", "e.g. sample.time_warp=1 (a uniform grid)")
    return [1.0 - (1.0 - i / steps) ** warp for i in range(steps + 1)]


def _first_parameter(model) -> torch.Tensor | None:
    params = model.parameters() if isinstance(model, torch.nn.Module) else ()
    return next((p for p in params if p.is_floating_point()), None)


def network_dtype(model) -> torch.dtype:
    """The dtype ``model`` computes in: its first floating parameter's (a Python attribute: no device sync);
    float32 for a callable without parameters (a lambda, a closure), the dtype every sampler's state keeps."""
    p = _first_parameter(model)
    return torch.float32 if p is None else p.dtype


def require_network_device(model, x: torch.Tensor, name: str = "x") -> None:
    """One line when ``x`` is not on the device of ``model``'s parameters (torch's own error names neither the
    argument nor the fix). Reads attributes only: no device sync. A callable without parameters passes."""
    p = _first_parameter(model)
    if p is not None and p.device != x.device:
        raise SinkflowError(f"{name} is on {x.device} but the network is on {p.device}",
                            f"move it there first: {name}.to('{p.device}')")


@torch.no_grad()
def euler(model, x: torch.Tensor, t0, t1, steps: int, record: bool = False, warp: float = 1.0):
    """Integrate dx/dt = model(x, t) from t0 to t1 (scalars or per-sample (N,) tensors) in ``steps`` Euler
    steps on the grid ``warped_fractions(steps, warp)`` of each span (uniform by default). ``steps`` < 1 is
    refused (as ``simulate_sinkhorn_flow`` does) rather than returning ``x`` unmoved as if it were a sample.

    ``x`` (a tensor or numpy array of any floating dtype) is cast to the network's dtype (``network_dtype``:
    float32 for the networks sinkflow builds), and the state stays in it: as ``sinkhorn_velocity`` computes in
    float32 whatever it is given, a float64 or half batch is integrated rather than refused by the network's
    first matmul as a raw dtype mismatch. The result is in that dtype."""
    require(is_whole(steps), f"steps must be a positive integer, got {shown(steps)}", "use at least one Euler step")
    x = float_tensor(x, "x", network_dtype(model))
    require_network_device(model, x)
    t0, t1 = _expand(t0, x, "t0"), _expand(t1, x, "t1")
    span = t1 - t0
    if warp == 1.0:  # the uniform grid as t0 + k h, bit-identical to the sampler before warps existed
        h = span / steps
        grid = ((t0 + k * h, h) for k in range(steps))  # made step by step: a list of 10^9 steps filled the memory
    else:
        f = warped_fractions(steps, warp)
        grid = ((t0 + f[k] * span, (f[k + 1] - f[k]) * span) for k in range(steps))
    shape = (-1,) + (1,) * (x.ndim - 1)
    path = [x.cpu()] if record else []
    for t, h in grid:
        x = x + (h.view(shape) * model(x, t).float()).to(x.dtype)  # a no-op cast for float32 (the usual case)
        if record:
            path.append(x.cpu())
    return x, path
