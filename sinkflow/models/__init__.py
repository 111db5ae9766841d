"""sinkflow's networks: velocity fields v(x, t) (MLP, ADM UNet) and the NSGF++ time predictor t(x).

``build_model(kind, cfg, sample_shape)`` is the one entry point; ``cfg`` is a plain dict (the config's
model subsection) whose keys and defaults are declared in the config schema (``MODEL_KEYS`` here) and
documented in docs/models.md and docs/config.md.
"""

from __future__ import annotations

import difflib
import importlib

import torch

from sinkflow.config.schema import MODEL_KINDS, model_defaults
from sinkflow.errors import SinkflowError
from sinkflow.models.footprint import count_parameters, model_memory_bytes, saved_activation_bytes
from sinkflow.models.mlp import ACTIVATIONS, MLP
from sinkflow.models.time_predictor import TimePredictorCNN, TimePredictorMLP
from sinkflow.models.unet import UNet, attention_downsample

__all__ = [
    "build_model", "count_parameters", "model_memory_bytes", "saved_activation_bytes",
    "MLP", "UNet", "TimePredictorCNN", "TimePredictorMLP", "MODEL_KEYS", "UNET_PRESETS", "attention_downsample",
]

# Defaults per kind, from the config schema (sinkflow/config/schema.py, the one place they are declared).
# Keys of *other* kinds are ignored here, so a library caller's dict may carry all of them (the config
# tree holds only its kind's); a key no kind knows is an error naming the closest valid key.
MODEL_KEYS: dict[str, dict] = {kind: model_defaults(kind) for kind, net in MODEL_KINDS.items()
                              if getattr(net, "role", None) != "flow"}  # flows check their own keys
IGNORED_KEYS = {"kind"}  # the config may say which kind it is; build_model's argument decides

# The paper's UNets (nsgf_paper.md section 3.2; torchcfm's MNIST notebook / CIFAR-10 recipe).
UNET_PRESETS: dict[str, dict] = {
    "mnist": {"channels": 32, "res_blocks": 1, "channel_mult": [1, 2, 2], "num_heads": 1, "num_head_channels": -1,
              "attention_resolutions": [16], "dropout": 0.0},
    "cifar10": {"channels": 128, "res_blocks": 2, "channel_mult": [1, 2, 2, 2], "num_heads": 4,
                "num_head_channels": 64, "attention_resolutions": [16], "dropout": 0.0},
}


def _resolve(kind: str, cfg: dict) -> dict:
    """The kind's defaults updated with ``cfg``; a key no kind knows is an error naming the closest one."""
    out = model_defaults(kind)  # a fresh copy: a caller may mutate the lists
    known = set().union(*MODEL_KEYS.values(), out) | IGNORED_KEYS
    for key in cfg or {}:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            raise SinkflowError(f"unknown model key '{key}'",
                                f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(sorted(known))}")
    from sinkflow.config import check_value

    spec = MODEL_KINDS[kind]  # each value against its key's rule: hidden=0 built a network that always output 0
    out.update({k: check_value(f"model.{k}", spec[k], v) for k, v in (cfg or {}).items() if k in out and v is not None})
    return out


def build_model(kind: str, cfg: dict, sample_shape: tuple[int, ...]) -> torch.nn.Module:
    """Build the network of model kind ``kind``: a velocity network (``mlp``, ``unet``: forward(x, t)), the
    ``time_predictor`` (forward(x) -> (N,)) or an invertible ``flow``.

    A kind is a file ``sinkflow/models/<kind>.py`` with ``build(cfg, sample_shape)`` plus its keys in
    ``sinkflow.config.schema.MODEL_KINDS``: ``cfg`` arrives with the kind's defaults filled in and its keys
    checked (a module with ``CHECKS_OWN_KEYS`` gets the section as given).
    """
    if kind not in MODEL_KINDS:
        close = difflib.get_close_matches(str(kind), MODEL_KINDS, n=1)
        raise SinkflowError(f"unknown model kind '{kind}'",
                            f"use {close[0]!r}" if close else f"choose one of: {', '.join(MODEL_KINDS)}")
    module = importlib.import_module(f"sinkflow.models.{kind}")
    try:
        sample_shape = tuple(int(s) for s in sample_shape)
    except TypeError:  # build_model("mlp", {}, 2): "'int' object is not iterable"
        raise SinkflowError(f"sample_shape={sample_shape!r} is not a shape", "pass the per-sample shape as a "
                            "tuple, e.g. (2,) for points or (1, 28, 28) for MNIST") from None
    if getattr(module, "CHECKS_OWN_KEYS", False):
        return module.build(dict(cfg or {}), sample_shape)
    c = _resolve(kind, cfg)
    if not sample_shape or any(s <= 0 for s in sample_shape):
        raise SinkflowError(f"bad sample shape {sample_shape}", "the data must have a non-empty per-sample shape")
    if "activation" in c and c["activation"] not in ACTIVATIONS:
        raise SinkflowError(f"unknown activation '{c['activation']}'", f"choose one of: {', '.join(ACTIVATIONS)}")
    return module.build(c, sample_shape)
