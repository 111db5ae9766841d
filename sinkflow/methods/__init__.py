"""Methods: each is a ``Method`` object (``sinkflow.methods.base``) in one registry.

A method knows its phases (tasks the engine runs), how it samples, evaluates and describes itself.
Nothing outside a method tests its name: callers ask ``methods.of(cfg)`` for the object and call it.
Adding a method = its own file with a ``Method`` instance + one line in
``sinkflow.config.schema.METHOD_REGISTRY`` (where it lives, the phases it builds, its own keys and the
shared keys it reads).
"""

from __future__ import annotations

import importlib

from sinkflow.config import schema
from sinkflow.data import _distributions, distributions, sample_shape
from sinkflow.errors import SinkflowError
from sinkflow.methods.base import ChunkedTask, Method, Task, TrainingStep

__all__ = ["REGISTRY", "get", "of", "Method", "Task", "TrainingStep", "ChunkedTask",
           "distributions", "sample_shape", "_distributions"]

# Declared once, with each method's phases and keys, in sinkflow.config.schema.METHOD_REGISTRY: name ->
# "module:attribute" of its Method instance (imported on first use: POT, flows... load lazily).


def __getattr__(name: str):
    if name == "REGISTRY":
        return {m: spec.where for m, spec in schema.METHOD_REGISTRY.items()}
    if name == "METHOD_PHASES":
        return schema.METHOD_PHASES
    raise AttributeError(f"module 'sinkflow.methods' has no attribute {name!r}")


def get(method: str) -> Method:
    """The registered ``Method`` called ``method``."""
    if method not in schema.METHOD_REGISTRY:
        raise SinkflowError(f"unknown method '{method}'", f"choose one of {', '.join(schema.METHOD_REGISTRY)}")
    where = schema.METHOD_REGISTRY[method].where
    module, _, attr = where.partition(":")
    module = module if "." in module else f"sinkflow.methods.{module}"
    try:
        instance = getattr(importlib.import_module(module), attr)
    except (ModuleNotFoundError, AttributeError) as exc:  # the entry's own typo, not an import inside the file
        if isinstance(exc, ModuleNotFoundError) and not (exc.name and f"{module}.".startswith(f"{exc.name}.")):
            raise
        raise SinkflowError(f"method '{method}': its METHOD_REGISTRY entry names {where!r}, but there is no "
                            f"{'module ' + module if isinstance(exc, ModuleNotFoundError) else attr + ' in ' + module}",
                            "give MethodSpec the 'module:attribute' of its Method instance") from None
    if instance.name != method:  # callers look its keys and phases up by ``name``: a KeyError traceback mid-run
        raise SinkflowError(f"the Method at {where} is named {instance.name!r}, not its registry key {method!r}",
                            f"set name = {method!r} on it (Method.name is its key in config.schema.METHOD_REGISTRY)")
    return instance


def of(cfg: dict) -> Method:
    """The method a config trains (``experiment.method``)."""
    return get(cfg["experiment"]["method"])
