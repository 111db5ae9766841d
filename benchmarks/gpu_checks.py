"""CUDA equivalence checks of the fast paths (their CPU parts are in tests/test_fast_paths.py).

1. the pool built with in_flight=1 and with in_flight chosen from free device memory: max |difference|;
2. device noise from ``device_generator`` is fixed by the CPU generator's state;
3. fused Adam (CUDA default) vs for-loop Adam after 20 steps: max |weight difference|;
4. an OT-CFM phase with batches drawn ahead (prefetch thread + its own CUDA stream) vs inline: identical final
   weights, and no host sync on an ordinary step (``torch.cuda.set_sync_debug_mode("error")`` between log steps;
   on the CPU the reads are counted instead);
5. OT-CFM's exact plan with its cost matrix computed on the device (as the prefetch thread does) vs on the host:
   the same permutation for `mnist`-shaped batches (and the same matched cost);
6. the whole step as one CUDA graph (``train.velocity.graph=step``) vs the plain step: OT-CFM on moons (batches drawn
   ahead while the step is captured, EMA on) and FM through a UNet on `mnist`-shaped batches in bf16 and in fp16
   (GradScaler inside the graph): max |weight difference| after the steps, the capture made, and no host sync on an
   ordinary step after the capture;
7. an invertible-mode Glow trained with fused Adam: its log-likelihood after the steps equals a freshly loaded
   copy's (fused Adam moves no version counter, so a stale parameter cache would show here) and the for-loop
   Adam run's;
8. twelve captured phases in one process with batches drawn ahead (CUDA's stream pool comes round: a worker's
   stream must never be the capture stream), and the memory allocated after each phase's release (flat: no
   finished phase's cuBLAS workspaces left behind);
9. a UNet whose forward reads a value on the host (a user's network a CUDA graph cannot hold) under ``graph: auto``:
   the capture fails, the phase warns once and trains on without the step graph to its last step, its weights
   finite and near those of ``graph: none``, the memory it reserves flat over its last steps and the cache then
   emptied as between phases (a failed capture left "underway" in the caching allocator deferred every prefetched
   batch's free and failed an internal assert there); on the CPU nothing is captured: the fall-back's test plants one;
10. the captured step of a torchrun job (two graphs, the gradients' all-reduce between them: sinkflow.engine.grad_sync)
   in a process group of one (NCCL on a card), fp16 UNet: max |weight difference| against the one-graph step, and
   the replays made.

The checks are meant for a GPU; ``--device cpu`` runs the same code on the CPU (where ``device_generator`` is
the CPU generator itself and fused Adam is torch's CPU kernel), which is how the test suite keeps the script
working without one. ``--smoke`` shrinks the pool and the Adam run.

    python benchmarks/gpu_checks.py                        # needs a GPU
    python benchmarks/gpu_checks.py --device cpu --smoke   # CPU check of the script
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from sinkflow import config
from sinkflow.methods import distributions, nsgf
from sinkflow.methods.pool import choose_in_flight
from sinkflow.runtime.callbacks import Callback
from sinkflow.runtime.rng import device_generator
from sinkflow.runtime.run_folder import RunFolder
from sinkflow.engine.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import checked_device  # noqa: E402

FULL = {"batches": 16, "steps": 10, "batch_size": 256, "noise": 4096, "adam_steps": 20, "width": 256, "rows": 128,
        "train_steps": 40, "unet": ["model.velocity.channels=16", "train.velocity.batch_size=32"], "phases": 12}
SMOKE = {"batches": 4, "steps": 2, "batch_size": 16, "noise": 64, "adam_steps": 3, "width": 16, "rows": 8,
         "train_steps": 6, "unet": ["model.velocity.channels=8", "model.velocity.attention_resolutions=[]",
                                    "train.velocity.batch_size=4"], "phases": 2}


@contextlib.contextmanager
def scratch_dir():
    """Run inside a fresh temporary folder (the checks' run folders go there), back where we were after."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
        yield tmp


def pool_check(device: torch.device, size: dict) -> None:
    args = [f"pool.batches={size['batches']}", f"pool.steps={size['steps']}", f"pool.batch_size={size['batch_size']}",
            f"pool.chunk={size['batches']}", f"experiment.device={device.type}"]
    with scratch_dir():  # run folders are relative to the working directory
        out = {}
        for name, k in (("one", 1), ("auto", 0)):
            cfg = config.resolve("moons", [*args, f"pool.in_flight={k}", f"experiment.name={name}"], {})
            run = RunFolder.create(cfg)
            Trainer(run, nsgf.pool_task(cfg, *distributions(cfg))).fit()
            out[name] = {a: np.load(run.dir / "pool" / f"{a}.npy", allow_pickle=False) for a in "xv"}
    auto = choose_in_flight(cfg["pool"], (2,), device)
    dx = np.abs(out["one"]["x"] - out["auto"]["x"]).max()
    dv = np.abs(out["one"]["v"] - out["auto"]["v"]).max()
    print(f"pool in_flight 1 vs auto ({min(auto, size['batches'])} in flight): max|dx| {dx:.2e}  max|dv| {dv:.2e}  "
          f"(max|v| {np.abs(out['one']['v']).max():.2f})")


def noise_check(device: torch.device, size: dict) -> None:
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    na = torch.randn(size["noise"], generator=device_generator(a, device), device=device)
    nb = torch.randn(size["noise"], generator=device_generator(b, device), device=device)
    print(f"device noise reproducible from the CPU state: {bool(torch.equal(na, nb))}, std {float(na.std()):.3f}")


def adam_check(device: torch.device, size: dict) -> None:
    outs = []
    w = size["width"]
    for kw in ({"fused": True}, {"foreach": False}):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, w), torch.nn.SiLU(), torch.nn.Linear(w, 64)).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, **kw)
        g = torch.Generator(device=device).manual_seed(1)
        for _ in range(size["adam_steps"]):
            opt.zero_grad()
            model(torch.randn(size["rows"], 64, device=device, generator=g)).pow(2).mean().backward()
            opt.step()
        outs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    print(f"fused vs for-loop Adam, {size['adam_steps']} steps: max|dw| {float((outs[0] - outs[1]).abs().max()):.2e}")


