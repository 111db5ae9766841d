"""Flow-matching baselines in the same runner: FM (independent pairs) and OT-CFM (exact minibatch OT pairs).

Both regress u(x_t, t) onto x1 - x0 along x_t = t x1 + (1 - t) x0, t ~ U(0, 1), sigma = 0, with the
same network, budget and sampler as NSGF, so every comparison is like for like. OT-CFM pairs the
minibatch by the exact OT plan (a permutation for equal uniform batches: ``sinkflow.ot.exact``).
"""

from __future__ import annotations

import numbers

import torch

from sinkflow.config.checks import float_tensor
from sinkflow.errors import SinkflowError
from sinkflow.methods.base import Method, TrainingStep
from sinkflow.methods.ode import count_nfe, euler, network_dtype, require_network_device, time_dtype
from sinkflow.ot.exact import ot_permutation
from sinkflow.runtime import dist


def straight_path(x0: torch.Tensor, x1: torch.Tensor, t: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, u_t): the point t x1 + (1 - t) x0 of the straight path and its velocity x1 - x0 (sigma = 0).

    ``t``: one time per sample, (N,), or one for the whole batch: a 0-d tensor, or a Python or numpy number, which
    stays a Python scalar (no tensor is made for it, so no host-to-device copy)."""
    if isinstance(t, numbers.Real):
        tb = float(t)
    else:
        tb = t.view(-1, *([1] * (x0.ndim - 1))) if t.ndim else t
    return tb * x1 + (1 - tb) * x0, x1 - x0


def interpolant_draw(source, target, generator, n, t_min=0.0):
    """The randomness of a global batch of the straight noise-data path: x0, x1 and t ~ U[t_min, 1), on the CPU."""
    x0 = source.sample(n, generator, "cpu")
    x1 = target.sample(n, generator, "cpu")
    t = t_min + (1.0 - t_min) * torch.rand(n, generator=generator)
    return x0, x1, t


def interpolant_finish(drawn, device, ot_pairs=False):
    """(x_t, t, target velocity) of a drawn global batch (``interpolant_draw``): paired by the exact OT plan if
    ``ot_pairs``, then this rank's shard on ``device``. Reads no generator: it may run on another thread than the
    draw (``sinkflow.engine.prefetch``)."""
    x0, x1, t = drawn
    if ot_pairs:  # the global batch on the device first: the plan's cost matrix is computed there (ot_permutation)
        x0, x1 = x0.to(device, non_blocking=True), x1.to(device, non_blocking=True)
        x1 = x1[ot_permutation(x0, x1)]
    x0, x1, t = (dist.shard(v).to(device, non_blocking=True) for v in (x0, x1, t))
    xt, ut = straight_path(x0, x1, t)
    return xt, t, ut


def interpolant_batch(source, target, generator, n, device, ot_pairs=False, t_min=0.0):
    """(x_t, t, target velocity) for the straight noise-data path, t ~ U[t_min, 1); the global batch, then
    this rank's shard."""
    return interpolant_finish(interpolant_draw(source, target, generator, n, t_min), device, ot_pairs)


def velocity_loss(model, batch):
    """Mean squared error of ``model(x, t)`` against the target velocity: ``batch = (x, t, target)``
    (FM / OT-CFM on the straight path, NSGF on pool entries: ``pool_batch``). ``x`` is cast to the network's dtype
    (``network_dtype``), as ``euler`` does: a float64 batch of your own trains a float32 network instead of
    stopping at its first matmul; the error is float32 whatever the batch's dtype (both casts are no-ops for the
    float32 batches of sinkflow's own phases). The times are float32 (float64 for a float64 network: ``time_dtype``);
    a batch on another device than the network is one line (``require_network_device``)."""
    x, t, v = batch
    require_network_device(model, x, "the batch")
    dtype = network_dtype(model)
    pred = model(x.to(dtype), torch.as_tensor(t, dtype=time_dtype(dtype), device=x.device))
    if pred.shape != v.shape:  # (N,) against 1-D points' (N, 1) broadcast to an (N, N) table, in silence
        raise SinkflowError(f"the velocity network returned shape {tuple(pred.shape)} for a batch shaped "
                            f"{tuple(x.shape)}, not the target's {tuple(v.shape)}", "return one velocity per sample, "
                            "shaped like x")
    return (pred.float() - v.float()).pow(2).mean()


