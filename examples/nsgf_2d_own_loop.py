"""NSGF on 2D in your own training loop: Sinkhorn particle flow -> trajectory pool -> velocity regression -> Euler.

Every step is a sinkflow piece on plain tensors (no run folder, no config): ``simulate_sinkhorn_flow`` builds
the pool, ``PoolGrid`` says how the network reads it, ``sample_pool`` draws a training batch, ``velocity_loss``
is NSGF's loss, and ``euler`` samples your network.

    python examples/nsgf_2d_own_loop.py            # ~1-2 min on a CPU
    python examples/nsgf_2d_own_loop.py --tiny     # seconds (what the test runs)
"""

import argparse

import torch

import sinkflow

p = argparse.ArgumentParser()
p.add_argument("--tiny", action="store_true")
args = p.parse_args()
batches, iters = (4, 200) if args.tiny else (64, 5000)
torch.manual_seed(0)

source, target = sinkflow.build_distribution("8gaussians"), sinkflow.build_distribution("moons")
g = torch.Generator().manual_seed(0)
x0 = torch.stack([source.sample(256, g) for _ in range(batches)])  # (B, 256, 2) particles
y = torch.stack([target.sample(256, g) for _ in range(batches)])   # (B, 256, 2) target batches

# 1. The empirical Sinkhorn flow: 5 harmonic Euler steps (each covers 1/5 of the way), converged solver, at the
# 2D recipe's blur and iteration cap (presets/_nsgf2d.yaml: at blur 0.1 with 30 iterations the solves stop short of
# tol, the solver warns, and the pool's velocities carry the error).
T = 5
xs, vs = sinkflow.simulate_sinkhorn_flow(x0, y, steps=T, eta=1.0, schedule="harmonic", blur=0.2, scaling=0.8,
                                         solver="converged", max_iters=200, tol=0.01, batched=True)
pool_x, pool_v = xs.reshape(T, -1, 2), vs.reshape(T, -1, 2)      # (T, B*256, 2): the trajectory pool
grid = sinkflow.PoolGrid.of([1.0 / (T - k) for k in range(T)], time="fraction")  # network time s = k/T in [0, 1]

# 2. Regress the velocity on points of the Euler segments (segment=1: always a point along the step).
net = sinkflow.build_model("mlp", {"hidden": 256, "depth": 3}, (2,))
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, iters)
for it in range(iters):
    batch = sinkflow.sample_pool(pool_x, pool_v, 256, grid, segment=1.0)  # (x, s, target dx/ds)
    loss = sinkflow.velocity_loss(net, batch)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()

# 3. Sample with 10 Euler steps over the grid's span (s from 0 to 1) and compare with a fresh test draw.
x0 = source.sample(1024, torch.Generator().manual_seed(1))
samples, _ = sinkflow.euler(net, x0, 0.0, float(grid.times[-1]), 10)
print(f"final loss {loss.item():.4f}  W2(samples, fresh moons) {sinkflow.w2(samples, target.test_set(1024)):.3f}")