class NoSyncOnOrdinarySteps(Callback):
    """A callback that makes any host sync an error (CUDA) between the log/checkpoint steps of a phase."""

    def __init__(self, device: torch.device, after: int = 0):
        self.device, self.steps, self.after = device, 0, after

    def on_train_batch_start(self, trainer, batch) -> None:
        nxt = trainer.step + 1
        ordinary = (nxt % trainer.cfg["log_every"] and nxt % trainer.cfg["ckpt_every"] and nxt < trainer.cfg["iters"]
                    and nxt > self.after)
        if ordinary and self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        self.steps += bool(ordinary)

    def on_train_batch_end(self, trainer, batch, outputs) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")


def prefetch_check(device: torch.device, size: dict) -> None:
    from sinkflow.methods.flow_matching import InterpolantStep
    from sinkflow.runtime.checkpoint import load

    weights, synced = {}, None
    with scratch_dir():  # run folders are relative to the working directory
        for mode in ("never", "always"):
            cfg = config.resolve("moons", [f"experiment.device={device.type}", "experiment.method=otcfm",
                                           f"train.velocity.iters={size['train_steps']}", "train.velocity.log_every=5",
                                           f"train.velocity.prefetch={mode}", f"experiment.name={mode}"])
            run = RunFolder.create(cfg)
            guard = NoSyncOnOrdinarySteps(device)
            Trainer(run, InterpolantStep("velocity", *distributions(cfg), ot_pairs=True), [guard]).fit()
            run.logger.close()
            weights[mode] = load(run.dir / "checkpoints" / "velocity" / "final.pt")["model"]
            synced = guard.steps
    dw = max(float((weights["never"][k].float() - weights["always"][k].float()).abs().max()) for k in weights["never"])
    print(f"OT-CFM batches drawn ahead vs inline, {size['train_steps']} steps: max|dw| {dw:.2e}; "
          f"{synced} ordinary steps ran {'with host syncs made errors' if device.type == 'cuda' else 'on the CPU'}")


