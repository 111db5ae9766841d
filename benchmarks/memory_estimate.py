"""The preflight memory estimate against the measured CUDA peak, per phase, for the mnist and cifar10 presets.

    python benchmarks/memory_estimate.py                          # CPU: estimates only (GPU rows pending)
    python benchmarks/memory_estimate.py --gpu H100               # CPU: estimates for that card's precision
    python benchmarks/memory_estimate.py --device cuda --out FILE.md

Real configs (model, batch sizes, precision, pool batch and steps), synthetic images of the real shape
(no data set is needed). Measured, for a training phase: the peak of ``torch.cuda.max_memory_allocated`` above what
was allocated before the phase's trainer was built (the scratch run's earlier phases done and released), over the
phase's own ``train_step`` on its real batch: steps 2 to 7 (the first step's one-off work, Adam's state made and
a compiled model compiled, is left out; then the step graph's last eager warm-ups, its capture and 3 replays). The
capture is in the window because a replay allocates nothing: the activations live in the graph's private pool,
allocated while it is recorded, and a window of replays alone saw the weights, gradients, moments and workspaces
only (the mnist velocity row read 150 MiB against 542 estimated on an H200). A frozen network of an earlier phase
that the phase holds (``TrainingStep.frozen``, NSGF++'s velocity network for its NSGF states) is counted as the
estimate counts it: loaded while the phase opens it is in the peak; loaded before (by an earlier phase of the same
scratch run) its weights are added. cuBLAS's workspace for the phase's step-graph stream is allocated in the window
(the estimate's ``cuda workspaces``); a stream's workspace made before the trainer (the default stream's, by an
earlier phase) is in the base and not counted. For the pool: the peak above the allocation before one pool batch's
Sinkhorn trajectory is simulated (``pool.in_flight=1``).

A plan depends on the card: ``auto`` precision trains in half precision on a card with bf16 tensor cores and in
fp32 without (or with no card named, as ``sinkflow preflight`` without ``--gpu``), about twice the activations. The
table names the card planned for and each training phase's precision: on CUDA the card measured, on a CPU the
``--gpu`` card, or none.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sinkflow import config, methods  # noqa: E402
from sinkflow.errors import SinkflowError  # noqa: E402
from sinkflow.runtime.autocast import bf16_tensor_cores  # noqa: E402
from sinkflow.engine.step_graph import WARMUP  # noqa: E402
from sinkflow.tools import memory_plan  # noqa: E402
from sinkflow.tools.cards import GPUS, gpu_bytes  # noqa: E402
from sinkflow.tools.data import real_or_synthetic  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import checked_device  # noqa: E402


def measure_pool(cfg, phase_name, device, workdir) -> int:
    from sinkflow.ot.velocity import simulate_sinkhorn_flow

    p, sk = cfg["pool"], cfg["sinkhorn"]
    shape = methods.sample_shape(cfg)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    x0 = torch.randn(1, p["batch_size"], *shape, device=device)
    y = torch.rand(1, p["batch_size"], *shape, device=device) * 2 - 1
    xs, vs = simulate_sinkhorn_flow(x0, y, steps=p["steps"], eta=p["eta"], blur=sk["blur"], scaling=sk["scaling"],
                                    diameter=sk["diameter"], backend=sk["backend"], batched=True)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del xs, vs, x0, y
    return peak


def measure_train(cfg, phase_name, device, workdir) -> int:
    from sinkflow.tools.phases import ready_trainer, scratch_run

    run, task = scratch_run(cfg, phase_name, workdir)
    torch.cuda.synchronize(device)
    # the phase's own memory: what the earlier phases left (frozen networks, cuBLAS workspaces) is in the base
    base = torch.cuda.memory_allocated(device)
    loaded = run.loaded_models
    held = sum(memory_plan.weight_bytes(loaded[name]) for name in task.frozen() if name in loaded)
    phase = ready_trainer(run, task)
    batch = phase.batch
    phase.train_step(batch)  # Adam's moments made, a compiled model compiled: one-off work, left out
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)  # the peak from here on starts at what is allocated now
    # the step graph's last eager warm-ups, its capture (WARMUP + 1: where its activations are allocated, in the
    # graph's pool) and 3 replays, which allocate nothing; without a step graph, 6 eager steps
    for _ in range(WARMUP + 3):
        phase.train_step(batch)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base + held
    run.logger.close()
    del phase, run, task, batch
    gc.collect()  # as run_phases does between phases: the trainer's reference cycles hold its model and optimizer
    torch.cuda.empty_cache()
    return peak


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's arguments, checked (benchmarks/gpu_session.py checks its plan with this before a GPU call)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--presets", nargs="*", default=["mnist", "cifar10"])
    ap.add_argument("--gpu", metavar="NAME", help=f"plan for this card on a CPU, as `sinkflow preflight --gpu` does "
                                                    f"({', '.join(GPUS)}); default: no card (fp32)")
    ap.add_argument("--out", help="write the markdown table here too")
    args = ap.parse_args(argv)
    if args.gpu and args.device != "cpu":
        ap.error(f"--gpu {args.gpu} plans for a card not in hand: on --device {args.device} the plan is for the card "
                 "measured; drop --gpu")
    for preset in args.presets:
        try:
            config.load_preset(preset)
        except SinkflowError as exc:
            ap.error(f"--presets {preset}: {exc}")
    try:
        args.card = gpu_bytes(args.gpu)[0] if args.gpu else None  # the planner's name for it (H100 -> H100-80GB)
    except SinkflowError as exc:
        ap.error(f"--gpu: {exc.problem}; use one of {', '.join(GPUS)}")
    return args


def measurer(pm):
    """The function that measures phase ``pm`` on CUDA, or None for a kind not measured here (sample+eval, whose
    estimate is not validated, and a phase the planner does not estimate). A kind this script does not know stops
    it: the pool's kind was renamed (pool -> chunked) and every pool row then read "not measured" without a word."""
    if pm.kind == "chunked" and pm.phase == "pool":  # the pool is the planner's only chunked task (PoolTask)
        return measure_pool
    if pm.kind == "train":
        return measure_train
    if pm.kind in ("sample", "other"):
        return None
    raise SystemExit(f"memory_estimate: phase {pm.phase} has kind {pm.kind}, which this script cannot measure: "
                     "add it to measurer()")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = checked_device(args.device)  # not in parse_args: gpu_session.py checks a GPU plan with that on a CPU
    cuda = device.type == "cuda"
    # what `auto` precision becomes: on CUDA the card measured decides, on a CPU the card named (none: fp32)
    bf16 = bf16_tensor_cores(device) if cuda else memory_plan.card_bf16(args.card)
    rows = ["| preset | phase | precision | estimate | measured | estimate / measured | terms |",
            "|---|---|---|---|---|---|---|"]
    for preset in args.presets:
        cfg = config.resolve(preset, [f"experiment.device={args.device}", "pool.in_flight=1", "data.download=false"],
                             unread="ignore")  # one list for every preset: a flow has no pool, 2D no download
        with real_or_synthetic(cfg, force=True), tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            mems = memory_plan.estimate(cfg, bf16=bf16)  # what `auto` runs on that card
            print(f"{preset}: estimated in {time.perf_counter() - t0:.1f}s", flush=True)
            for i, pm in enumerate(mems):
                measure = measurer(pm)  # on a CPU too: an unknown kind stops the smoke run, not the GPU call
                measured = measure(cfg, pm.phase, device, Path(tmp) / f"{pm.phase}{i}") if cuda and measure else None
                meas = memory_plan.fmt_bytes(measured) if measured else ("not measured" if cuda else "pending (GPU)")
                ratio = f"{pm.total / measured:.3f}" if measured else "-"
                precision = pm.precision if pm.kind in ("train", "sample") else "-"  # sample: the sampler's
                terms = ", ".join(f"{k} {memory_plan.fmt_bytes(v)}" for k, v in pm.terms.items())
                rows.append(f"| {preset} | {pm.phase} | {precision} | {memory_plan.fmt_bytes(pm.total)} | {meas} | "
                            f"{ratio} | {terms} |")
                print(rows[-1], flush=True)
    dev = torch.cuda.get_device_name(device) if cuda else "CPU (estimates only)"
    plan = ("planned for this card" if cuda else f"planned for {args.card}" if args.card else
            "planned for no named card, as `sinkflow preflight` without --gpu (--gpu NAME names one)")
    half = "fp16 where the network has a half-precision path, else fp32" if bf16 else "fp32"
    text = (f"Memory estimate vs measured peak on {dev}, torch {torch.__version__}; {plan}: each training phase and "
            f"the sampler in the precision `auto` takes there ({half}; the precision column)\n\n" + "\n".join(rows)
            + "\n")
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
