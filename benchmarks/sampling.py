"""Sampling throughput (images/s) of the CIFAR-10 UNet at the NSGF++ NFE (~60 UNet evaluations per image).

Euler integration with sinkflow.methods.ode.euler (the sampler `sinkflow sample` uses), NFE counted by
forward hooks, in inference mode; fp32 NCHW versus bf16 and fp16 autocast (NCHW: what `sample.precision=bf16` /
`fp16` runs; and bf16 channels_last), and with
``--compile`` the network as ``sample.compile=true`` runs it, in fp32 and under bf16 and fp16 autocast
(``compiled_for_sampling``: on CUDA each batch shape captured once as a CUDA graph, replayed every Euler step;
compile time excluded, reported apart), also channels_last under bf16 (inductor fuses GroupNorm there, which is
what made channels_last lose in eager), at several batch sizes. What the half formats do to the samples themselves:
``sample_precision.py`` (trained MNIST runs, FD-CNN paired with fp32 on the same noise).
Weights are random: the cost of a forward pass does not depend on them.

    python benchmarks/sampling.py --compile       # GPU: CIFAR UNet, batches 64 256 1024, 60 NFE
    python benchmarks/sampling.py --smoke         # CPU: tiny UNet, ratios only
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from sinkflow.methods.ode import compiled_for_sampling, count_nfe, euler
from sinkflow.models import UNET_PRESETS, build_model
from sinkflow.runtime.autocast import autocast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import checked_device, positive_int  # noqa: E402
from results_md import machine  # noqa: E402

SMOKE_UNET = {"channels": 32, "res_blocks": 1, "channel_mult": [1, 2], "num_heads": 1, "num_head_channels": -1,
              "attention_resolutions": [4], "dropout": 0.0}


def images_per_s(model, n, shape, nfe, device, precision: str, channels_last: bool,
                 repeats: int) -> tuple[float, int, float]:
    """(images/s, NFE counted by the hooks, seconds of the untimed first pass: warm-up and any compile) under
    ``precision``'s autocast (fp32 / bf16 / fp16, as ``sample.precision``)."""
    x0 = torch.randn(n, *shape, device=device)
    if channels_last:
        x0 = x0.contiguous(memory_format=torch.channels_last)

    def go():
        with torch.inference_mode(), autocast(device.type, precision), count_nfe(model) as counter:
            x, _ = euler(model, x0, 0.0, 1.0, nfe)
        return counter.count

    start = time.perf_counter()
    go()  # warm-up (cudnn autotune, allocator, compile)
    if device.type == "cuda":
        torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(repeats):
        count = go()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return repeats * n / (time.perf_counter() - start), count, warmup_s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--nfe", type=positive_int, default=None, help="UNet evaluations per image (default 60; smoke 2)")
    ap.add_argument("--batches", type=positive_int, nargs="+", default=None, help="default 64 256 1024 (smoke 4)")
    ap.add_argument("--repeats", type=positive_int, default=None, help="timed repeats (default 3; smoke 1)")
    ap.add_argument("--compile", action="store_true", help="also the fp32 network compiled as sample.compile=true "
                    "runs it (on a CPU: minutes of compiling even at smoke sizes)")
    ap.add_argument("--cudnn-benchmark", action="store_true",
                    help="let cuDNN time its convolution algorithms (torch.backends.cudnn.benchmark); off by default, "
                         "as in `sinkflow train` / `sample` (the rows of 2026-11-22 to 27 were measured with it on)")
    ap.add_argument("--smoke", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = checked_device(args.device)  # not in parse_args: gpu_session.py checks a GPU plan with that on a CPU
    smoke = args.smoke or device.type == "cpu"
    shape = (3, 16, 16) if smoke else (3, 32, 32)
    nfe = args.nfe if args.nfe is not None else (2 if smoke else 60)
    batches = args.batches if args.batches is not None else ([4] if smoke else [64, 256, 1024])
    repeats = args.repeats if args.repeats is not None else (1 if smoke else 3)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark  # what sinkflow's runner uses: off unless asked
    torch.manual_seed(0)
    model = build_model("unet", SMOKE_UNET if smoke else UNET_PRESETS["cifar10"], shape).to(device).eval()
    fast_model = build_model("unet", SMOKE_UNET if smoke else UNET_PRESETS["cifar10"], shape).to(device).eval()
    fast_model.load_state_dict(model.state_dict())
    fast_model = fast_model.to(memory_format=torch.channels_last)
    print(f"sampling: {'smoke UNet 16x16' if smoke else 'CIFAR-10 UNet'}, Euler, {nfe} NFE (NSGF++ CIFAR: 59), "
          f"cudnn.benchmark {'on' if args.cudnn_benchmark else 'off'}, on {machine(device)}")
    compiled = compiled_for_sampling(model, device) if args.compile else None
    compiled_cl = compiled_for_sampling(fast_model, device) if args.compile else None
    print(f"{'batch':>6} {'NFE':>4} {'fp32 img/s':>11} {'bf16':>6} {'fp16':>6} {'bf16+CL':>8}"
          + (f" {'compiled':>9} {'compiled bf16':>14} {'compiled fp16':>14} {'compiled bf16+CL':>17} {'compile s':>10}"
             if compiled is not None else ""))
    for n in batches:
        plain, count, _ = images_per_s(model, n, shape, nfe, device, "fp32", False, repeats)
        bf16, _, _ = images_per_s(model, n, shape, nfe, device, "bf16", False, repeats)
        fp16, _, _ = images_per_s(model, n, shape, nfe, device, "fp16", False, repeats)
        fast, _, _ = images_per_s(fast_model, n, shape, nfe, device, "bf16", True, repeats)
        shown = f"{plain:>11.1f}" if device.type == "cuda" else f"{'(cpu)':>11}"
        line = f"{n:>6} {count:>4} {shown} {bf16 / plain:>5.2f}x {fp16 / plain:>5.2f}x {fast / plain:>7.2f}x"
        if compiled is not None:
            comp, comp_count, compile_s = images_per_s(compiled, n, shape, nfe, device, "fp32", False, repeats)
            assert comp_count == count, f"the compiled network was called {comp_count} times, not {count}"
            comp_bf, _, compile_bf_s = images_per_s(compiled, n, shape, nfe, device, "bf16", False, repeats)
            comp_fp, _, compile_fp_s = images_per_s(compiled, n, shape, nfe, device, "fp16", False, repeats)
            comp_cl, _, compile_cl_s = images_per_s(compiled_cl, n, shape, nfe, device, "bf16", True, repeats)
            line += (f" {comp / plain:>8.2f}x {comp_bf / plain:>13.2f}x {comp_fp / plain:>13.2f}x "
                     f"{comp_cl / plain:>16.2f}x {compile_s + compile_bf_s + compile_fp_s + compile_cl_s:>10.1f}")
        print(line)


if __name__ == "__main__":
    main()
