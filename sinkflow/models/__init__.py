"""sinkflow's networks: velocity fields v(x, t) (MLP, ADM UNet) and the NSGF++ time predictor t(x).

``build_model(kind, cfg, sample_shape)`` is the one entry point; ``cfg`` is a plain dict (the config's
model subsection) whose keys and defaults are declared in the config schema (``MODEL_KEYS`` here) and
documented in docs/models.md and docs/config.md.
"""

from __future__ import annotations

import difflib
import math

import torch

from sinkflow.config.schema import model_defaults
from sinkflow.errors import SinkflowError
from sinkflow.models.footprint import count_parameters, model_memory_bytes, saved_activation_bytes
from sinkflow.models.mlp import ACTIVATIONS, MLP
from sinkflow.models.time_predictor import TimePredictorCNN, TimePredictorMLP
from sinkflow.models.unet import UNet

__all__ = [
    "build_model", "count_parameters", "model_memory_bytes", "saved_activation_bytes",
    "MLP", "UNet", "TimePredictorCNN", "TimePredictorMLP", "MODEL_KEYS", "UNET_PRESETS", "attention_downsample",
]

# Defaults per kind, from the config schema (sinkflow/config/schema.py, the one place they are declared).
# Keys of *other* kinds are ignored here, so a library caller's dict may carry all of them (the config
# tree holds only its kind's); a key no kind knows is an error naming the closest valid key.
MODEL_KEYS: dict[str, dict] = {kind: model_defaults(kind) for kind in ("mlp", "unet", "time_predictor")}
IGNORED_KEYS = {"kind"}  # the config may say which kind it is; build_model's argument decides

# The paper's UNets (nsgf_paper.md section 3.2; torchcfm's MNIST notebook / CIFAR-10 recipe).
UNET_PRESETS: dict[str, dict] = {
    "mnist": {"channels": 32, "res_blocks": 1, "channel_mult": [1, 2, 2], "num_heads": 1, "num_head_channels": -1,
              "attention_resolutions": [16], "dropout": 0.0},
    "cifar10": {"channels": 128, "res_blocks": 2, "channel_mult": [1, 2, 2, 2], "num_heads": 4,
                "num_head_channels": 64, "attention_resolutions": [16], "dropout": 0.0},
}


def _resolve(kind: str, cfg: dict) -> dict:
    if kind not in MODEL_KEYS:
        close = difflib.get_close_matches(str(kind), MODEL_KEYS, n=1)
        raise SinkflowError(f"unknown model kind '{kind}'",
                            f"use {close[0]!r}" if close else f"choose one of: {', '.join(MODEL_KEYS)}")
    known = set().union(*MODEL_KEYS.values()) | IGNORED_KEYS
    for key in cfg or {}:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            raise SinkflowError(f"unknown model key '{key}'",
                                f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(sorted(known))}")
    out = model_defaults(kind)  # a fresh copy: a caller may mutate the lists
    out.update({k: v for k, v in (cfg or {}).items() if k in out and v is not None})
    return out


def attention_downsample(attention_resolutions, image_size: int) -> tuple[int, ...]:
    """torchcfm's UNetModelWrapper rule: resolution r means downsample factor ``image_size // r``.

    So "16" puts attention at the full-resolution level of a 28x28 image (28 // 16 = 1), at the 16x16
    level of a 32x32 image (ds 2), and nowhere but the middle block of an 8x8 image (8 // 16 = 0).
    """
    if isinstance(attention_resolutions, str):
        attention_resolutions = [r for r in attention_resolutions.split(",") if r.strip()]
    if isinstance(attention_resolutions, int):
        attention_resolutions = [attention_resolutions]
    ds = []
    for r in attention_resolutions:
        if int(r) <= 0:
            raise SinkflowError(f"attention resolution {r} must be a positive int", "e.g. model.attention_resolutions=[16]")
        if image_size // int(r) > 0:
            ds.append(image_size // int(r))
    return tuple(sorted(set(ds)))


def _build_unet(c: dict, sample_shape: tuple[int, ...]) -> UNet:
    if len(sample_shape) != 3:
        raise SinkflowError(f"the unet needs image samples (C, H, W), got shape {tuple(sample_shape)}",
                            "use model kind 'mlp' for flat data")
    mult = [float(m) if float(m) != int(m) else int(m) for m in c["channel_mult"]]
    if not mult:
        raise SinkflowError("model.channel_mult is empty", "give one multiplier per level, e.g. [1, 2, 2]")
    widths = sorted({int(m * c["channels"]) for m in mult})
    if c["num_head_channels"] != -1:
        bad = [w for w in widths if w % c["num_head_channels"]]
        if bad:
            raise SinkflowError(f"UNet widths {bad} are not divisible by num_head_channels={c['num_head_channels']}",
                                "change model.num_head_channels or model.channels")
    elif any(w % c["num_heads"] for w in widths):
        raise SinkflowError(f"UNet widths {widths} are not divisible by num_heads={c['num_heads']}",
                            "change model.num_heads or model.channels")
    if c["pad_mode"] not in ("reflect", "replicate", "zeros"):
        raise SinkflowError(f"unknown model.pad_mode '{c['pad_mode']}'", "use reflect, replicate or zeros")
    _, hgt, wid = sample_shape
    return UNet(
        in_channels=sample_shape[0], model_channels=int(c["channels"]), num_res_blocks=int(c["res_blocks"]),
        attention_ds=attention_downsample(c["attention_resolutions"], max(hgt, wid)), dropout=float(c["dropout"]),
        channel_mult=tuple(mult), num_heads=int(c["num_heads"]), num_head_channels=int(c["num_head_channels"]),
        use_scale_shift_norm=bool(c["use_scale_shift_norm"]), pad_mode=c["pad_mode"],
    )


def build_model(kind: str, cfg: dict, sample_shape: tuple[int, ...]) -> torch.nn.Module:
    """Build a velocity network (``mlp``, ``unet``: forward(x, t)) or the ``time_predictor`` (forward(x) -> (N,)).

    ``flow`` builds an invertible normalizing flow; its keys are checked by ``sinkflow.flows.build_flow``.
    """
    if kind == "flow":
        from sinkflow.flows import build_flow

        return build_flow({k: v for k, v in (cfg or {}).items() if k not in ("kind", "n_bins")},
                          tuple(int(s) for s in sample_shape))
    c = _resolve(kind, cfg)
    sample_shape = tuple(int(s) for s in sample_shape)
    if not sample_shape or any(s <= 0 for s in sample_shape):
        raise SinkflowError(f"bad sample shape {sample_shape}", "the data must have a non-empty per-sample shape")
    if "activation" in c and c["activation"] not in ACTIVATIONS:
        raise SinkflowError(f"unknown activation '{c['activation']}'", f"choose one of: {', '.join(ACTIVATIONS)}")
    if kind == "mlp":
        return MLP(math.prod(sample_shape), int(c["hidden"]), int(c["depth"]), c["activation"], int(c["time_freqs"]))
    if kind == "unet":
        return _build_unet(c, sample_shape)
    if len(sample_shape) == 3:
        return TimePredictorCNN(sample_shape, tuple(int(w) for w in c["channels"]))
    return TimePredictorMLP(math.prod(sample_shape), int(c["hidden"]), int(c["depth"]), c["activation"])
