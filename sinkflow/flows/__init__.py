"""Invertible normalizing flows (Glow, RealNVP) with three memory modes: standard, checkpoint, invertible.

See docs/flows.md. Public API::

    model = build_flow({"arch": "glow", "levels": 2, "depth_per_level": 8, "memory": "invertible"}, (1, 8, 8))
    loss, bpd = flow_loss(model, x_uint8)
    loss.backward()
    x = model.sample(16, temperature=0.7)
"""

from sinkflow.flows.coupling import AdditiveCoupling, AffineCoupling, ConditionerNet
from sinkflow.flows.layers import ActNorm, InvConv1x1, InvertibleLayer, Squeeze
from sinkflow.flows.memory_modes import MEMORY_MODES, FlowSequence
from sinkflow.flows.model import (FLOW_DEFAULTS, FlowModel, Split, TopPrior, build_flow, build_glow,
                                  build_realnvp)
from sinkflow.flows.losses import bits_per_dim, dequantize, flow_loss, postprocess, preprocess, to_levels

__all__ = [
    "ActNorm", "AdditiveCoupling", "AffineCoupling", "ConditionerNet", "FLOW_DEFAULTS", "FlowModel",
    "FlowSequence", "InvConv1x1", "InvertibleLayer", "MEMORY_MODES", "Split", "Squeeze", "TopPrior",
    "bits_per_dim", "build_flow", "build_glow", "build_realnvp", "dequantize", "flow_loss", "postprocess",
    "preprocess", "to_levels",
]
