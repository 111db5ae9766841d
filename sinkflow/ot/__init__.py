"""Optimal-transport core: NSGF Sinkhorn velocities, the particle flow, exact W2, memory sizing."""

from sinkflow.ot.sinkhorn_peak import max_batches_in_flight, sinkhorn_peak_bytes
from sinkflow.ot.metrics import w2
from sinkflow.ot.velocity import (
    eta_schedule,
    safe_diameter,
    simulate_sinkhorn_flow,
    sinkhorn_velocity,
    sinkhorn_velocity_batched,
)

__all__ = [
    "eta_schedule",
    "max_batches_in_flight",
    "safe_diameter",
    "simulate_sinkhorn_flow",
    "sinkhorn_peak_bytes",
    "sinkhorn_velocity",
    "sinkhorn_velocity_batched",
    "w2",
]
