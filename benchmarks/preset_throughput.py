"""Training throughput of a preset's phases under candidate fast-path settings, as ratios to a baseline
measured in the same run (`sinkflow bench --throughput` underneath: no per-step sync, wait share, FLOPs, peak).

The question it answers for issue 23: which settings make the `mnist` (or `cifar10`) phases fastest on this
card, and is OT-CFM's step (exact OT pairs, drawn ahead on the prefetch thread) as fast as FM's?

    python benchmarks/preset_throughput.py --preset mnist --device cuda          # one GPU call, a few minutes
    python benchmarks/preset_throughput.py --smoke                                # CPU: tiny UNet, 2 configs

Rows: ``default`` = the preset untouched (``auto`` settings, on CUDA bf16 + the whole step one CUDA graph for UNet
phases);
``baseline`` = fp32, NCHW, no prefetch (each step reads nothing back from the device: that part is
not optional any more); then one factor changed at a time, then all of them together; ``graphs`` rows compile
with ``compile_mode=reduce-overhead`` (CUDA graphs of the model: one replay per forward and backward instead of one
launch per kernel); ``+stepgraph`` rows capture the whole step, optimizer included (``train.<phase>.graph=step``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

from sinkflow import config
from sinkflow.tools.bench import throughput
from sinkflow.tools.throughput import draw_ms

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import at_least, checked_device, positive_int  # noqa: E402
from _dist import group_of_one  # noqa: E402
from results_md import machine  # noqa: E402

CANDIDATES = {
    "default": [],  # the preset as a user runs it: auto precision / compile / graph resolved for this device
    "baseline": ["precision=fp32", "channels_last=false", "prefetch=never", "graph=none"],
    "+prefetch": ["precision=fp32", "channels_last=false", "prefetch=always", "graph=none"],
    "+bf16": ["precision=bf16", "channels_last=false", "prefetch=never", "graph=none"],
    "+channels_last": ["precision=fp32", "channels_last=true", "prefetch=never", "graph=none"],
    "bf16+prefetch": ["precision=bf16", "channels_last=false", "prefetch=always", "graph=none"],
    "bf16+CL+prefetch": ["precision=bf16", "channels_last=true", "prefetch=always", "graph=none"],
    "bf16+CL+prefetch+compile": ["precision=bf16", "channels_last=true", "prefetch=always", "compile=true",
                                 "graph=none"],
    "+graphs": ["precision=fp32", "channels_last=false", "prefetch=never", "compile=true",
                "compile_mode=reduce-overhead", "graph=none"],
    # the CUDA default until 2026-11-27: CUDA graphs of the model only (compile mode reduce-overhead)
    "bf16+prefetch+graphs": ["precision=bf16", "channels_last=false", "prefetch=always", "compile=true",
                             "compile_mode=reduce-overhead", "graph=none"],
    "bf16+CL+prefetch+graphs": ["precision=bf16", "channels_last=true", "prefetch=always", "compile=true",
                                "compile_mode=reduce-overhead", "graph=none"],
    # the whole step (loss, backward, clip, guard, Adam) as one CUDA graph (the CUDA default since 2026-11-27 for
    # the UNet phases and the time predictor), and the same without compiling
    "+stepgraph": ["graph=step"],
    "+stepgraph-nocompile": ["graph=step", "compile=false"],
    # the default's path in the other precisions: float16 (GradScaler inside the graph) and fp32
    "fp16+stepgraph": ["precision=fp16", "graph=step"],
    "fp32+stepgraph": ["precision=fp32", "graph=step"],
    # the step a torchrun job trains with by default (graph: auto is none under DDP, compile: auto off), in one
    # process (DDP's hooks and its all-reduce left out): the baseline the split step below would replace
    "fp16+eager": ["precision=fp16", "graph=none", "compile=false"],
    # a torchrun job's captured step (two graphs, the gradients' all-reduce between: sinkflow.engine.grad_sync),
    # timed in a process group of one (NCCL on a card): what splitting the step costs beside "fp16+stepgraph"
    "fp16+stepgraph+split": ["precision=fp16", "graph=step"],
}
IN_A_GROUP = ("fp16+stepgraph+split",)  # configs measured inside a process group of one process
SMOKE_MODEL = ["model.velocity.channels=8", "model.velocity.attention_resolutions=[]", "model.nsf.channels=8",
               "model.nsf.attention_resolutions=[]"]


UNET_PHASES = ("velocity", "nsf")


def measure(preset: str, method: str, setting: list[str], base: list[str], steps: int, warmup: int,
            phases: tuple[str, ...] = UNET_PHASES) -> list[dict]:
    """The rows of the method's ``phases`` (default its UNet phases: velocity; NSGF++ also nsf) with ``setting``
    applied to each (NSGF++'s time predictor, a small CNN, is the third phase of a full run: ``--phases``)."""
    cfg = config.resolve(preset, [f"experiment.method={method}", *base], unread="ignore")  # one base list for every method
    chosen = [p for p in cfg["train"] if p in phases]
    overrides = [f"train.{p}.{kv}" for p in chosen for kv in setting]
    return [r for r in throughput(config.apply_overrides(cfg, overrides), steps, warmup) if r["phase"] in phases]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's arguments, checked (benchmarks/gpu_session.py checks its plan with this before a GPU call)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mnist")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--methods", nargs="+", default=["fm", "otcfm"], choices=list(config.schema.METHOD_REGISTRY))
    ap.add_argument("--configs", nargs="+", default=None, choices=list(CANDIDATES),
                    help="default: all (smoke: baseline and +prefetch)")
    ap.add_argument("--steps", type=positive_int, default=None, help="timed steps per phase (default 100; smoke 2)")
    ap.add_argument("--warmup", type=at_least(0), default=None,
                    help="untimed steps (default 20, compile needs them; smoke 1)")
    ap.add_argument("--phases", nargs="+", default=list(UNET_PHASES),
                    help="training phases to time (default the UNet phases; NSGF++'s time predictor: time)")
    ap.add_argument("--repeats", type=positive_int, default=1,
                    help="run every method and config this many times, interleaved, and print the medians (and OT-CFM "
                         "/ FM): one 100-step window varies by up to 25 %% between runs on an H100")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the runs (s; Python's default 0.005): how much the prefetch "
                         "worker and the training thread wait for each other's GIL")
    ap.add_argument("--profiler-first", action="store_true",
                    help="open and close the PyTorch profiler once before any graph is captured: its documented "
                         "workaround for graphs captured before the profiler's first use, whose kernels it may not "
                         "record (the busy %% column read 3-4 %% for captured steps on 2026-11-27, 81-87 %% earlier; "
                         "the window also held the phase's log step then, no longer)")
    ap.add_argument("--smoke", action="store_true", help="tiny UNet on synthetic digits, batch 4 (CPU check)")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. train.velocity.batch_size=256")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    checked_device(args.device)  # not in parse_args: gpu_session.py checks a GPU plan with that on a CPU
    if args.profiler_first:
        from torch.profiler._utils import _init_for_cuda_graphs

        _init_for_cuda_graphs()  # pytorch/pytorch#100441
    configs = args.configs or (["baseline", "+prefetch"] if args.smoke else list(CANDIDATES))
    steps = args.steps if args.steps is not None else (2 if args.smoke else 100)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 20)
    base = [f"experiment.device={args.device}", "pool.batches=4", *args.overrides]
    ctx = contextlib.nullcontext()
    if args.smoke:
        from sinkflow.tools.data import real_or_synthetic

        base += [*SMOKE_MODEL, "train.velocity.batch_size=4"]
        ctx = real_or_synthetic(config.resolve(args.preset), force=True)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    print(f"preset {args.preset}, {steps} timed steps after {warmup}, on {machine(args.device)}, "
          f"GIL switch interval {sys.getswitchinterval() * 1e3:g} ms")
    print("loss = mean training loss of the timed steps (same seed and batches in every row: a fast path that "
          "trains something else shows here)")
    print(f"x base = steps/s over the {configs[0]} row of the same method, phase and repeat (the first of --configs)")
    print(f"{'method':<7} {'phase':<9} {'config':<24} {'steps/s':>9} {'x base':>7} {'wait %':>7} {'busy %':>7} "
          f"{'% peak':>7} {'loss':>8} {'draw ms':>8}")
    rates: dict[tuple[str, str, str], list[float]] = {}
    with ctx:
        for _ in range(args.repeats):  # methods interleaved: a drift of the machine hits every method alike
            # each repeat's ratios are to its own base row: with one ``ref`` for all, a later repeat's rows (its base
            # row too, not 1.00x) were divided by the first repeat's window, up to 25 % away on an H100
            ref: dict[tuple[str, str], float] = {}
            for method in args.methods:
                for name in configs:
                    with group_of_one(args.device) if name in IN_A_GROUP else contextlib.nullcontext():
                        rows = measure(args.preset, method, CANDIDATES[name], base, steps, warmup, tuple(args.phases))
                    for row in rows:
                        phase = row["phase"]
                        ref.setdefault((method, phase), row["steps_per_s"])
                        rates.setdefault((method, phase, name), []).append(row["steps_per_s"])
                        busy = f"{100 * row['busy_fraction']:.0f}%" if row.get("busy_fraction") is not None else "-"
                        peak = f"{100 * row['peak_fraction']:.1f}%" if row.get("peak_fraction") is not None else "-"
                        print(f"{method:<7} {phase:<9} {name:<24} {row['steps_per_s']:>9.2f} "
                              f"{row['steps_per_s'] / ref[method, phase]:>6.2f}x {100 * row['wait_fraction']:>6.1f}% "
                              f"{busy:>7} {peak:>7} {row['loss']:>8.4f} {draw_ms(row):>8}", flush=True)
    if args.repeats > 1:
        print(summary(rates))


def summary(rates: dict[tuple[str, str, str], list[float]]) -> str:
    """The median steps/s of every (method, phase, config) over the repeats, and OT-CFM's median against FM's (the
    issue's "OT-CFM within 10 % of FM": the exact OT plan drawn ahead should cost the step nothing)."""
    med = {k: statistics.median(v) for k, v in rates.items()}
    lines = [f"median over {max(len(v) for v in rates.values())} interleaved runs:"]
    for (method, phase, name), m in med.items():
        spread = f"{min(rates[method, phase, name]):.1f}-{max(rates[method, phase, name]):.1f}"
        line = f"{method:<7} {phase:<9} {name:<24} {m:>9.2f} steps/s (range {spread})"
        if method == "otcfm" and ("fm", phase, name) in med:
            line += f"   otcfm / fm {m / med['fm', phase, name]:.2f}"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
