"""Training throughput (images/s) of the CIFAR-10 UNet: fp32 eager vs sinkflow's fast path vs torchcfm's step.

All three run in the same process on the same synthetic data (N(0,1) noise -> tanh-squashed images,
already on the device, so this measures the training step, not the data path; see `sinkflow bench
--profile` for that):

- ``fp32-eager``: sinkflow's Trainer.train_step with precision=fp32, NCHW, a plain for-loop Adam
  (foreach=False), the EMA, grad clip 1.0: the slow baseline every fast path is compared with.
- ``fast``: the same Trainer.train_step with bf16 autocast (fp32 master weights), NCHW, fused Adam,
  foreach-lerp EMA; ``fast+CL`` the same in channels_last (the CUDA default until 2026-11-26, measured
  slower on the ``mnist`` UNet); ``--compile`` adds ``fast+compile`` (torch.compile, default mode) and
  ``fast+graphs`` (mode reduce-overhead: CUDA graphs of the model, the CUDA default for UNet phases 2026-11-26 to 27) and
  ``fast+CL+graphs`` (the same in channels_last: no cuDNN layout transposes around each convolution).
  ``fast+stepgraph``: ``fast`` with the whole step (loss, backward, clip, Adam) one CUDA graph
  (``train.velocity.graph=step``, the CUDA default since 2026-11-27); ``--compile`` adds ``fast+compile+stepgraph``
  (compile's default mode inside it), the same in channels_last, and ``fp16+compile+stepgraph`` (float16
  autocast, GradScaler inside the graph: the CUDA default since 2026-11-27) with its channels_last twin,
  ``fp16+compile+stepgraph+cudnn`` (the same with cuDNN's algorithm timing on) and ``fp16+autotune+stepgraph``
  (``compile_mode=max-autotune-no-cudagraphs``: inductor's kernels chosen by timing).
  ``--paths`` times a chosen few (fp32-eager always: the baseline); ``--repeats N`` times every path N times in
  turn, after all warm-ups, and shows the median with the range.
- ``torchcfm``: torchcfm's own train_cifar10.py step on its UNetModelWrapper of the same size
  (fp32, ConditionalFlowMatcher, Adam, grad clip, its per-tensor EMA copy), when torchcfm is installed.

    python benchmarks/train_throughput.py                   # GPU: the paper's CIFAR UNet, batch 128
    python benchmarks/train_throughput.py --smoke           # CPU: tiny UNet, a check that every path runs

``--smoke`` checks the script and measures nothing: its timed steps (3 after 1 warm-up) still hold each new model's
slow first steps, so its ratios move with the warm-up alone (torchcfm 0.02x, ``fast`` 0.91x; with 5 and 5 steps
0.88x and 1.38x; one run on the shared 2-core CPU put ``fast+CL`` at 0.04x, 2026-11-27), and a CPU's ratios are not
a GPU's anyway. The ``% bf16 peak`` column is of the bf16 matrix-product peak measured on the card; off CUDA there is
none (a CPU's autocast multiplies in fp32): n/a.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import types
from pathlib import Path

import torch

from sinkflow import config
from sinkflow.methods.flow_matching import InterpolantStep
from sinkflow.models import UNET_PRESETS, build_model, count_parameters
from sinkflow.engine.finite import skips_on_device
from sinkflow.engine.trainer import Trainer
from sinkflow.tools.throughput import peak_flops, step_flops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import at_least, checked_device, positive_int  # noqa: E402
from results_md import machine  # noqa: E402

SMOKE_UNET = {"channels": 32, "res_blocks": 1, "channel_mult": [1, 2], "num_heads": 1, "num_head_channels": -1,
              "attention_resolutions": [4], "dropout": 0.1}


def train_config(steps: int, *, precision: str, channels_last: bool, compile_: bool, mode: str = "default",
                 graph: str = "none") -> dict:
    """The cifar10 preset's resolved config with the benchmark's recipe (torchcfm's: lr 2e-4, no warm-up, constant
    LR, grad clip 1.0, EMA 0.9999) as overrides: every key the schema adds later comes with its default, so a new
    train key can never break the benchmark again (a hand-built dict once lacked ``iters``)."""
    v = "train.velocity."
    return config.resolve("cifar10", [f"{v}iters={steps}", f"{v}lr=2e-4", f"{v}lr_scaling=none", f"{v}warmup=0",
                                      f"{v}schedule=constant", f"{v}grad_clip=1.0", f"{v}ema=0.9999", f"{v}accum=1",
                                      f"{v}precision={precision}", f"{v}channels_last={str(channels_last).lower()}",
                                      f"{v}compile={str(compile_).lower()}", f"{v}compile_mode={mode}",
                                      f"{v}graph={graph}", "experiment.seed=0"])


def sinkflow_phase(unet_cfg, shape, device, steps, *, precision, channels_last, compile_, plain_adam,
                   mode="default", graph="none"):
    """A Trainer set up exactly as `sinkflow train` does, with the model and shape passed in."""
    torch.manual_seed(0)
    model = build_model("unet", unet_cfg, shape)
    cfg = train_config(steps, precision=precision, channels_last=channels_last, compile_=compile_, mode=mode,
                       graph=graph)
    run = types.SimpleNamespace(cfg=cfg, device=device)
    phase = Trainer(run, InterpolantStep("velocity", None, None), shape=shape, model=model)
    phase.setup()
    if device.type != "cuda":  # CPU smoke: exercise channels_last too (it is CUDA-gated in setup)
        if channels_last:
            phase.model.to(memory_format=torch.channels_last)
            phase.channels_last = True
    if plain_adam:
        phase.optimizer = torch.optim.Adam(phase.model.parameters(), lr=2e-4, foreach=False)
        phase.scheduler = torch.optim.lr_scheduler.LambdaLR(phase.optimizer, lambda s: 1.0)
        # the for-loop Adam cannot skip a non-finite update on the device (fused Adam's found_inf): the Trainer
        # must check on the host for it, as it does for any such optimizer
        phase.skip_on_device = skips_on_device(phase.optimizer) and not phase.scaler.is_enabled()
    return phase, count_parameters(phase.model)


def make_batches(n, shape, device, count, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x1 = torch.tanh(torch.randn(count, n, *shape, generator=g, device=device))
    return x1


def time_steps(step, batches, warmup, device) -> float:
    for i in range(warmup):
        step(batches[i % len(batches)])
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(len(batches)):
        step(batches[i])
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_sinkflow(phase, x1s, device):
    def step(x1):
        x0 = torch.randn_like(x1)
        t = torch.rand(x1.shape[0], device=device)
        tb = t.view(-1, 1, 1, 1)
        phase.train_step((tb * x1 + (1 - tb) * x0, t, x1 - x0))
    return step


def torchcfm_step(unet_cfg, shape, device):
    """torchcfm's examples/images/cifar10/train_cifar10.py inner loop, fp32 (its recipe)."""
    from torchcfm.conditional_flow_matching import ConditionalFlowMatcher
    from torchcfm.models.unet.unet import UNetModelWrapper

    torch.manual_seed(0)
    net = UNetModelWrapper(dim=shape, num_res_blocks=unet_cfg["res_blocks"], num_channels=unet_cfg["channels"],
                           channel_mult=unet_cfg["channel_mult"], num_heads=unet_cfg["num_heads"],
                           num_head_channels=unet_cfg["num_head_channels"],
                           attention_resolutions=",".join(str(shape[-1] // r) for r in unet_cfg["attention_resolutions"]),
                           dropout=0.1).to(device)
    ema_model = copy.deepcopy(net)
    optim = torch.optim.Adam(net.parameters(), lr=2e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda=lambda s: min(s, 5000) / 5000)
    fm = ConditionalFlowMatcher(sigma=0.0)

    def ema(source, target, decay):  # torchcfm/examples/images/cifar10/utils_cifar.py
        source_dict, target_dict = source.state_dict(), target.state_dict()
        for key in source_dict.keys():
            target_dict[key].data.copy_(target_dict[key].data * decay + source_dict[key].data * (1 - decay))

    def step(x1):
        optim.zero_grad()
        x0 = torch.randn_like(x1)
        t, xt, ut = fm.sample_location_and_conditional_flow(x0, x1)
        vt = net(t, xt)
        loss = torch.mean((vt - ut) ** 2)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optim.step()
        sched.step()
        ema(net, ema_model, 0.9999)
        loss.item()  # the recipe logs the loss every step

    return step, sum(p.numel() for p in net.parameters())


PROFILED = 3  # steps run under the profiler for --profile (each Trainer's budget covers them)


def kernel_table(step, x1s, device, rows: int = 20) -> str:
    """The top kernels (CUDA) or ops (CPU) by self time over ``PROFILED`` steps: convolutions vs normalisation vs
    elementwise vs optimizer, the split that says which fast path can still pay."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        for i in range(PROFILED):
            step(x1s[i % len(x1s)])
        if cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def path_configs(compile_: bool) -> list[tuple[str, dict]]:
    """The timed paths by name (``--compile`` adds the compiled ones), each the keywords of ``sinkflow_phase``."""
    fast = dict(precision="bf16", channels_last=False, compile_=False, plain_adam=False)
    configs = [("fp32-eager", dict(precision="fp32", channels_last=False, compile_=False, plain_adam=True)),
               ("fast", fast), ("fast+CL", {**fast, "channels_last": True}),
               ("fast+stepgraph", {**fast, "graph": "step"})]
    if compile_:
        configs += [("fast+compile", {**fast, "compile_": True}),
                    ("fast+graphs", {**fast, "compile_": True, "mode": "reduce-overhead"}),
                    # fast+graphs spent 22 % of its device time in cuDNN's NCHW <-> NHWC transposes (H100, 2026-11-26);
                    # channels_last lost in eager only through GroupNorm, which inductor fuses here
                    ("fast+CL+graphs", {**fast, "channels_last": True, "compile_": True, "mode": "reduce-overhead"}),
                    ("fast+compile+stepgraph", {**fast, "compile_": True, "graph": "step"}),
                    ("fast+CL+compile+stepgraph", {**fast, "channels_last": True, "compile_": True, "graph": "step"}),
                    # float16 autocast with GradScaler inside the captured step (fp16 tensor cores: as fast as bf16's);
                    # fp16+compile+stepgraph is the CUDA default for this UNet since 2026-11-27 (channels_last off)
                    ("fp16+compile+stepgraph", {**fast, "precision": "fp16", "compile_": True, "graph": "step"}),
                    ("fp16+CL+compile+stepgraph", {**fast, "precision": "fp16", "channels_last": True,
                                                   "compile_": True, "graph": "step"}),
                    # the runner's path with cuDNN's algorithm timing on (during the eager warm-up steps; the capture
                    # fixes the choice), beside the same path with it off in one process (--repeats interleaves them)
                    ("fp16+compile+stepgraph+cudnn", {**fast, "precision": "fp16", "compile_": True, "graph": "step",
                                                      "cudnn": True}),
                    # inductor's kernels chosen by timing (Triton templates against cuBLAS / cuDNN) inside the
                    # captured step: the longest compile, so timed last, for the issue-23 goal of 25 % of the peak
                    ("fp16+autotune+stepgraph", {**fast, "precision": "fp16", "compile_": True,
                                                 "mode": "max-autotune-no-cudagraphs", "graph": "step"})]
    return configs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's arguments, checked (benchmarks/gpu_session.py checks its plan with this before a GPU call)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=positive_int, default=None, help="default 128 (GPU), 4 (smoke)")
    ap.add_argument("--steps", type=positive_int, default=None, help="timed steps (default 30 GPU, 3 smoke)")
    ap.add_argument("--warmup", type=at_least(0), default=None, help="untimed steps (default 10 GPU, 1 smoke)")
    ap.add_argument("--compile", action="store_true", help="also time fast + torch.compile")
    ap.add_argument("--profile", default=None, metavar="PATH",
                    help="after timing, run a few steps of this path (e.g. fast+graphs) under the PyTorch profiler and "
                         "print where the device time goes (top kernels)")
    ap.add_argument("--paths", nargs="+", default=None, metavar="PATH",
                    help="time only these paths (and fp32-eager, the baseline); default all")
    ap.add_argument("--cudnn-benchmark", action="store_true",
                    help="let cuDNN time its convolution algorithms (torch.backends.cudnn.benchmark); off by default, "
                         "as in `sinkflow train` / `sample` (the rows of 2026-11-22 to 27 were measured with it on); "
                         "a +cudnn path has it on whatever this says")
    ap.add_argument("--repeats", type=positive_int, default=1,
                    help="timed windows per path, taken in turn over the paths after every path's warm-up (all "
                         "paths stay built meanwhile); the table shows each path's median and the range")
    ap.add_argument("--smoke", action="store_true", help="tiny UNet on 16x16 images (CPU check of the script)")
    args = ap.parse_args(argv)
    unknown = set(args.paths or ()) - {name for name, _ in path_configs(args.compile)}
    if unknown:
        ap.error(f"--paths {' '.join(sorted(unknown))}: not one of "
                 f"{', '.join(n for n, _ in path_configs(args.compile))} (the compiled ones need --compile)")
    # a --profile path that is not timed was profiled never, silently: no table, exit 0, after a whole GPU call
    timed = [n for n, _ in path_configs(args.compile) if not args.paths or n == "fp32-eager" or n in args.paths]
    if args.profile is not None and args.profile not in timed:
        ap.error(f"--profile {args.profile}: not a timed path; profile one of {', '.join(timed)} (or add it to "
                 "--paths; the compiled ones need --compile)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = checked_device(args.device)  # not in parse_args: gpu_session.py checks a GPU plan with that on a CPU
    smoke = args.smoke or device.type == "cpu"
    unet = dict(SMOKE_UNET) if smoke else {**UNET_PRESETS["cifar10"], "dropout": 0.1}
    shape = (3, 16, 16) if smoke else (3, 32, 32)
    batch = args.batch if args.batch is not None else (4 if smoke else 128)
    steps = args.steps if args.steps is not None else (3 if smoke else 30)
    warmup = args.warmup if args.warmup is not None else (1 if smoke else 10)
    x1s = make_batches(batch, shape, device, steps)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark  # what sinkflow's runner uses: off unless asked

    flops, profiled = None, None
    # a share of a peak only on a card (its bf16 peak): the CPU paths here run several precisions, each with a peak
    # of its own (a row once read 52 % of a "bf16 peak" printed as 0 TFLOP/s; `sinkflow bench --throughput` measures
    # a CPU phase's peak in that phase's precision). Measured first, so that each
    # path's line says its share as it is timed: a call cut short (a long compile) keeps the answer of the paths before
    peak = peak_flops(device, "bf16") if device.type == "cuda" else 0.0
    configs = [(name, dict(kw)) for name, kw in path_configs(args.compile)
               if not args.paths or name == "fp32-eager" or name in args.paths]  # fp32-eager stays: the baseline
    rates: dict[str, list[float]] = {}
    params_of: dict[str, int] = {}
    kept: list[tuple[str, bool, object]] = []  # (name, cudnn, step) of the paths timed again (--repeats)
    for name, kw in configs:
        cudnn = kw.pop("cudnn", args.cudnn_benchmark)
        torch.backends.cudnn.benchmark = cudnn  # during the warm-up too: what a capture then fixes
        phase, params_of[name] = sinkflow_phase(unet, shape, device, warmup + args.repeats * steps + PROFILED, **kw)
        if flops is None:  # forward + backward of one step, counted on the eager module (the same arithmetic)
            x1 = x1s[0]
            flops = step_flops(phase, (x1, torch.rand(batch, device=device), x1))
        step = bench_sinkflow(phase, x1s, device)
        rates[name] = [steps * batch / time_steps(step, x1s, warmup, device)]
        share = f", {100 * flops / batch * rates[name][0] / peak:.1f} % of the bf16 peak" if peak > 0 else ""
        print(f"timed {name}: {rates[name][0]:.1f} images/s{share}", flush=True)  # kept if a call is cut short
        if name == args.profile:
            profiled = kernel_table(step, x1s, device)
        if args.repeats > 1:
            kept.append((name, cudnn, step))
        del phase, step
        if device.type == "cuda" and args.repeats == 1:
            torch.cuda.empty_cache()
    try:
        torch.backends.cudnn.benchmark = args.cudnn_benchmark
        step, params_of["torchcfm"] = torchcfm_step(unet, shape, device)
        rates["torchcfm"] = [steps * batch / time_steps(step, x1s, warmup, device)]
        if args.repeats > 1:
            kept.append(("torchcfm", args.cudnn_benchmark, step))
    except ImportError as exc:  # no row and no column for it: a "nan" there would read as a measurement
        print(f"torchcfm not importable ({exc}): its row is skipped")
    for _ in range(args.repeats - 1):  # in turn, so that a drift of the card's clock reaches every path alike
        for name, cudnn, step in kept:
            torch.backends.cudnn.benchmark = cudnn
            rates[name].append(steps * batch / time_steps(step, x1s, 0, device))
    rows = [(name, params_of[name], statistics.median(r)) for name, r in rates.items()]

    if smoke:
        print("SMOKE CHECK, not a measurement: a tiny UNet whose timed steps still hold its first steps' costs; the "
              "ratios below say that each path runs, not which is faster")
    windows = f", the median of {args.repeats} windows a path taken in turn" if args.repeats > 1 else ""
    print(f"train_throughput: {'smoke UNet 16x16' if smoke else 'CIFAR-10 UNet (UNET_PRESETS[cifar10], dropout 0.1)'}, "
          f"batch {batch}, {steps} timed steps after {warmup} warm-up{windows}, cudnn.benchmark "
          f"{'on' if args.cudnn_benchmark else 'off'} (+cudnn paths: on), on {machine(device)}")
    base = rows[0][2]
    ref = dict((r[0], r[2]) for r in rows).get("torchcfm")
    no_peak = "it measured 0" if device.type == "cuda" else "none off CUDA (a CPU's autocast multiplies in fp32)"
    print(f"model FLOPs per training step (forward + backward, torch's FLOP counter): {flops / 1e9:.1f} G "
          f"({flops / batch / 1e9:.2f} G per image); " + (
              f"this card's measured bf16 matrix-product peak {peak / 1e12:.0f} TFLOP/s" if peak > 0 else
              f"% bf16 peak n/a: no measured bf16 matrix-product peak, {no_peak}"))
    print(f"{'path':<29} {'params':>10} {'images/s':>10} {'vs fp32-eager':>14}"
          + (f" {'vs torchcfm':>12}" if ref else "") + f" {'% bf16 peak':>12}" + ("  range" if windows else ""))
    for name, params, ips in rows:
        shown = f"{ips:>10.1f}" if device.type == "cuda" else f"{'(cpu)':>10}"
        share = f"{100 * flops / batch * ips / peak:>11.1f}%" if peak > 0 else f"{'n/a':>12}"
        vs_ref = f" {ips / ref:>11.2f}x" if ref else ""
        spread = (f"  {min(rates[name]):.1f}-{max(rates[name]):.1f}" if device.type == "cuda" else "  (cpu)") \
            if windows else ""
        print(f"{name:<29} {params:>10,} {shown} {ips / base:>13.2f}x{vs_ref} {share}{spread}")
    if profiled is not None:
        print(f"where the time of a {args.profile} step goes ({PROFILED} steps under the PyTorch profiler):")
        print(profiled)


if __name__ == "__main__":
    main()
