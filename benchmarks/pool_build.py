"""Pool-building throughput: batched Sinkhorn velocities versus the paper's one-batch-at-a-time loop.

Reference ("paper style", the author's dev code): for each pool batch, for each Euler step, two
GeomLoss calls (F_ab = OT(x, y), F_aa = OT(x, x)), two autograd.grad, v = grad F_aa - grad F_ab.
Batched (sinkflow): all B pool batches and both OT problems in one GeomLoss call per step.

Both use the same blur, scaling and (explicit) diameter, so they run the same iterations and the
velocities agree to float rounding; the max abs velocity difference is printed as the accuracy check.
Pool entries per second counts (x_t, v_t) pairs: B * n * steps / seconds.

    python benchmarks/pool_build.py                 # CPU cases (+ CUDA cases when a GPU is present)
    python benchmarks/pool_build.py --device cpu --batches 32 --steps 5
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import torch
from geomloss import SamplesLoss

from sinkflow.ot import safe_diameter, simulate_sinkhorn_flow
from sinkflow.ot.precision import strict_float32

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import at_least, fail, positive_int  # noqa: E402


def reference_pool(x0, y, *, steps, eta, blur, scaling, diameter):
    """One pool batch at a time, two SamplesLoss calls per step (x0, y: (B, n, D))."""
    op = SamplesLoss(
        loss="sinkhorn", p=2, blur=blur, scaling=scaling, diameter=diameter,
        debias=False, potentials=True, backend="tensorized",
    )
    B, n, D = x0.shape
    xs = torch.empty(steps, B, n, D, device=x0.device)
    vs = torch.empty_like(xs)
    a = torch.full((n,), 1.0 / n, device=x0.device)
    with strict_float32(x0.device.type):
        for b in range(B):
            x, tgt = x0[b].clone(), y[b]
            for k in range(steps):
                X = x.clone().requires_grad_(True)
                F_ab, _ = op(a, X, a, tgt)
                F_aa, _ = op(a, X, a, X)
                (g_ab,) = torch.autograd.grad(F_ab.sum(), X)
                (g_aa,) = torch.autograd.grad(F_aa.sum(), X)
                v = g_aa - g_ab
                xs[k, b], vs[k, b] = x, v
                x = (x + eta * v).detach()
    return xs, vs


def sample_2d(B, n, gen, device):
    """Source N(0, I); target 8 Gaussians on a circle of radius 4 (std 0.5)."""
    x0 = torch.randn(B, n, 2, generator=gen)
    k = torch.randint(0, 8, (B, n), generator=gen).float() * (2 * math.pi / 8)
    y = 4 * torch.stack([k.cos(), k.sin()], -1) + 0.5 * torch.randn(B, n, 2, generator=gen)
    return x0.to(device), y.to(device)


def sample_images(B, n, shape, gen, device):
    """Source N(0, I); target smooth synthetic images in [-1, 1] (no data set is downloaded)."""
    D = math.prod(shape)
    x0 = torch.randn(B, n, D, generator=gen)
    basis = torch.randn(16, D, generator=gen)
    basis = torch.nn.functional.avg_pool1d(basis[:, None], 9, 1, 4)[:, 0] * 3
    y = torch.tanh(torch.randn(B, n, 16, generator=gen) @ basis)
    return x0.to(device), y.to(device)


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def run_case(name, x0, y, *, steps, eta, blur, scaling, ref_batches, repeats):
    device = x0.device
    B, n, D = x0.shape
    diam = safe_diameter(x0, y, batched=True)
    kw = dict(steps=steps, eta=eta, blur=blur, scaling=scaling, diameter=diam)
    simulate_sinkhorn_flow(x0[:2], y[:2], batched=True, **kw)  # warm-up
    t_bat = min(timed(lambda: simulate_sinkhorn_flow(x0, y, batched=True, **kw), device)[1] for _ in range(repeats))
    xs_b, vs_b = simulate_sinkhorn_flow(x0, y, batched=True, **kw)
    # the reference is slow: time it on the first ref_batches batches and compare on those
    r = min(ref_batches, B)
    reference_pool(x0[:1], y[:1], **{**kw, "steps": 1})  # its own warm-up: one batch, one step, untimed
    (xs_r, vs_r), t_ref = timed(lambda: reference_pool(x0[:r], y[:r], **kw), device)
    diff = (vs_b[:, :r] - vs_r).abs().max().item()
    vmax = vs_r.abs().max().item()
    rate_b = B * n * steps / t_bat
    rate_r = r * n * steps / t_ref
    return dict(case=name, device=str(device), B=B, n=n, D=D, steps=steps, blur=blur, scaling=scaling,
                rate_b=rate_b, rate_r=rate_r, ratio=rate_b / rate_r, diff=diff, vmax=vmax)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # choices and whole-number floors: '--device gpu' once printed an empty table (no device matched), and a 0 in
    # a count ended in a traceback (IndexError, min() of nothing) after the first case had run
    p.add_argument("--device", default="all", choices=("cpu", "cuda", "all"),
                   help="cpu, cuda or all (cuda only if available)")
    p.add_argument("--batches", type=positive_int, default=32, help="pool batches solved at once (B)")
    p.add_argument("--gpu-batches", type=positive_int, default=128, help="B on CUDA")
    p.add_argument("--ref-batches", type=positive_int, default=8, help="batches the slow reference is timed on")
    p.add_argument("--steps", type=positive_int, default=5, help="Euler steps per trajectory (T)")
    p.add_argument("--n2d", type=positive_int, default=256, help="points per batch, 2D case")
    p.add_argument("--nimg", type=positive_int, default=64, help="points per batch, MNIST-shaped case")
    p.add_argument("--blur2d", type=float, default=0.1)
    p.add_argument("--blurimg", type=float, default=1.0)
    p.add_argument("--scaling", type=float, default=0.9)
    p.add_argument("--eta", type=float, default=0.5)
    p.add_argument("--repeats", type=positive_int, default=2, help="batched timing = best of this many runs")
    p.add_argument("--threads", type=at_least(0), default=0, help="torch CPU threads (0: leave as is)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    devices = []
    if args.device in ("cpu", "all"):
        devices.append(torch.device("cpu"))
    if args.device in ("cuda", "all") and torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no CUDA device here; use --device cpu")

    print(f"machine: {platform.platform()} | python {platform.python_version()} | torch {torch.__version__} "
          f"| cpu threads {torch.get_num_threads()} | "
          + (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"))
    rows = []
    for device in devices:
        B = args.batches if device.type == "cpu" else args.gpu_batches
        gen = torch.Generator().manual_seed(args.seed)
        x0, y = sample_2d(B, args.n2d, gen, device)
        rows.append(run_case("2d", x0, y, steps=args.steps, eta=args.eta, blur=args.blur2d,
                             scaling=args.scaling, ref_batches=args.ref_batches, repeats=args.repeats))
        x0, y = sample_images(B, args.nimg, (1, 28, 28), gen, device)
        rows.append(run_case("mnist-shaped", x0, y, steps=args.steps, eta=args.eta, blur=args.blurimg,
                             scaling=args.scaling, ref_batches=args.ref_batches, repeats=args.repeats))

    print("| case | device | B | n | D | T | blur | scaling | batched entries/s | reference entries/s "
          "| ratio | max abs dv | max abs v |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['device']} | {r['B']} | {r['n']} | {r['D']} | {r['steps']} | {r['blur']} "
              f"| {r['scaling']} | {r['rate_b']:.0f} | {r['rate_r']:.0f} | {r['ratio']:.1f}x "
              f"| {r['diff']:.1e} | {r['vmax']:.2f} |")


if __name__ == "__main__":
    main()
