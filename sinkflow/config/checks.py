"""The one rule for the scalar and array arguments of the Python API, shared by every layer that takes them.

Why one module: each sampler, solver and integrator used to test its own ``isinstance(n, int)`` or
``isinstance(blur, (int, float))``, so a numpy scalar (``np.int64(2)``, what indexing or ``arr.sum()`` hands
back) was accepted by some and refused by others with a message that contradicted itself ("must be a positive
int, got np.int64(2)"), and a float64 or numpy batch reached some networks as a raw torch error. The rules here
are ``numbers.Integral`` / ``numbers.Real`` (so numpy and Python scalars alike; ``bool`` refused: ``True`` is
not a count nor a blur) and "a tensor or numpy array of a real floating dtype". Callers keep their own one-line
message (it names their argument and its fix). It sits in ``config``, the lowest layer package, so ``data``,
``ot``, ``flows``, ``methods`` and the API can all use it; like the rest of ``config`` it imports no torch or
numpy at import time (its callers have loaded them; ``sinkflow config`` and the CLI's argument checks stay fast).

Only Python values, shapes and dtypes are read: never a tensor's values (no device sync on hot paths).
"""

from __future__ import annotations

import math
import numbers

from sinkflow.errors import SinkflowError


def is_whole(value, minimum: int = 1) -> bool:
    """``value`` is a whole number >= ``minimum`` of any integral type (int, numpy's); not a bool, not 2.0."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def is_real(value) -> bool:
    """``value`` is a finite real number of any type (int, float, numpy's); not a bool, NaN or an infinity."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def is_positive(value) -> bool:
    """``value`` is a finite real number > 0 (``is_real``)."""
    return is_real(value) and value > 0


def shown(value) -> str:
    """``value`` for a one-line message: its repr where that is one short line (``np.int64(0)``, ``tensor(3)``),
    else its type and shape (a tensor's or an array's repr spans lines and can run to thousands of characters)."""
    text = repr(value)
    if "\n" not in text and len(text) <= 80:
        return text
    shape = getattr(value, "shape", None)
    return f"a {type(value).__name__}" + (f" of shape {tuple(shape)}" if shape is not None else "")


def float_tensor(value, name: str, dtype=None):
    """``value`` (a torch tensor or a numpy array of a real floating dtype, as ``w2`` takes) as a tensor, cast to
    ``dtype`` if given; a numpy array lands on the CPU, a tensor stays where it is. Anything else (a list, an
    integer, bool or complex dtype) is refused in one line naming ``name``: an integer batch is not a set of points
    a network or a solver was made for, and would otherwise surface as a raw dtype error deep inside torch.
    Gradients are kept (a loss may need them); callers that leave autograd detach themselves."""
    import numpy as np
    import torch

    if isinstance(value, np.ndarray):
        if value.dtype.kind != "f":
            raise SinkflowError(f"{name} has non-floating dtype {value.dtype}", f"convert {name} to a float array")
        if value.dtype not in (np.float16, np.float32, np.float64):  # longdouble: no torch twin
            value = value.astype(np.float64)
        value = torch.from_numpy(np.require(value, requirements=("C", "W")))  # a copy only if strided/read-only
    if not isinstance(value, torch.Tensor):
        raise SinkflowError(f"{name} must be a torch.Tensor or a numpy array, got {type(value).__name__}",
                            "convert it with torch.as_tensor")
    if not value.is_floating_point():
        raise SinkflowError(f"{name} has non-floating dtype {value.dtype}", f"convert {name} to float")
    return value if dtype is None else value.to(dtype)
