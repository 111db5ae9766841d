"""sinkflow: optimal-transport and flow-based generative models that run right the first time.

The Python API (``sinkflow.api``): ``train`` / ``resume`` / ``open_run`` for the whole pipeline, and the parts for a
training loop of your own. Imports are lazy so ``import sinkflow`` stays light.
"""

__version__ = "0.1.0"

from sinkflow.torch_floor import check_torch as _check_torch  # noqa: E402

_check_torch()  # an older torch stops here in one line (the minimum, the fix), not in a traceback deep in a run

_API = {
    "train": "sinkflow.api", "resume": "sinkflow.api", "open_run": "sinkflow.api", "Run": "sinkflow.api",
    "Interrupted": "sinkflow.runtime.signals",
    "sinkhorn_velocity": "sinkflow.ot", "simulate_sinkhorn_flow": "sinkflow.ot", "w2": "sinkflow.ot",
    "build_model": "sinkflow.models", "build_distribution": "sinkflow.data", "euler": "sinkflow.methods.ode",
    "build_flow": "sinkflow.flows", "SinkflowError": "sinkflow.errors",
    # tensor-level pieces of the methods, for a training loop of your own (examples/nsgf_2d_own_loop.py)
    "get_method": "sinkflow.methods", "FM": "sinkflow.methods.flow_matching", "OTCFM": "sinkflow.methods.flow_matching",
    "straight_path": "sinkflow.methods.flow_matching", "ot_permutation": "sinkflow.ot.exact",
    "velocity_loss": "sinkflow.methods.flow_matching", "PoolGrid": "sinkflow.methods.nsgf",
    "pool_batch": "sinkflow.methods.nsgf", "sample_pool": "sinkflow.methods.nsgf", "pool_loss": "sinkflow.methods.nsgf",
    "sample_nsgfpp": "sinkflow.methods.nsgfpp", "time_loss": "sinkflow.methods.nsgfpp",
}
_ALIASES = {"get_method": "get"}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), _ALIASES.get(name, name))
    raise AttributeError(f"module 'sinkflow' has no attribute {name!r}")
