"""Activation memory and step time versus depth for the three flow memory modes (same Glow model).

Memory: bytes saved for backward between forward and backward (saved-tensor hooks, unique storages,
parameters excluded), on any device; on CUDA also the peak allocated during forward+backward above the
pre-step baseline (``torch.cuda.max_memory_allocated``). Time: median forward+backward wall time over
``--repeats`` steps, the modes interleaved so that machine noise hits all of them alike.
Optional peer: memcnn's ``InvertibleModuleWrapper`` around each of the same layers (log-det dropped,
since memcnn's wrapper carries one tensor), when ``import memcnn`` works.

    python benchmarks/flow_memory.py --out benchmarks/flow_memory.png  # the committed plot (default ./flow_memory.png)
    python benchmarks/flow_memory.py --device cuda --shape 3 32 32 --batch 64 --hidden 256 --levels 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sinkflow.flows import build_glow, preprocess  # noqa: E402
from sinkflow.models.footprint import SavedTensorCounter  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import checked_device, positive_int  # noqa: E402
from results_md import machine  # noqa: E402

MODES = ("standard", "checkpoint", "invertible")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_memory(model, x, device, loss_fn):
    """-> (saved_bytes, cuda_peak_bytes or None). Runs one warm-up step first."""
    model.zero_grad(set_to_none=False)
    loss_fn(model, x).backward()  # warm-up: grads allocated, so the peak below is activations only
    with SavedTensorCounter(model) as counter:
        loss = loss_fn(model, x)
    loss.backward()
    peak = None
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        loss_fn(model, x).backward()
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    return counter.bytes, peak


CLOCK = time.perf_counter  # --clock cpu: time.process_time, the process's CPU time (robust on a shared CPU)


def time_step(model, x, device, loss_fn):
    sync(device)
    t = CLOCK()
    loss_fn(model, x).backward()
    sync(device)
    return CLOCK() - t


def nll(model, x):
    return -model.log_prob(x).mean()


def memcnn_peer(model):
    """The same layers, each in memcnn's InvertibleModuleWrapper; returns a loss fn (log-det dropped)."""
    import memcnn  # noqa: F401  (ImportError handled by the caller)

    class NoLogdet(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            y = self.layer(x)[0]
            return y.clone() if y._base is not None else y  # memcnn detaches outputs in place

        def inverse(self, y):
            return self.layer.inverse(y)

    chains = []
    for seq in model.levels:  # the first wrapped layer keeps its input (memcnn issue #70)
        chains.append([memcnn.InvertibleModuleWrapper(NoLogdet(layer), keep_input=(i == 0))
                       for i, layer in enumerate(seq.layers)])

    def loss_fn(m, x):
        h, total = x, 0.0
        for i, chain in enumerate(chains):
            for w in chain:
                h = w(h)
            if i < len(m.splits):
                h, z2 = h[:, : m.splits[i].c_keep], h[:, m.splits[i].c_keep:]
                total = total + 0.5 * (z2 ** 2).flatten(1).sum(1)
        return (total + 0.5 * (h ** 2).flatten(1).sum(1)).mean()

    return loss_fn


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # whole numbers >= 1: '--repeats 0' ended in a StatisticsError traceback after every mode's memory was measured
    ap.add_argument("--depths", type=positive_int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--shape", type=positive_int, nargs=3, default=[3, 16, 16])
    ap.add_argument("--batch", type=positive_int, default=16)
    ap.add_argument("--hidden", type=positive_int, default=32)
    ap.add_argument("--levels", type=positive_int, default=2)
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-memcnn", action="store_true", help="skip the memcnn peer")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="step time as wall time, or as the process's CPU time (CPU only; robust when other "
                         "processes share the cores: their load does not count)")
    ap.add_argument("--out", default="flow_memory.png",
                    help="the plot (default flow_memory.png in the current folder: a toy run from the repository root "
                         "must not replace the committed benchmarks/flow_memory.png)")
    ap.add_argument("--json", default=None, help="also write raw results here")
    ap.add_argument("--from-json", default=None, help="only redraw the table and plot from a --json file")
    args = ap.parse_args(argv)
    if args.from_json:
        if not Path(args.from_json).is_file():  # was a FileNotFoundError traceback
            ap.error(f"--from-json {args.from_json}: no such file; pass the --json file of an earlier run")
        data = json.loads(Path(args.from_json).read_text())
        rows, info = data["rows"], data["info"]
        depths = sorted({r["depth"] for r in rows})
        modes = list(dict.fromkeys(r["mode"] for r in rows))
        print(table(rows, depths, modes, info))
        print(ratio_summary(rows))
        plot(rows, depths, modes, args.out, info, torch.device(info["config"]["device"]))
        return
    device = checked_device(args.device, ap.error)
    if args.clock == "cpu":
        if device.type != "cpu":
            ap.error("--clock cpu measures CPU time: use it with --device cpu")
        global CLOCK
        CLOCK = time.process_time
    warnings.filterwarnings("ignore", category=FutureWarning)

    modes = list(MODES)
    peer_note = "memcnn peer skipped (--no-memcnn)"
    if not args.no_memcnn:
        try:
            import memcnn
            modes.append("memcnn")
            peer_note = f"memcnn {memcnn.__version__} InvertibleModuleWrapper per layer (log-det dropped)"
        except Exception as e:  # noqa: BLE001 - any import failure just drops the peer
            peer_note = f"memcnn peer not available: {type(e).__name__}: {e}"

    rows, info_peer_failed = [], []
    g = torch.Generator().manual_seed(0)
    x = preprocess(torch.randint(0, 256, (args.batch, *args.shape), generator=g).float()
                   + torch.rand((args.batch, *args.shape), generator=g)).to(device)
    for depth in args.depths:
        torch.manual_seed(0)
        model = build_glow(tuple(args.shape), args.levels, depth, args.hidden).to(device)
        with torch.no_grad():
            model.log_prob(x)  # ActNorm init, identical weights for every mode
        fns, res = {}, {}
        for mode in list(modes):
            if mode == "memcnn":
                model.set_memory("standard")
                fns[mode] = memcnn_peer(model)
            else:
                fns[mode] = nll
            if mode != "memcnn":
                model.set_memory(mode)
            try:
                res[mode] = measure_memory(model, x, device, fns[mode]) + ([],)
            except Exception as e:  # noqa: BLE001 - the peer may not work on this torch; never fail on it
                if mode != "memcnn":
                    raise
                print(f"memcnn peer failed: {type(e).__name__}: {e}", file=sys.stderr)
                modes.remove("memcnn")
                info_peer_failed.append(f"{type(e).__name__}: {str(e)[:120]}")
        for _ in range(args.repeats):  # interleave the modes so machine noise hits all of them alike
            for mode in modes:
                model.set_memory("standard" if mode == "memcnn" else mode)
                res[mode][2].append(time_step(model, x, device, fns[mode]))
        for mode in modes:
            saved, peak, times = res[mode]
            sec = statistics.median(times)
            rows.append({"depth": depth, "mode": mode, "saved_bytes": saved, "cuda_peak_bytes": peak,
                         "seconds": sec, "times": times, "fallen_back": len(model.fallen_back)})
            print(f"depth {depth:3d} {mode:10s} saved {saved / 2**20:8.2f} MiB"
                  + (f" peak {peak / 2**20:8.2f} MiB" if peak is not None else "")
                  + f" step {sec * 1e3:8.1f} ms", file=sys.stderr, flush=True)
        if model.fallen_back:
            print(f"depth {depth}: drift guard fell back on {len(model.fallen_back)} layers",
                  file=sys.stderr)

    info = {"command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
            "clock": args.clock,
            "machine": machine(device), "date": datetime.date.today().isoformat(),
            "peer": peer_note + (f" -- failed: {info_peer_failed[0]}" if info_peer_failed else ""),
            "config": vars(args)}
    print(table(rows, args.depths, modes, info))
    print(ratio_summary(rows))
    plot(rows, args.depths, modes, args.out, info, device)
    if args.json:
        Path(args.json).write_text(json.dumps({"info": info, "rows": rows}, indent=1))


def ratio_summary(rows) -> str:
    """One line per depth: each recomputing mode's step time as a multiple of standard's, memcnn beside."""
    r = {(row["depth"], row["mode"]): row for row in rows}
    lines = []
    for d in sorted({row["depth"] for row in rows}):
        std = r[d, "standard"]["seconds"]
        parts = [f"{m} {r[d, m]['seconds'] / std:.2f}x" for m in ("invertible", "checkpoint", "memcnn") if (d, m) in r]
        lines.append(f"depth {d}: step time vs standard: " + ", ".join(parts))
    return "\n".join(lines)


def table(rows, depths, modes, info):
    r = {(row["depth"], row["mode"]): row for row in rows}
    cuda = rows[0]["cuda_peak_bytes"] is not None
    d0 = depths[0]
    head = ["depth", "mode", "saved MiB", f"x vs depth {d0}", "x vs standard"]
    if cuda:
        head += ["CUDA peak MiB", f"peak x vs depth {d0}"]
    head += [f"step ms ({info.get('clock', 'wall')})", "time x vs standard"]
    lines = [f"Machine: {info['machine']}  ", f"Date: {info['date']}  ", f"Command: `{info['command']}`  ",
             f"Peer: {info['peer']}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in depths:
        for m in modes:
            row, std = r[d, m], r[d, "standard"]
            if m == "memcnn":  # memcnn keeps its tensors on ctx attributes, invisible to saved-tensor hooks
                cells = [str(d), m, "n/a", "n/a", "n/a"]
            else:
                cells = [str(d), m, f"{row['saved_bytes'] / 2**20:.2f}",
                         f"{row['saved_bytes'] / max(r[d0, m]['saved_bytes'], 1):.2f}",
                         f"{row['saved_bytes'] / std['saved_bytes']:.3f}"]
            if cuda:
                cells += [f"{row['cuda_peak_bytes'] / 2**20:.1f}",
                          f"{row['cuda_peak_bytes'] / r[d0, m]['cuda_peak_bytes']:.2f}"]
            cells += [f"{row['seconds'] * 1e3:.1f}", f"{row['seconds'] / std['seconds']:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows, depths, modes, out, info, device):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cuda = device.type == "cuda"
    fig, axes = plt.subplots(1, 3 if cuda else 2, figsize=(15 if cuda else 10, 4))
    for m in modes:
        sel = [row for row in rows if row["mode"] == m]
        if m != "memcnn":
            axes[0].plot(depths, [row["saved_bytes"] / 2**20 for row in sel], "o-", label=m)
        axes[-1].plot(depths, [row["seconds"] * 1e3 for row in sel], "o-", label=m)
        if cuda:
            axes[1].plot(depths, [row["cuda_peak_bytes"] / 2**20 for row in sel], "o-", label=m)
    axes[0].set_ylabel("saved for backward (MiB)")
    if cuda:
        axes[1].set_ylabel("CUDA peak above baseline (MiB)")
    axes[-1].set_ylabel("forward+backward (ms)")
    for ax in axes[:-1]:
        ax.set_yscale("log")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("flow steps per level")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"sinkflow flows: memory and time vs depth\n{info['machine']}", fontsize=8)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
