"""Where a 2D training step's time goes on this CPU: the matmul rate, the MLP's forward and backward, the Adam step.

The 2D presets train the paper's MLP (3 x 256, batch 256) for 20k steps, and on a CPU that is most of ``make demo``.
For each thread count this times (after warm-up, the mean over ``--steps`` calls) one ``hidden``^3 float32 matmul, the
MLP's forward, forward + backward, and the whole step (zero_grad, forward, backward, Adam) with foreach Adam (the CPU
default until 2026-11-26) and with fused Adam (the Trainer's kernel now: ``adam_kernel``), and prints the ratio
foreach / fused of the whole step, measured side by side in the same run. The last column is the floor the
arithmetic sets: ``--iters`` steps of forward + backward alone, before the optimizer, the pool or the evaluation.

    python benchmarks/cpu_step.py --threads 1 2 --write     # nothing else running
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import positive_int  # noqa: E402
from results_md import RESULTS, write_section  # noqa: E402


def mean_ms(fn, calls: int, warmup: int = 30) -> float:
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def measure(threads: int, preset: str, steps: int) -> dict:
    """Times in ms for one thread count, on the preset's velocity MLP and batch size."""
    import torch

    from sinkflow import config
    from sinkflow.runtime.run_folder import build_phase_model

    cfg = config.resolve(preset, ["experiment.device=cpu"])
    batch, hidden = int(cfg["train"]["velocity"]["batch_size"]), int(cfg["model"]["velocity"]["hidden"])
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(hidden, hidden, generator=gen), torch.randn(hidden, hidden, generator=gen)
    x, t, y = torch.randn(batch, 2, generator=gen), torch.rand(batch, generator=gen), torch.randn(batch, 2, generator=gen)
    out = {"threads": threads, "batch": batch, "hidden": hidden, "matmul": mean_ms(lambda: a @ b, steps * 4)}
    out["gflops"] = 2 * hidden ** 3 / out["matmul"] / 1e6
    for kind in ("foreach", "fused"):
        torch.manual_seed(0)
        model = build_phase_model(cfg, "velocity", (2,))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, **{kind: True})

        def forward():
            with torch.no_grad():
                model(x, t)

        def forward_backward():
            model.zero_grad(set_to_none=True)
            ((model(x, t) - y) ** 2).mean().backward()

        def step():
            forward_backward()
            opt.step()

        if kind == "foreach":
            out["forward"], out["fwd_bwd"] = mean_ms(forward, steps), mean_ms(forward_backward, steps)
        out[kind] = mean_ms(step, steps)
    return out


def table(rows: list[dict], iters: int) -> str:
    lines = [f"| threads | {rows[0]['hidden']}^3 matmul ms (GFLOP/s) | forward ms | forward + backward ms | step, foreach "
             f"Adam ms | step, fused Adam ms | foreach / fused | {iters} x forward + backward s |", "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['threads']} | {r['matmul']:.3f} ({r['gflops']:.1f}) | {r['forward']:.2f} | {r['fwd_bwd']:.2f} "
                     f"| {r['foreach']:.2f} | {r['fused']:.2f} | {r['foreach'] / r['fused']:.2f}x | "
                     f"{iters * r['fwd_bwd'] / 1e3:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=positive_int, nargs="+", default=[1, 2])
    ap.add_argument("--preset", default="8gaussians-moons", help="whose velocity MLP and batch size (make demo's)")
    ap.add_argument("--steps", type=positive_int, default=300, help="timed calls per measurement")
    ap.add_argument("--iters", type=positive_int, default=20000,
                    help="training steps of the floor column (the paper's)")
    ap.add_argument("--write", action="store_true", help="replace the cpu_step section of benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    import torch

    rows = [measure(n, args.preset, args.steps) for n in args.threads]
    # every option that changes the table: the line named --threads and --steps alone, so a section written with
    # --preset or --iters quoted a command that measures another preset or prints another floor column
    body = (f"Command: `python benchmarks/{Path(__file__).name} --threads {' '.join(map(str, args.threads))}"
            f" --steps {args.steps} --preset {args.preset} --iters {args.iters}`  \n"
            f"Machine: {platform.machine()}, {os.cpu_count()} cores visible, "
            f"torch {torch.__version__}  \nDate: {datetime.datetime.now():%Y-%m-%d %H:%M}  \nProtocol: the `{args.preset}` preset's "
            f"velocity MLP at batch {rows[0]['batch']}, float32; each time the mean over {args.steps} calls after 30 "
            "warm-up calls; a step = zero_grad + forward + backward (MSE) + Adam.\n\n" + table(rows, args.iters))
    print(body)
    if args.write:
        write_section("cpu_step", body, "Where a 2D training step's time goes on the CPU (cpu_step.py)", RESULTS)


if __name__ == "__main__":
    main()