def step_graph_check(device: torch.device, size: dict) -> None:
    from sinkflow.engine.step_graph import WARMUP
    from sinkflow.methods.flow_matching import InterpolantStep
    from sinkflow.runtime.checkpoint import load
    from sinkflow.tools.data import real_or_synthetic

    cases = {"moons otcfm fp32 +prefetch +ema": ("moons", ["experiment.method=otcfm", "train.velocity.precision=fp32",
                                                            "train.velocity.prefetch=always", "train.velocity.ema=0.99"]),
             "mnist-shaped fm bf16 UNet": ("mnist", ["experiment.method=fm", "train.velocity.precision=bf16",
                                                     "train.velocity.compile=false", *size["unet"]]),
             # float16: GradScaler's unscale, skip and scale update captured with the step
             "mnist-shaped fm fp16 UNet": ("mnist", ["experiment.method=fm", "train.velocity.precision=fp16",
                                                     "train.velocity.compile=false", *size["unet"]])}
    with scratch_dir():  # run folders are relative to the working directory
        for case, (label, (preset, overrides)) in enumerate(cases.items()):
            final, captured, synced = {}, None, 0
            with real_or_synthetic(config.resolve(preset), force=preset == "mnist"):
                for mode in ("none", "step"):
                    cfg = config.resolve(preset, [f"experiment.device={device.type}", *overrides,
                                                  f"train.velocity.iters={size['train_steps']}",
                                                  "train.velocity.log_every=5", f"train.velocity.graph={mode}",
                                                  f"experiment.name=graph{case}-{mode}"])
                    run = RunFolder.create(cfg)
                    guard = NoSyncOnOrdinarySteps(device, after=WARMUP + 1)  # the capture itself syncs once
                    trainer = Trainer(run, InterpolantStep("velocity", *distributions(cfg),
                                                           ot_pairs=cfg["experiment"]["method"] == "otcfm"), [guard])
                    trainer.fit()
                    run.logger.close()
                    final[mode] = load(run.dir / "checkpoints" / "velocity" / "final.pt")
                    if mode == "step":
                        captured, synced = trainer.step_graph.replays > 0, guard.steps
            dw = max(float((final["none"]["model"][k].float() - final["step"]["model"][k].float()).abs().max())
                     for k in final["none"]["model"])
            ema = final["none"]["ema"]
            de = "" if ema is None else ", EMA max|dw| %.2e" % max(
                float((ema[k].float() - final["step"]["ema"][k].float()).abs().max()) for k in ema)
            print(f"step graph vs plain step, {label}, {size['train_steps']} steps: max|dw| {dw:.2e}{de}; "
                  f"captured: {captured}; {synced} ordinary steps after the capture "
                  f"{'with host syncs made errors' if device.type == 'cuda' else 'on the CPU'}")


def ot_plan_check(device: torch.device, size: dict) -> None:
    from sinkflow.ot.exact import ot_permutation

    g = torch.Generator().manual_seed(5)
    same, gap = 0, 0.0
    trials = 3 if size is SMOKE else 20
    for _ in range(trials):
        x0 = torch.randn(size["rows"], 1, 28, 28, generator=g)
        x1 = torch.rand(size["rows"], 1, 28, 28, generator=g) * 2 - 1
        host, there = ot_permutation(x0, x1), ot_permutation(x0.to(device), x1.to(device)).cpu()
        same += bool(torch.equal(host, there))
        cost = torch.cdist(x0.flatten(1).double(), x1.flatten(1).double()) ** 2
        idx = torch.arange(size["rows"])
        gap = max(gap, abs(float(cost[idx, host].sum() - cost[idx, there].sum())))
    print(f"OT plan with the cost on {device.type} vs on the host, {trials} batches of {size['rows']} (1,28,28): "
          f"same permutation {same}/{trials}, max matched-cost difference {gap:.2e}")


def flow_check(device: torch.device, size: dict) -> None:
    from sinkflow.flows import build_flow

    cfg = {"levels": 1, "depth_per_level": 2, "hidden_channels": size["width"] // 4, "memory": "invertible"}
    x = torch.rand(size["rows"], 1, 8, 8, generator=torch.Generator().manual_seed(2)).to(device)
    nll = {}
    for name, kw in (("fused", {"fused": True}), ("for-loop", {"foreach": False})):
        torch.manual_seed(0)
        model = build_flow(cfg, (1, 8, 8)).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, **kw)
        for _ in range(size["adam_steps"]):
            opt.zero_grad()
            (-model.log_prob(x).mean()).backward()
            opt.step()
        fresh = build_flow(cfg, (1, 8, 8)).to(device)
        fresh.load_state_dict(model.state_dict())
        with torch.no_grad():
            nll[name], nll[name + " fresh"] = float(-model.log_prob(x).mean()), float(-fresh.log_prob(x).mean())
    print(f"invertible Glow, {size['adam_steps']} Adam steps: fused vs its fresh copy "
          f"|dnll| {abs(nll['fused'] - nll['fused fresh']):.2e}, fused vs for-loop |dnll| "
          f"{abs(nll['fused'] - nll['for-loop']):.2e}")


