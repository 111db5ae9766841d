"""Optimal-transport core: NSGF Sinkhorn velocities, the particle flow, exact W2 and the energy distance, memory sizing."""

from sinkflow.ot.sinkhorn_peak import max_batches_in_flight, sinkhorn_peak_bytes
from sinkflow.ot.metrics import energy_distance, w2
from sinkflow.ot.velocity import (
    eta_schedule,
    safe_diameter,
    simulate_sinkhorn_flow,
    sinkhorn_velocity,
    sinkhorn_velocity_batched,
)

__all__ = [
    "energy_distance",
    "eta_schedule",
    "max_batches_in_flight",
    "safe_diameter",
    "simulate_sinkhorn_flow",
    "sinkhorn_peak_bytes",
    "sinkhorn_velocity",
    "sinkhorn_velocity_batched",
    "w2",
]
