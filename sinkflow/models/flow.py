"""Model kind ``flow``: an invertible normalizing flow (Glow / RealNVP) from ``sinkflow.flows``."""

from __future__ import annotations

import torch

#: ``build_model`` hands this kind its section as given: ``sinkflow.flows.build_flow`` checks the keys itself.
CHECKS_OWN_KEYS = True


def build(cfg: dict, sample_shape: tuple[int, ...]) -> torch.nn.Module:
    from sinkflow.flows import build_flow

    return build_flow({k: v for k, v in cfg.items() if k not in ("kind", "n_bins")}, sample_shape)
