"""The open GPU measurements, as one prepared plan: a short device call runs as many as its budget holds.

A session lent a GPU has minutes of device time in all. What it should measure is decided here, on the CPU,
beforehand: each step is a command of this folder's scripts (or the `sinkflow` CLI) with the arguments checked
against that script's own parser before the call (``--check``), the expected seconds on an H100, and the
benchmarks/RESULTS.md row it answers. On the device, the plan runs in order of priority: a step whose expected time
no longer fits the budget is skipped (a later, shorter one may still run), each runs under the time left, in its own
process group (a compile's workers go with it), its output to ``OUT/<step>.log``; ``OUT/summary.md`` and the last
lines of every log come back in the call's output even when a step was cut short.

The device machine has torch but not POT, GeomLoss or torchcfm, and cannot reach a package index: with the wheels in
``.whl/`` (docs/performance.md, "The next GPU session") the plan installs them into a scratch folder first, and MNIST
comes as ``data/MNIST`` (carried: ``carry: [".whl", "data/MNIST"]``).

    python benchmarks/gpu_session.py --check                       # here: the plan parses, what it needs is there
    python benchmarks/gpu_session.py --budget 560 --out "$OUT"     # the device call (10 minutes at most a call)
    python benchmarks/gpu_session.py --budget 560 --out "$OUT" --only cifar-peak memory doctor
    python benchmarks/gpu_session.py --smoke --out /tmp/s          # CPU: the runner, on the steps' CPU variants
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
MNIST = ROOT / "data" / "MNIST" / "raw" / "t10k-images-idx3-ubyte.gz"
SITE = Path("/tmp/sinkflow-site")
TAIL = 25  # lines of each log repeated in the call's output (progress bars left out: they are in the log)
BAR = re.compile(r"\d+%\|")


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]  # a script of benchmarks/ (or "sinkflow") and its arguments; {out}: the --out folder
    seconds: int  # expected wall time on one H100 / H200, set-up included (earlier calls; a guess where marked)
    answers: str  # what it measures: the RESULTS.md row it fills
    smoke: tuple[str, ...] | None = None  # arguments of a CPU variant (--smoke runs these; None: checked only)


MNIST_PRESET = ("pool.batches=100", "--preset", "mnist", "--configs", "default")
# issue 23's 25 % of the bf16 peak: the runner's CIFAR path, the same with cuDNN's timing on, and with inductor's
# timed kernels, side by side in one process, each timed three times in turn (one 20-step reading each read 24.8 %
# and 25.2 %, on 2026-11-30, from two calls)
CIFAR_PEAK = ("--compile", "--steps", "20", "--warmup", "5", "--repeats", "3", "--paths", "fp16+compile+stepgraph",
              "fp16+compile+stepgraph+cudnn", "fp16+autotune+stepgraph")

PLAN = (
    Step("memory", ("memory_estimate.py", "--device", "cuda", "--presets", "mnist"), 45,
         "the planner's estimate against the peak of a captured fp16 step (26 s, 2026-11-30, its nsf and time rows "
         "counting what the earlier phases' 2-step runs left allocated: measure again)"),
    Step("doctor", ("sinkflow", "doctor", "mnist", "--steps", "100"), 100,
         "sinkflow doctor on the CUDA default path (fp16, the captured step): 77 s on an H200, 2026-11-30, "
         "whose findings (the train-mode probe blind to a replay, a 9.4x fit called a broken loop) were fixed "
         "since: run it again"),
    Step("cifar-peak", ("train_throughput.py", *CIFAR_PEAK), 330,
         "issue 23's 25 % of the bf16 peak: the runner's CIFAR path, with cuDNN's timing on (should the runner turn "
         "it on?) and with compile_mode=max-autotune-no-cudagraphs, in one process, medians of 3 windows (guess: "
         "fp32 eager, torchcfm and two compiles about 200 s as on 2026-11-30, and 2 minutes of autotuning)",
         ("train_throughput.py", "--smoke", "--compile", "--steps", "1", "--repeats", "2", "--paths",
          "fp16+compile+stepgraph+cudnn", "fp16+autotune+stepgraph")),
    Step("lr-find", ("sinkflow", "lr-find", "mnist", "--phase", "velocity", "--out", "{out}/lr_find.png"), 150,
         "sinkflow lr-find on the CUDA default path (a loaded state captures anew; guess: 2.5 min): its step: line "
         "should say fp16, compiled, the whole step one CUDA graph with replays = steps - 3; compare its rates with "
         "a train.velocity.graph=none sweep's"),
    Step("gpu-checks", ("gpu_checks.py", "--checks", "step_graph", "prefetch", "adam", "many_phases",
                        "capture_fallback", "split_step"), 90,
         "the captured fp16 step with the guard's skip flag or-ed into GradScaler's (2026-11-30): bit-equal to the "
         "plain step, no host sync; prefetch and fused Adam equivalences (23 s, 2026-11-30); 12 phases' memory after "
         "each release flat (no cuBLAS workspaces left by finished phases, audit MM; guess: +30 s); a capture that "
         "fails (a host read in the forward) under graph=auto: one warning, trained on without the graph (guess: "
         "+15 s); a torchrun job's captured step, two graphs with NCCL's all-reduce between, in a group of one "
         "(2026-12-01, unrun on a card; guess: +15 s)",
         ("gpu_checks.py", "--device", "cpu", "--smoke", "--checks", "step_graph")),
    Step("mnist-gpu", ("mnist.py", "--scale", "gpu", "--gpu-fraction", "0.05", "--device", "cuda", "--methods",
                       "nsgfpp", "otcfm", "--train-seeds", "0", "--data-root", "data",
                       "--out", "/tmp/sinkflow-mnist-gpu"),  # its run folders stay there; the log holds the table
         480, "the mission's open question on a card: NSGF++ against OT-CFM on real digits at 5 % of the mnist "
         "preset's budget on its UNet, FD-CNN with each sampler chosen on validation (the table is in the log; "
         "guess: 8 min)"),
    Step("nsgfpp-fp16", ("preset_throughput.py", *MNIST_PRESET, "--methods", "nsgfpp", "--phases", "velocity", "nsf",
                         "time"), 90,
         "issue 23: NSGF++'s velocity / nsf / time rates under the fp16 default (>= 85 steps/s; the 30-min projection)",
         ("preset_throughput.py", "--smoke", "--methods", "nsgfpp", "--configs", "default", "--phases", "velocity")),
    Step("otcfm-fm-fp16", ("preset_throughput.py", *MNIST_PRESET, "--methods", "fm", "otcfm", "--repeats", "2"), 45,
         "issue 23: OT-CFM within 10 % of FM under the fp16 default"),
    Step("busy-profiler-first", ("preset_throughput.py", *MNIST_PRESET, "--methods", "fm", "--profiler-first"), 40,
         "the bench busy % column with the profiler opened before the capture (near 80 %, not 3-4 %?)"),
    Step("sampling-fp16", ("sampling.py", "--compile", "--batches", "256", "--repeats", "2"), 190,
         "issue 23: sampling at 60 NFE, batch 256: fp16 beside bf16 and fp32, eager and compiled (fp16's samples "
         "match fp32's on the CPU: sample_precision.py; 170 s, 2026-11-30)",
         ("sampling.py", "--smoke", "--batches", "2", "--nfe", "2")),
    Step("split-rate", ("preset_throughput.py", "pool.batches=100", "--preset", "mnist", "--methods", "fm",
                        "--configs", "fp16+eager", "fp16+stepgraph", "fp16+stepgraph+split", "--repeats", "2"), 75,
         "a torchrun job's captured step (two graphs, NCCL's all-reduce between) against the one-graph step, in a "
         "process group of one, and against the eager step torchrun trains with by default (2026-12-01: opt-in "
         "under torchrun; guess: 75 s)",
         ("preset_throughput.py", "--smoke", "--methods", "fm", "--configs", "fp16+stepgraph+split")),
    Step("ot-coupling", ("ot_coupling.py", "--device", "cuda", "--sizes", "128x784", "128x3072", "--import-repeats",
                         "0"), 20, "OT-CFM's whole plan on the card's host (SciPy's assignment)",
         ("ot_coupling.py", "--sizes", "8x4", "--batches", "2", "--import-repeats", "0")),
)


def expand(argv: tuple[str, ...], out: Path) -> tuple[str, ...]:
    """``argv`` with ``{out}`` made the --out folder (absolute: a step runs in the repository root, and what it
    writes there never comes back from the device)."""
    return tuple(a.replace("{out}", str(Path(out).resolve())) for a in argv)


def script_parser_check(argv: tuple[str, ...]) -> None:
    """Parse ``argv`` with its script's own parser (argparse exits 2 on a bad argument: a SystemExit here)."""
    if argv[0] == "sinkflow":
        from sinkflow.cli import build_parser

        build_parser().parse_args(list(argv[1:]))
        return
    path = ROOT / "benchmarks" / argv[0]
    spec = importlib.util.spec_from_file_location(f"plan_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.parse_args(list(argv[1:]))


def check(plan: tuple[Step, ...], smoke: bool) -> list[str]:
    """Problems that would waste a device call, one line each: an argument a script refuses, a missing carry."""
    problems = []
    for step in plan:
        for argv in (step.argv, step.smoke) if smoke else (step.argv,):
            if argv is None:
                continue
            try:
                script_parser_check(expand(argv, Path("OUT")))
            except SystemExit:
                problems.append(f"{step.name}: {' '.join(argv)} is refused by its script's parser (above)")
    if not smoke:
        if not sorted(WHEELS.glob("*.whl")):
            problems.append(f"no wheels in {WHEELS}: the device has no POT/GeomLoss/torchcfm (docs/performance.md, "
                            "'The next GPU session', has the download command)")
        if not MNIST.exists():
            problems.append(f"{MNIST} is missing: copy ../shared/data/mnist-t10k/t10k-*.gz to data/MNIST/raw/ "
                            "and carry data/MNIST")
    return problems


def environment() -> dict[str, str]:
    """The children's environment: unbuffered output, and the carried wheels installed where they can import them."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(SITE), str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    wheels = sorted(str(w) for w in WHEELS.glob("*.whl"))
    # every module the wheels carry: with POT and GeomLoss present and torchcfm not, the wheels were never installed
    probe = "import ot, geomloss, torchcfm"
    if wheels and subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--target", str(SITE), *wheels], check=True)
    return env


def command(argv: tuple[str, ...]) -> list[str]:
    if argv[0] == "sinkflow":
        return [sys.executable, "-m", "sinkflow", *argv[1:]]
    return [sys.executable, str(ROOT / "benchmarks" / argv[0]), *argv[1:]]


def run_step(argv: tuple[str, ...], log: Path, timeout: float, env: dict[str, str]) -> tuple[str, float]:
    """Run one command in its own process group under ``timeout`` seconds: ("ok" | "rc N" | "timed out", seconds)."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(command(argv), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # a checkpointing run saves on SIGTERM; compile workers go too
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return "timed out", time.perf_counter() - start
    return ("ok" if rc == 0 else f"rc {rc}"), time.perf_counter() - start


def run_plan(plan: tuple[Step, ...], budget: float, out: Path, smoke: bool = False,
             env: dict[str, str] | None = None) -> list[dict]:
    """Each step in order while its expected time fits what is left of ``budget``; the rows of summary.md."""
    out.mkdir(parents=True, exist_ok=True)
    env = environment() if env is None else env
    deadline, rows = time.perf_counter() + budget, []
    for step in plan:
        argv = step.smoke if smoke else step.argv
        left = deadline - time.perf_counter()
        if argv is None or (not smoke and step.seconds > left):
            why = "no CPU variant" if argv is None else f"expects {step.seconds} s, {left:.0f} s left"
            rows.append({"step": step.name, "result": f"skipped ({why})", "seconds": 0.0, "answers": step.answers})
            continue
        print(f"[{time.strftime('%H:%M:%S')}] {step.name}: {' '.join(argv)}", flush=True)
        result, seconds = run_step(expand(argv, out), out / f"{step.name}.log", max(left, 1.0), env)
        rows.append({"step": step.name, "result": result, "seconds": seconds, "answers": step.answers})
        (out / "summary.md").write_text(summary(rows))  # kept if the device call itself is cut short
    (out / "summary.md").write_text(summary(rows))
    print_logs(rows, out)
    return rows


def summary(rows: list[dict]) -> str:
    lines = ["| step | result | seconds | answers |", "|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['result']} | {r['seconds']:.0f} | {r['answers']} |" for r in rows]
    return "\n".join(lines) + "\n"


def print_logs(rows: list[dict], out: Path) -> None:
    """Each log's last lines, then the summary table: what a device call's output returns."""
    for r in rows:
        log = out / f"{r['step']}.log"
        if log.exists():
            print(f"--- {r['step']} ({r['result']}, {r['seconds']:.0f} s): last lines of {log.name}")
            kept = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip() and not BAR.search(ln)]
            print("\n".join(kept[-TAIL:]))
    print(summary(rows), end="", flush=True)


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"CPU, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> list[dict] | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=560,
                    help="seconds for the whole plan (default 560: what one device call holds; docs/performance.md's "
                         "commands give each call's)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-session")),
                    help="logs and summary.md (default $OUT, the device call's folder that comes back)")
    ap.add_argument("--only", nargs="+", metavar="STEP", help="these steps, in the plan's order")
    ap.add_argument("--skip", nargs="+", default=[], metavar="STEP", help="not these (e.g. those an earlier call ran)")
    ap.add_argument("--check", action="store_true", help="check the plan and what it needs; run nothing")
    ap.add_argument("--smoke", action="store_true", help="run the steps' CPU variants (a check of this script)")
    args = ap.parse_args(argv)
    names = {s.name for s in PLAN}
    unknown = (set(args.only or ()) | set(args.skip)) - names
    if unknown:
        ap.error(f"unknown step {', '.join(sorted(unknown))}: the plan has {', '.join(s.name for s in PLAN)}")
    plan = tuple(s for s in PLAN if (args.only is None or s.name in args.only) and s.name not in args.skip)
    env = environment()  # on the device: the carried wheels installed before anything imports them
    for path in (str(ROOT), str(SITE)):  # sinkflow itself is not installed there
        if path not in sys.path:
            sys.path.insert(0, path)
    problems = check(plan, args.smoke)
    for p in problems:
        print(f"gpu_session: {p}", file=sys.stderr)
    if problems:
        raise SystemExit(2)
    if args.check:
        for s in plan:
            print(f"{s.name:<20} ~{s.seconds:>4} s  {s.answers}")
        print(f"{len(plan)} steps, ~{sum(s.seconds for s in plan)} s in all; one call holds {args.budget:.0f} s")
        return None
    print(f"gpu_session on {machine()}, budget {args.budget:.0f} s, logs in {args.out}", flush=True)
    return run_plan(plan, args.budget, args.out, smoke=args.smoke, env=env)


if __name__ == "__main__":
    main()