class InterpolantStep(TrainingStep):
    """Velocity matching on the straight path between ``source`` and ``target`` samples, paired
    independently or (``ot_pairs``) by an exact minibatch OT plan, at times t ~ U[t_min, 1)."""

    def __init__(self, name: str, source, target, ot_pairs: bool = False, t_min: float = 0.0,
                 init_from: str | None = None):
        super().__init__(name, init_from=init_from)
        self.source, self.target, self.ot_pairs, self.t_min = source, target, ot_pairs, float(t_min)

    def draw(self, generator, n, device):
        return interpolant_draw(self.source, self.target, generator, n, self.t_min)

    def prepare(self, drawn, device):  # the OT plan (OT-CFM, NSGF++'s NSF pairs): the heavy, generator-free part
        return interpolant_finish(drawn, device, self.ot_pairs)

    def batch(self, generator, n, device):
        return self.prepare(self.draw(generator, n, device), device)

    def loss(self, model, batch):
        return velocity_loss(model, batch)


COUPLINGS = ("independent", "ot")


class FlowMatching(Method):
    """FM and OT-CFM: one velocity phase; they differ only in how a minibatch's pairs are coupled (as in
    torchcfm's ConditionalFlowMatcher vs ExactOptimalTransportConditionalFlowMatcher, sigma = 0). OT-CFM uses each
    pair of the exact plan's permutation once, where torchcfm draws n pairs from the plan with replacement: the same
    distribution of a pair, without repeated or dropped samples."""

    def __init__(self, name: str, coupling: str, paper: dict | None = None, paper_label: str = ""):
        if coupling not in COUPLINGS:
            raise ValueError(f"coupling {coupling!r} is not one of {COUPLINGS}")
        self.name, self.coupling = name, coupling
        self.paper, self.paper_label = paper or {}, paper_label

    def phases(self, cfg, source, target):
        return [InterpolantStep("velocity", source, target, ot_pairs=self.coupling == "ot")]

    # ---- on plain tensors (a training loop of your own), as torchcfm's ConditionalFlowMatcher ---------------
    def sample_location_and_conditional_flow(self, x0: torch.Tensor, x1: torch.Tensor, t: torch.Tensor | None = None,
                                             generator: torch.Generator | None = None):
        """(t, x_t, u_t) for a minibatch of source ``x0`` and target ``x1`` samples (tensors or numpy arrays of any
        floating dtype): ``x1`` re-paired by the exact OT plan for OT-CFM, t ~ U[0, 1) unless given (drawn on the CPU
        from ``generator``)."""
        x0, x1 = float_tensor(x0, "x0"), float_tensor(x1, "x1")
        if t is None:
            t = torch.rand(x0.shape[0], generator=generator).to(x0.device)
        if self.coupling == "ot":
            x1 = x1[ot_permutation(x0, x1)]
        xt, ut = straight_path(x0, x1, t)
        return t, xt, ut

    def loss(self, model, x0: torch.Tensor, x1: torch.Tensor, t: torch.Tensor | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
        """The training loss of one minibatch of (source, target) samples: what the velocity phase minimises.
        Samples of another floating dtype than the network's are cast to it (``velocity_loss``)."""
        t, xt, ut = self.sample_location_and_conditional_flow(x0, x1, t, generator)
        return velocity_loss(model, (xt, t, ut))

    def sample_nets(self, nets, cfg, x0, steps=None, record=False):
        model = nets["velocity"]
        with count_nfe(model) as nfe:
            x, path = euler(model, x0, 0.0, 1.0, steps or self.default_steps(cfg), record,
                            cfg["sample"]["time_warp"])
        return x, {"nfe": nfe.count, "path": path}

    def describe(self, cfg: dict) -> str:
        pairs = "exact minibatch OT pairs" if self.coupling == "ot" else "independent pairs"
        return f"{self.name}: flow matching on straight paths with {pairs}, Euler sampling over [0, 1]"


# arXiv:2401.14069v1 Table 1, the FM and OT-CFM rows: W2 on 1024 test samples, {task: {euler_steps: w2}}.
PAPER_W2_FM = {
    "8gaussians": {10: 0.423, 100: 0.415},
    "8gaussians-moons": {10: 0.292, 100: 0.290},
    "moons": {10: 0.111, 100: 0.097},
    "scurve": {10: 0.171, 100: 0.135},
    "checkerboard": {10: 0.417, 100: 0.165},
}
PAPER_W2_OTCFM = {
    "8gaussians": {10: 0.289, 100: 0.269},
    "8gaussians-moons": {10: 0.173, 100: 0.165},
    "moons": {10: 0.088, 100: 0.078},
    "scurve": {10: 0.149, 100: 0.127},
    "checkerboard": {10: 0.253, 100: 0.159},
}

FM = FlowMatching("fm", "independent", PAPER_W2_FM, "FM")
OTCFM = FlowMatching("otcfm", "ot", PAPER_W2_OTCFM, "OT-CFM")
