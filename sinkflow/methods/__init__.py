"""Methods: each turns a config into an ordered list of phases and knows how to sample.

A method module exposes ``phases(cfg, source, target) -> list[Phase]`` and
``sample(run, x0, steps, record=False) -> (x, info)`` where ``info["nfe"]`` is counted by
instrumentation and ``info["path"]`` holds intermediate states when ``record`` is set.
"""

from __future__ import annotations

import importlib
from functools import lru_cache

from sinkflow.errors import SinkflowError

_MODULES = {"nsgf": "nsgf", "nsgfpp": "nsgfpp", "fm": "flow_matching", "otcfm": "flow_matching", "flow": "flow"}

# The phases each method's ``phases()`` returns, by name, known without building data or models: the config
# schema reads it to show and check only the sections a method uses (tests/test_config.py checks it
# against ``phases()``). A training phase's name is also its ``model.<name>`` and ``train.<name>`` section.
METHOD_PHASES: dict[str, tuple[str, ...]] = {
    "nsgf": ("pool", "velocity"),
    "nsgfpp": ("pool", "velocity", "nsf", "time"),
    "fm": ("velocity",),
    "otcfm": ("velocity",),
    "flow": ("flow",),
}


def get(method: str):
    if method not in _MODULES:
        raise SinkflowError(f"unknown method '{method}'", f"choose one of {', '.join(_MODULES)}")
    return importlib.import_module(f"sinkflow.methods.{_MODULES[method]}")


def _data_key(cfg: dict) -> tuple:
    return tuple(sorted((k, v if not isinstance(v, list) else tuple(v)) for k, v in cfg["data"].items()))


@lru_cache(maxsize=8)
def _distributions(key: tuple):
    from sinkflow.data import build_distribution

    data_cfg = dict(key)
    target = build_distribution(data_cfg["target"], data_cfg=data_cfg)
    source = build_distribution(data_cfg["source"], data_cfg={**data_cfg, "shape": tuple(target.shape)})
    if tuple(source.shape) != tuple(target.shape):
        raise SinkflowError(
            f"data.source {data_cfg['source']} has samples of shape {tuple(source.shape)} but data.target "
            f"{data_cfg['target']} has {tuple(target.shape)}", "use a source and target of the same dimension")
    return source, target


def distributions(cfg: dict):
    """(source, target) for a config; built once per data section (validates the data up front)."""
    return _distributions(_data_key(cfg))


def sample_shape(cfg: dict) -> tuple[int, ...]:
    return tuple(distributions(cfg)[1].shape)