def many_phases_check(device: torch.device, size: dict) -> None:
    """Many captured phases in one process, batches drawn ahead: each phase makes new prefetch-worker streams, and
    CUDA's stream pool hands out 32 round-robin. While the capture used a stream of that pool, the 8th phase of a
    process died in the prefetcher's event wait ("CUDA error: invalid argument", H100, 2026-11-27): a worker's stream
    had come round to be the capture stream. The capture stream now comes from the high-priority pool."""
    from sinkflow.methods.flow_matching import InterpolantStep

    phases = size["phases"]
    left: list[float] = []  # MiB allocated after each phase's release (CUDA)
    with scratch_dir():  # run folders are relative to the working directory
        replays, fresh = 0, 0
        for i in range(phases):
            cfg = config.resolve("moons", [f"experiment.device={device.type}", "experiment.method=otcfm",
                                           "train.velocity.iters=12", "train.velocity.prefetch=always",
                                           "train.velocity.graph=step", f"experiment.name=phase{i}"])
            run = RunFolder.create(cfg)
            trainer = Trainer(run, InterpolantStep("velocity", *distributions(cfg), ot_pairs=True))
            trainer.fit()
            run.logger.close()
            replays += trainer.step_graph.replays
            if trainer.step_graph.stream is not None:  # 64 plain streams: two turns of the pool
                fresh += sum(torch.cuda.Stream(device) == trainer.step_graph.stream for _ in range(64))
            del trainer
            run.release()  # as run_phases between phases
            if device.type == "cuda":
                left.append(torch.cuda.memory_allocated(device) / 2**20)
    print(f"{phases} captured phases in one process with batches drawn ahead: all finished, {replays} replays; "
          f"plain streams equal to a capture stream: {fresh}")
    # each phase's streams (capture, prefetch workers) got cuBLAS workspaces torch keeps for good (64 MiB a stream
    # on an H200) until RunFolder.release dropped them: flat is right, a climb of ~64 MiB a stream is the leak
    print("allocated after each phase's release: " + (" ".join(f"{v:.1f}" for v in left) + " MiB" if left else
                                                      "not measured on the CPU"))


class HostReadInForward(Callback):
    """A network a CUDA graph cannot hold: its forward reads a value on the host (``float``), as a user's network that
    logs or branches on a tensor does. Hooked in at set-up, on the phase's own model."""

    def on_setup(self, trainer):
        def read(module, args, out) -> None:  # returns None: the output is kept
            self.last = float(out.detach().float().abs().mean())

        trainer.model.register_forward_hook(read)


class Reserved(Callback):
    """The caching allocator's reserved bytes after every step (CUDA): a failed capture left listed as underway made
    it defer the free of every prefetched batch for good, a step's batch more each step."""

    def __init__(self):
        self.bytes: list[int] = []

    def on_train_batch_end(self, trainer, batch, outputs):
        if trainer.device.type == "cuda":
            self.bytes.append(torch.cuda.memory_reserved(trainer.device))


