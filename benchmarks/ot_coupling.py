"""The exact minibatch OT coupling: SciPy's assignment solver against POT's EMD, on the same batches.

sinkflow.ot.exact uses the assignment solver up to ``ASSIGNMENT_MAX_N`` rows and POT's EMD above: this is the
measurement that sets the switch.

OT-CFM's pairs and the NSGF pool's landing step need the exact OT plan between two equal-size uniform batches, a
permutation. For each (batch, dimension) this draws ``--batches`` pairs of Gaussian batches, builds the float64
squared-Euclidean cost once, and times ``scipy.optimize.linear_sum_assignment`` and ``ot.emd`` on it (the mean per
solve after one untimed pair; the cost matrix's time is common to both and left out), and sinkflow's whole
``ot_permutation`` on the same batches on ``--device`` (cost, copy, solve), counting the batches where all three
give the same permutation. It also times each library's import in a fresh interpreter after ``import torch`` (the
median of ``--import-repeats``): a process that pairs by OT pays it once, at its first batch. On a GPU
(``--device cuda``) the last column is the whole plan as OT-CFM's prefetch worker makes it.

    python benchmarks/ot_coupling.py --write        # nothing else running
    python benchmarks/ot_coupling.py --device cuda --sizes 128x784 128x3072 --import-repeats 0
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import at_least, checked_device, positive_int  # noqa: E402
from results_md import RESULTS, machine, write_section  # noqa: E402

SIZES = [(128, 2), (1024, 2), (2048, 2), (128, 784), (256, 784), (1024, 784), (128, 3072)]
IMPORTS = {"scipy": "from scipy.optimize import linear_sum_assignment", "pot": "import ot"}


def import_seconds(statement: str, repeats: int, before: str = "import torch") -> float:
    """Median wall seconds of ``statement`` in a fresh interpreter that has run ``before`` already."""
    code = f"import time; {before}; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    return statistics.median(float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                  check=True).stdout) for _ in range(repeats))


def measure(n: int, dim: int, batches: int, device: str = "cpu", seed: int = 0) -> dict:
    """Both solvers on the same float64 cost, and sinkflow's whole ``ot_permutation`` (the cost made on
    ``device`` from float32 batches, as a run hands them, copied to the host, solved) on the same batches."""
    import numpy as np
    import ot
    import torch
    from scipy.optimize import linear_sum_assignment

    from sinkflow.ot.exact import ot_permutation

    gen = torch.Generator().manual_seed(seed)
    same, lsa_s, emd_s, path_s = 0, 0.0, 0.0, 0.0
    weights = np.full(n, 1.0 / n)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    # one untimed pair first (its own generator: the timed batches stay the same): the first timed ot_permutation
    # on CUDA held the cdist / copy kernels' first launch, in the mean of --batches pairs of the first size
    w0, w1 = torch.randn(2, n, dim, generator=torch.Generator().manual_seed(seed + 1))
    warm = (torch.cdist(w0.double(), w1.double()) ** 2).numpy()
    linear_sum_assignment(warm), ot.emd(weights, weights, warm, numItermax=int(1e7))
    ot_permutation(w0.to(device), w1.to(device))
    sync()
    for _ in range(batches):
        x0, x1 = torch.randn(n, dim, generator=gen), torch.randn(n, dim, generator=gen)
        cost = (torch.cdist(x0.double(), x1.double()) ** 2).numpy()
        start = time.perf_counter()
        _, cols = linear_sum_assignment(cost)
        lsa_s += time.perf_counter() - start
        start = time.perf_counter()
        plan = ot.emd(weights, weights, cost, numItermax=int(1e7))
        emd_s += time.perf_counter() - start
        d0, d1 = x0.to(device), x1.to(device)
        sync()
        start = time.perf_counter()
        perm = ot_permutation(d0, d1)
        sync()
        path_s += time.perf_counter() - start
        same += int(np.array_equal(cols, plan.argmax(axis=1)) and np.array_equal(cols, perm.cpu().numpy()))
    return {"n": n, "dim": dim, "batches": batches, "same": same, "lsa_ms": 1e3 * lsa_s / batches,
            "emd_ms": 1e3 * emd_s / batches, "path_ms": 1e3 * path_s / batches, "device": str(device)}


def table(rows: list[dict], imports: dict) -> str:
    lines = ["| batch x dim | same permutation (all three) | SciPy LSA ms | POT emd ms | emd / LSA | "
             f"ot_permutation ms ({rows[0]['device']}) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} x {r['dim']} | {r['same']} of {r['batches']} | {r['lsa_ms']:.2f} | "
                     f"{r['emd_ms']:.2f} | {r['emd_ms'] / r['lsa_ms']:.2f}x | {r['path_ms']:.2f} |")
    if imports:
        lines.append(f"| import after torch, s | | {imports['scipy']:.2f} | {imports['pot']:.2f} | "
                     f"{imports['pot'] / imports['scipy']:.1f}x | |")
    return "\n".join(lines) + "\n"


def size(text: str) -> str:
    """An argparse type: BATCHxDIM with both whole numbers >= 1 (kept as written: the command line echoes it)."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not BATCHxDIM with whole numbers >= 1, e.g. 128x784")
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's arguments, checked (benchmarks/gpu_session.py checks its plan with this before a GPU call)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=size, nargs="+", default=[f"{n}x{d}" for n, d in SIZES],
                    help="BATCHxDIM, e.g. 128x784")
    ap.add_argument("--batches", type=positive_int, default=20, help="random batch pairs per size")
    ap.add_argument("--import-repeats", type=at_least(0), default=3, help="0: no import row")
    ap.add_argument("--device", default="cpu",
                    help="where ot_permutation's batches live (cuda: its cost is made there)")
    ap.add_argument("--write", action="store_true", help="replace the ot_coupling section of benchmarks/RESULTS.md")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    import torch

    checked_device(args.device)  # here, not in parse_args: gpu_session.py checks a GPU plan with that on a CPU

    sizes = [tuple(int(v) for v in s.lower().split("x")) for s in args.sizes]
    rows = [measure(n, d, args.batches, args.device) for n, d in sizes]
    imports = {name: import_seconds(stmt, args.import_repeats) for name, stmt in IMPORTS.items()
               if args.import_repeats > 0}
    stamp = f"{datetime.datetime.now():%Y-%m-%d %H:%M}"
    body = (f"Command: `python benchmarks/{Path(__file__).name} --sizes {' '.join(args.sizes)} --batches "
            f"{args.batches} --import-repeats {args.import_repeats} --device {args.device}`  \n"
            f"Machine: {machine(torch.device(args.device))}  \nDate: {stamp}  \nProtocol: float64 squared-Euclidean "
            "cost between two N(0, I) float32 batches, built once a pair; the mean solve time per pair after one "
            "untimed pair; the last "
            "column: `sinkflow.ot.exact.ot_permutation` on the batches on the device (the float64 cost made there, "
            "copied to the host, solved by the solver its size picks), synchronised; the import row: median wall "
            "time in a fresh interpreter after `import torch`.\n\n" + table(rows, imports))
    print(body)
    if args.write:
        write_section("ot_coupling", body, "The exact OT coupling: SciPy's assignment vs POT's EMD (ot_coupling.py)",
                      RESULTS)
    return rows


if __name__ == "__main__":
    main()
