"""CUDA-only equivalence checks of the fast paths (the CPU parts are in tests/test_fast_paths.py).

1. the pool built with in_flight=1 and with in_flight chosen from free GPU memory: max |difference|;
2. device noise from ``device_generator`` is fixed by the CPU generator's state;
3. fused Adam (CUDA default) vs for-loop Adam after 20 steps: max |weight difference|.

    python benchmarks/gpu_checks.py        # needs a GPU
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch

from sinkflow import config
from sinkflow.methods import distributions, nsgf
from sinkflow.methods.pool import choose_in_flight
from sinkflow.runner.rng import device_generator
from sinkflow.runner.trainer import Trainer
from sinkflow.runner.run import Run


def pool_check() -> None:
    args = ["pool.batches=16", "pool.steps=10", "pool.batch_size=256", "pool.chunk=16", "experiment.device=cuda"]
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # run folders are relative to the working directory
        out = {}
        for name, k in (("one", 1), ("auto", 0)):
            cfg = config.resolve("moons", [*args, f"pool.in_flight={k}", f"experiment.name={name}"], {})
            run = Run.create(cfg)
            Trainer(run, nsgf.pool_task(cfg, *distributions(cfg))).fit()
            out[name] = {a: np.load(run.dir / "pool" / f"{a}.npy", allow_pickle=False) for a in "xv"}
        auto = choose_in_flight(cfg["pool"], (2,), torch.device("cuda"))
        dx = np.abs(out["one"]["x"] - out["auto"]["x"]).max()
        dv = np.abs(out["one"]["v"] - out["auto"]["v"]).max()
        print(f"pool in_flight 1 vs auto ({min(auto, 16)} in flight): max|dx| {dx:.2e}  max|dv| {dv:.2e}  "
              f"(max|v| {np.abs(out['one']['v']).max():.2f})")
        os.chdir(here)


def noise_check() -> None:
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    na = torch.randn(4096, generator=device_generator(a, torch.device("cuda")), device="cuda")
    nb = torch.randn(4096, generator=device_generator(b, torch.device("cuda")), device="cuda")
    print(f"device noise reproducible from the CPU state: {bool(torch.equal(na, nb))}, std {float(na.std()):.3f}")


def adam_check() -> None:
    outs = []
    for kw in ({"fused": True}, {"foreach": False}):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.SiLU(), torch.nn.Linear(256, 64)).cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, **kw)
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(20):
            opt.zero_grad()
            model(torch.randn(128, 64, device="cuda", generator=g)).pow(2).mean().backward()
            opt.step()
        outs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    print(f"fused vs for-loop Adam, 20 steps: max|dw| {float((outs[0] - outs[1]).abs().max()):.2e}")


if __name__ == "__main__":
    print(f"gpu_checks on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    pool_check()
    noise_check()
    adam_check()