def capture_fallback_check(device: torch.device, size: dict) -> None:
    import logging

    from sinkflow.methods.flow_matching import InterpolantStep
    from sinkflow.runtime.checkpoint import load
    from sinkflow.tools.data import real_or_synthetic

    final, warned, left, grew = {}, [], None, None

    class Warnings(logging.Handler):
        def emit(self, record):
            warned.append(record.getMessage())

    handler = Warnings(logging.WARNING)
    logging.getLogger("sinkflow").addHandler(handler)
    try:
        with scratch_dir(), real_or_synthetic(config.resolve("mnist"), force=True):
            for mode in ("none", "auto"):
                cfg = config.resolve("mnist", [f"experiment.device={device.type}", "experiment.method=fm",
                                               "train.velocity.precision=fp16", "train.velocity.compile=false",
                                               *size["unet"], f"train.velocity.iters={size['train_steps']}",
                                               f"train.velocity.graph={mode}", f"experiment.name=fallback-{mode}"])
                run = RunFolder.create(cfg)
                reserved = Reserved()
                trainer = Trainer(run, InterpolantStep("velocity", *distributions(cfg)), [HostReadInForward(),
                                                                                            reserved])
                trainer.fit()
                run.logger.close()
                final[mode] = load(run.dir / "checkpoints" / "velocity" / "final.pt")["model"]
                if mode == "auto":
                    left = "the step graph" if trainer.step_graph is not None else "the plain step"
                    run.release()  # empty_cache, as between phases: an internal assert while a capture is underway
                    grew = reserved.bytes[-1] - reserved.bytes[len(reserved.bytes) // 2] if reserved.bytes else None
    finally:
        logging.getLogger("sinkflow").removeHandler(handler)
    dw = max(float((final["none"][k].float() - final["auto"][k].float()).abs().max()) for k in final["none"])
    finite = all(bool(torch.isfinite(v).all()) for v in final["auto"].values())
    said = [w for w in warned if "training without the step graph" in w]
    print(f"a host read in the forward under graph=auto, {size['train_steps']} fp16 steps: ended on {left}; "
          f"{len(said)} fall-back warning(s){': ' + said[0][:160] if said else ''}; weights finite: {finite}; "
          f"max|dw| vs graph=none {dw:.2e}; reserved memory over the second half of the steps "
          f"{'n/a (cpu)' if grew is None else f'+{grew / 2**20:.1f} MiB'} (flat: no batch's free deferred), "
          "then the cache emptied as between phases")


def split_step_check(device: torch.device, size: dict) -> None:
    from _dist import group_of_one

    from sinkflow.methods.flow_matching import InterpolantStep
    from sinkflow.runtime.checkpoint import load
    from sinkflow.tools.data import real_or_synthetic

    final, replays = {}, {}
    with scratch_dir(), real_or_synthetic(config.resolve("mnist"), force=True):
        for mode in ("one graph", "split"):
            # in a process group the trainer averages a captured step's gradients: here a group of one
            with group_of_one(device) if mode == "split" else contextlib.nullcontext():
                cfg = config.resolve("mnist", [f"experiment.device={device.type}", "experiment.method=fm",
                                               "train.velocity.precision=fp16", "train.velocity.compile=false",
                                               *size["unet"], f"train.velocity.iters={size['train_steps']}",
                                               "train.velocity.graph=step", f"experiment.name=split-{len(final)}"])
                run = RunFolder.create(cfg)
                trainer = Trainer(run, InterpolantStep("velocity", *distributions(cfg)))
                trainer.fit()
                run.logger.close()
                final[mode] = load(run.dir / "checkpoints" / "velocity" / "final.pt")["model"]
                replays[mode] = (trainer.step_graph.replays, trainer.grad_sync is not None)
    dw = max(float((final["one graph"][k].float() - final["split"][k].float()).abs().max()) for k in final["split"])
    print(f"split step (backward graph, all-reduce, update graph) vs one graph, {size['train_steps']} fp16 steps in a "
          f"process group of one: max|dw| {dw:.2e}; replays {replays['split'][0]} (one graph: "
          f"{replays['one graph'][0]}); gradients all-reduced: {replays['split'][1]}")


CHECKS = {"pool": pool_check, "noise": noise_check, "adam": adam_check, "prefetch": prefetch_check,
          "ot_plan": ot_plan_check, "step_graph": step_graph_check, "flow": flow_check,
          "many_phases": many_phases_check, "capture_fallback": capture_fallback_check, "split_step": split_step_check}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's arguments (benchmarks/gpu_session.py checks its plan with this before a GPU call)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (the point of the checks) or cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny pool and Adam run (a check of the script)")
    ap.add_argument("--checks", nargs="+", default=list(CHECKS), choices=list(CHECKS),
                    help="run only these checks (default all; a short device call runs the ones not yet run there)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # one line for a name torch does not know ('--device gpu0' was a RuntimeError traceback) and for CUDA without one
    device = checked_device(args.device)
    size = SMOKE if args.smoke else FULL
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"gpu_checks on {where}, torch {torch.__version__}{' (smoke sizes)' if args.smoke else ''}")
    for name in args.checks:
        CHECKS[name](device, size)


if __name__ == "__main__":
    main()
