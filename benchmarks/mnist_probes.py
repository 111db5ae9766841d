"""Sampling-side probes of a trained NSGF++ MNIST run from benchmarks/mnist.py: one factor changed at a time.

    OMP_NUM_THREADS=1 python benchmarks/mnist_probes.py --out runs/bench-mnist --seed 0 --nfe 13

Each probe re-scores the seed's NSGF++ model at one total NFE with the sampler the benchmark chose on validation
(k NSGF steps; the NSF from t̂ = the predictor's output + the chosen ``sample.t_shift``), on the same test digits
and sample count as the table, changing one thing:

* ``as benchmarked``: nothing (must reproduce the table's cell);
* ``t̂ = batch mean``: the per-sample t̂ replaced by its mean over the batch (is the per-sample prediction worth
  anything?);
* ``t̂ − 0.15`` / ``t̂ + 0.15``: the NSF starts earlier / later than benchmarked (is the start biased? clamped
  to the NSF's trained range [nsgf.nsf_t_min, 1]);
* (``--no-t-edits`` skips the three rows above, for a run that wants only the rows below beside its reference)
* ``t̂ = T`` for each ``--fixed T``: every sample's NSF starts at T (how much of a seed's score is where its
  predictor happened to put the states, and where the best start is);
* ``<phase> from seed S`` for ``--swap-from S``: one network (velocity, NSF or predictor) replaced by the one the
  same benchmark trained for seed S (which phase makes a seed an outlier); with ``--swap-out DIR`` the one another
  benchmark's run (its ``--out``) trained for seed S, named ``<phase> from DIR's seed S`` (which phase carries what
  a training change changed: a velocity network fitted on a larger pool beside this run's NSF and predictor);
* ``--pool-states``: the NSF run on the pool's own final NSGF states (x_T = x_{T-1} + eta v_{T-1} of stored
  trajectories: the empirical Sinkhorn flow, not the velocity network), from the predictor's t̂ and from each
  ``--fixed`` T, FD-CNN only; beside them the same rows for the velocity network's x_T, integrated on the pool's
  grid from fresh source points (is the loss in the Sinkhorn flow or in the network that imitates it?), and
  for each ``--fixed`` T the NSF run from its own training distribution at T (x_T = T y + (1 − T) x0, y training
  digits, paired as the run trained it: what the NSF alone loses from T, the ceiling of any NSGF part);
* ``--nsf-steps S ...``: the ``--pool-states`` rows again with S NSF Euler steps each (named ``..., S NSF
  steps``; the benchmarked count keeps the plain names): does a longer NSF help from the states the NSGF part
  hands it, and from its own training distribution?
* ``--renoise T ...``: the benchmarked sampler's digits put back on the NSF's straight path at T with fresh noise
  (x_T = T x + (1 − T) z) and integrated by the NSF in each ``--nsf-steps`` count: can the NSF's ODE, which gains
  nothing from the NSGF states, sharpen the sampler's end point from its own paths (for S more NFE)?
* ``--velocity-fit``: the velocity network's error per pool step, as a share of the target's variance, on pool
  entries it was trained on and on as many fresh trajectories solved the same way (a train share far
  below the fresh one: the network memorised its pool, which is then too small for the budget).
* ``--trajectory-fit``: how far the velocity network's own Euler path (its states fed back, as the sampler runs it)
  drifts from the Sinkhorn flow it imitates, step by step, on fresh sources: the one-step error adds up along the
  path, and what reaches the predictor and the NSF is the path's end.

``--split val`` scores on the validation digits instead (what a choice may read; ``--n`` defaults to the
benchmark's validation count there).

Training-side probes (the split of UNet steps, the NSF's training range, pool size or blur) retrain NSGF++; they
are ``benchmarks/mnist.py --methods nsgfpp --train-seeds 0 --out R2 [--velocity V --nsf N | nsgf.nsf_t_min=0.5 |
--pool P | sinkhorn.blur=0.5]``, whose table sits beside the main one (same OT-CFM scores apply: same seed, data
and protocol). Writes ``<out>/probes-seed<S>-nfe<N>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from sinkflow import data
from sinkflow.data.atomic_write import atomic_write_text
from sinkflow.runtime.run_folder import RunFolder

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mnist as bench_mnist  # noqa: E402  (the benchmark whose runs and choices the probes read)


class TimeEdit(torch.nn.Module):
    """The trained time predictor with its output changed by ``edit`` (t̂ -> edit(t̂))."""

    def __init__(self, predictor, edit):
        super().__init__()
        self.predictor, self.edit = predictor, edit

    def forward(self, x):
        return self.edit(self.predictor(x))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the benchmark's --out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nfe", type=int, default=13)
    ap.add_argument("--n", type=int, default=None, help="generated digits per score (default: the benchmark's: 1,000 on "
                    "test, every validation digit on val)")
    ap.add_argument("--fixed", type=float, nargs="*", default=[], help="also start every NSF at each of these times")
    ap.add_argument("--split", choices=("test", "val"), default="test")
    ap.add_argument("--swap-from", type=int, default=None, metavar="S", help="also score with each network of seed S")
    ap.add_argument("--no-t-edits", action="store_true", help="skip the t̂ = batch mean and t̂ ± 0.15 rows (the "
                    "'as benchmarked' row, every other row's reference, stays)")
    ap.add_argument("--swap-out", default=None, metavar="DIR", help="--swap-from's seed from this benchmark --out "
                    "(default: --out)")
    ap.add_argument("--pool-states", action="store_true", help="also run the NSF on the pool's final states, and on "
                    "the velocity network's (on the pool's grid, from fresh source points)")
    ap.add_argument("--nsf-steps", type=int, nargs="+", default=None, metavar="S", help="the --pool-states and "
                    "--renoise rows' NSF Euler steps, each count its own rows (default: the benchmarked sampler's)")
    ap.add_argument("--renoise", type=float, nargs="+", default=[], metavar="T", help="also put the sampler's "
                    "digits back on the NSF's path at T with fresh noise and run the NSF from there (--nsf-steps)")
    ap.add_argument("--velocity-fit", action="store_true", help="also the velocity network's error per pool step "
                    "on its own pool and on a fresh one")
    ap.add_argument("--trajectory-fit", action="store_true", help="also the velocity network's path's distance from "
                    "the Sinkhorn flow's, per step, on fresh sources")
    args = ap.parse_args(argv)
    if args.swap_out and args.swap_from is None:
        ap.error("--swap-out names the benchmark whose networks are swapped in: give the seed with --swap-from S")
    torch.set_num_threads(1)
    out = Path(args.out)
    val = bench_mnist.from_scores(out, args.seed, [args.nfe])["val"].get("NSGF++", {}).get(args.nfe)
    if not val:
        sys.exit(f"no validation scores for NSGF++ at {args.nfe} NFE in {out}/seed{args.seed}/scores.json")
    tag = bench_mnist.choose_sampler(val)
    k, shift = bench_mnist.parse_sampler(tag)
    run = RunFolder.open(out / f"seed{args.seed}" / "nsgfpp")
    if args.n:
        n = args.n
    elif args.split == "val":  # every validation digit, the draw the benchmark chooses on
        n = len(data.distributions(run.cfg)[1].val_set())
    else:
        n = bench_mnist.SCALES["cpu"]["n"]
    nets = {p: run.model(p) for p in ("velocity", "nsf", "time")}
    # t̂ below is the benchmarked start: the predictor's output plus the chosen shift (the sampler clamps it into the
    # NSF's range); the run's own t_shift is 0 so that a fixed start is exactly T
    edits = {
        "as benchmarked": lambda t: t + shift,
        **({} if args.no_t_edits else {
            "t̂ = batch mean": lambda t: (t + shift).mean().expand_as(t),
            "t̂ − 0.15": lambda t: t + shift - 0.15,
            "t̂ + 0.15": lambda t: t + shift + 0.15}),
        **{f"t̂ = {T:g}": (lambda t, T=T: torch.full_like(t, T)) for T in args.fixed},
    }
    probes = {name: {"time": TimeEdit(nets["time"], e)} for name, e in edits.items()}
    if args.swap_from is not None:
        donor_out = Path(args.swap_out) if args.swap_out else out
        donor = RunFolder.open(donor_out / f"seed{args.swap_from}" / "nsgfpp")
        whose = f"{donor_out.name}'s seed" if args.swap_out else "seed"
        probes.update({f"{p} from {whose} {args.swap_from}": {p: donor.model(p), "time": TimeEdit(
            donor.model("time") if p == "time" else nets["time"], edits["as benchmarked"])} for p in nets})
    results = {}
    own_steps = args.nfe - 1 - k  # the benchmarked sampler's NSF steps
    run = run.variant(sample={"nsgf_steps": k, "t_shift": 0.0})
    for name, swap in probes.items():
        results[name] = bench_mnist.score(run.variant(models=swap), own_steps, n, split=args.split)
        bench_mnist.log(f"probe {name}: {tag} {results[name]}")
    ref = fd_reference(run, n, args.split) if args.pool_states or args.renoise or args.trajectory_fit else None
    score = fd_scorer(ref) if ref else None  # one reference for every FD-CNN below
    if args.pool_states:
        results.update(pool_state_scores(run, score, args.nsf_steps or [own_steps], own_steps, n, args.fixed, shift))
    if args.renoise:
        results.update(renoise_scores(run.variant(sample={"t_shift": shift}), score, own_steps, n, args.renoise,
                                      args.nsf_steps or [own_steps]))
    fit = velocity_fit(run, n) if args.velocity_fit else None
    drift = trajectory_fit(run, n, ref) if args.trajectory_fit else None
    path = out / f"probes-seed{args.seed}-nfe{args.nfe}{'-val' if args.split == 'val' else ''}.json"
    atomic_write_text(path, json.dumps({"k": k, "t_shift": shift, "n": n, "nfe": args.nfe, "split": args.split,
                                        "probes": results, **({"velocity_fit": fit} if fit else {}),
                                        **({"trajectory_fit": drift} if drift else {})}, indent=1))
    print(f"NSGF++ seed {args.seed}, {args.nfe} NFE ({k} NSGF + 1 t̂ + {own_steps} NSF from t̂ {shift:+g}), "
          f"{n} generated vs the {'validation' if args.split == 'val' else 'test'} digits:\n\n"
          "| probe | FD-CNN | pixel W2 | TV | confidence | mean t̂ |\n|---|---|---|---|---|---|")
    for name, r in results.items():
        cells = [f"{r[c]:.3f}" if r.get(c) is not None else "-" for c in ("w2", "tv", "conf", "t_hat")]
        print(f"| {name} | {r['fd_cnn']:.2f} | {' | '.join(cells)} |")
    if fit:
        print(f"\nVelocity network's MSE per pool step / the target's variance ({fit['n']} entries a step):\n\n"
              "| step | trained-on pool | fresh pool |\n|---|---|---|")
        for i, (a, b) in enumerate(zip(fit["train"], fit["fresh"])):
            print(f"| {i} | {a:.3f} | {b:.3f} |")
    if drift:
        print(f"\nThe velocity network's path against the Sinkhorn flow's from the same {drift['n']} fresh sources, "
              "each as a share of the flow's mean squared displacement x_k - x_0:\n\n"
              "| step | network to flow | flow to flow (other targets) | network's bias | sharpness |\n"
              "|---|---|---|---|---|")
        for i, row in enumerate(zip(drift["network"], drift["flows"], drift["bias"], drift["sharpness"]), 1):
            print(f"| {i} | " + " | ".join(f"{c:.3f}" for c in row) + " |")
        if "sampler" in drift:
            end = drift["sampler"]
            print(f"| end, the sampler's {end['steps']} steps | {end['network']:.3f} | {drift['flows'][-1]:.3f} | "
                  f"{end['bias']:.3f} | {end['sharpness']:.3f} |")
        if "state_fd" in drift:
            fds = drift["state_fd"]
            print(f"\nx_T in FD-CNN's feature space: network to flow {fds['network']:.2f} (two flows apart "
                  f"{fds['flows']:.2f}); to the held-out digits: network {fds['network_to_digits']:.2f}, flow "
                  f"{fds['flow_to_digits']:.2f}" + ("" if "sampler" not in drift else
                  f"; the sampler's end: to flow {drift['sampler']['state_fd']['network']:.2f}, to the digits "
                  f"{drift['sampler']['state_fd']['network_to_digits']:.2f}"))
    print(f"\nwrote {path}")


def pool_entries(pool, t: float, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, v) of the first ``n`` entries the pool stores at flow time ``t`` (one a trajectory, in file order)."""
    t_all = np.asarray(pool.t).reshape(-1)
    x, _, v = pool.sample(torch.from_numpy(np.flatnonzero(np.isclose(t_all, t))[:n]))
    return x, v


def pool_grid(cfg: dict) -> tuple[list[float], list[float]]:
    """(times, steps) of the pool's own NSGF grid (not the sampler's k steps)."""
    from sinkflow.methods.nsgfpp import nsgf_grid

    return nsgf_grid({**cfg, "sample": {**cfg["sample"], "nsgf_steps": None}})


def fd_reference(run, n: int, split: str) -> dict:
    """The benchmark's FD-CNN reference for ``n`` generated digits against the held-out digits of ``split``: its
    network (``net``) and the held-out features (``real``)."""
    from sinkflow.eval.images import fd_cnn_reference

    target = data.distributions(run.cfg)[1]
    held_out = target.val_set() if split == "val" else target.test_set(len(target.test_images))
    return fd_cnn_reference(target, run.cfg["data"]["root"], held_out, n, split == "val")


def embedder(ref: dict):
    """Images -> FD-CNN features, clamped to the data range as the benchmark clamps its samples."""
    from sinkflow.eval import fd_cnn

    return lambda z: fd_cnn.features(ref["net"], z.clamp(-1, 1))


def fd_scorer(ref: dict):
    """FD-CNN of generated digits against ``ref``'s held-out digits, as the benchmark scores them, without the
    other metrics."""
    from sinkflow.eval import fd_cnn

    embed = embedder(ref)
    return lambda z: fd_cnn.fd(embed(z), ref["real"])


@torch.no_grad()
def renoise_scores(run, score, sampler_nsf_steps: int, n: int, times: list[float], nsf_steps: list[int]) -> dict:
    """The sampler's digits (``run``'s, with its chosen shift set) put back on the NSF's straight path at each T of
    ``times`` (x_T = T x + (1 − T) z, z fresh source noise) and integrated by the NSF from T in each S of
    ``nsf_steps`` Euler steps: the NSF's ODE, which gains nothing from the NSGF states themselves (off its training
    paths), run from its own paths. With one NSF step the sampler's digits are the NSF's estimate of the end point;
    the rows cost S more NFE."""
    from sinkflow.eval.points import generate
    from sinkflow.methods.ode import euler

    x = generate(run, n, sampler_nsf_steps, seed=1000)[0].clamp(-1, 1)  # the first sampling seed of the scores
    z = data.distributions(run.cfg)[0].sample(n, torch.Generator().manual_seed(2**31 - 4), "cpu")
    nsf = run.model("nsf")
    out = {"sampler's digits": {"fd_cnn": score(x), "n": n}}
    for T in times:
        for S in nsf_steps:
            out[f"sampler's digits re-noised to {T:g}, {S} NSF steps"] = {
                "fd_cnn": score(euler(nsf, T * x + (1 - T) * z, torch.full((n,), T), 1.0, S, False)[0]),
                "t_hat": T, "n": n}
    return out


@torch.no_grad()
def pool_state_scores(run, score, nsf_steps: list[int], own_steps: int, n: int, fixed: list[float],
                      shift: float = 0.0) -> dict:
    """FD-CNN (``score``) of the pool's final NSGF states and of the velocity network's (integrated on the pool's
    grid from fresh source points: a network trained long on a small pool has memorised the pool's own), each alone
    and through the NSF from the predictor's t̂ (+ ``shift``) and from each fixed time, and of the NSF from its own
    training interpolants at each fixed time: ``n`` of each, the NSF rows once per count of ``nsf_steps`` Euler steps
    (named ``..., S NSF steps`` unless S is ``own_steps``, the benchmarked sampler's). The states are made once."""
    from sinkflow.methods.flow_matching import interpolant_draw, interpolant_finish
    from sinkflow.methods.nsgf import PoolGrid, flow_times
    from sinkflow.methods.nsgfpp import nsgf_part
    from sinkflow.methods.ode import euler
    from sinkflow.methods.pool import TrajectoryPool

    source, target = data.distributions(run.cfg)
    times, steps = pool_grid(run.cfg)
    pool = TrajectoryPool(run.dir / "pool", storage="disk")
    x, v = pool_entries(pool, float(flow_times(run.cfg["pool"])[-2]), n)  # the last stored step
    net = run.model("velocity")
    x0 = source.sample(n, torch.Generator().manual_seed(2**31 - 2), "cpu")  # fresh: the pool's own x0 are memorised
    mine = nsgf_part(net, x0, times, steps)
    predictor, nsf = run.model("time"), run.model("nsf")
    t_min = float(run.cfg["nsgf"]["nsf_t_min"])
    starts = {}  # row name -> (states, per-sample start time)
    out = {}
    eta = float(PoolGrid.from_config(run.cfg).etas[-1])  # the pool's last step (with nsgf.time=fraction not steps')
    for who, states in (("pool", x + eta * v), ("network", mine)):  # x_T = x_{T-1} + eta_{T-1} v_{T-1}
        t_hat = (predictor(states).float() + shift).clamp(t_min, 1.0)
        out[f"{who} states themselves"] = {"fd_cnn": score(states), "n": len(states)}
        for label, start in (("t̂", t_hat), *((f"{T:g}", torch.full_like(t_hat, T)) for T in fixed)):
            starts[f"{who} states, NSF from {label}"] = states, start
    # the NSF's ceiling: started on its own training distribution at T (x_T = T y + (1 - T) x0, y training digits,
    # paired as the run trained it; nsf_pairs=ot: one plan over the n draws, not per training batch), so what a
    # perfect NSGF part would hand it at T, and what the NSF alone loses
    gen = torch.Generator().manual_seed(2**31 - 3)
    for T in fixed:
        drawn = interpolant_draw(source, target, gen, n)
        xt, _, _ = interpolant_finish((*drawn[:2], torch.full((n,), T)), "cpu",
                                      run.cfg["nsgf"]["nsf_pairs"] == "ot")
        starts[f"interpolant x_{T:g}, NSF from {T:g}"] = xt, torch.full((n,), T)
    for k in nsf_steps:
        for name, (states, start) in starts.items():
            out[name if k == own_steps else f"{name}, {k} NSF steps"] = {
                "fd_cnn": score(euler(nsf, states, start, 1.0, k, False)[0]), "t_hat": float(start.mean()),
                "n": len(states)}
    return out


def in_pool_batches(cfg: dict, n: int) -> int:
    """``n`` rounded up to whole pool batches (``pool.batch_size``)."""
    size = int(cfg["pool"]["batch_size"])
    return max(1, -(-n // size)) * size


def flow_in_pool_batches(cfg: dict, x0: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's simulator from ``x0`` towards ``y`` (as many points, whole pool batches) run as the pool runs it,
    batch by batch: a flow's velocity depends on how many points its Sinkhorn problem holds, and a network trained on
    256-point flows is judged on 256-point flows. Returns xs, vs (steps, *x0.shape), the state before each step and
    its velocity."""
    from sinkflow.methods.nsgf import make_simulator

    size = int(cfg["pool"]["batch_size"])
    xs, vs, _ = make_simulator(cfg, None)(x0.view(-1, size, *x0.shape[1:]), y.view(-1, size, *y.shape[1:]),
                                          batched=True)
    return xs.reshape(len(xs), *x0.shape), vs.reshape(len(vs), *x0.shape)


@torch.no_grad()
def velocity_fit(run, n: int) -> dict:
    """The velocity network's MSE per pool step over the target's variance at that step: on ``n`` trajectories of
    its own pool, and on ``n`` fresh ones (new source and target draws through the pool's simulator in the pool's
    batches, each with its own Sinkhorn diameter); ``n`` rounded up to whole pool batches."""
    from sinkflow.methods.nsgf import PoolGrid, flow_times
    from sinkflow.methods.pool import TrajectoryPool

    cfg = run.cfg
    n = in_pool_batches(cfg, n)
    grid = PoolGrid.from_config(cfg)
    net = run.model("velocity")
    pool = TrajectoryPool(run.dir / "pool", storage="disk")
    own = [pool_entries(pool, t, n) for t in flow_times(cfg["pool"])[:-1].tolist()]  # the pool stores flow times
    source, target = data.distributions(cfg)
    gen = torch.Generator().manual_seed(2**31 - 1)  # not a pool batch's generator
    xs, vs = flow_in_pool_batches(cfg, source.sample(n, gen, "cpu"), target.sample(n, gen, "cpu"))

    def shares(pairs) -> list[float]:
        out = []
        for k, (x, v) in enumerate(pairs):
            goal = v * grid.scale[k]
            err = (net(x, torch.full((len(x),), float(grid.times[k]))).float() - goal).pow(2).mean()
            out.append(float(err / (goal - goal.mean(0)).pow(2).mean()))
        return out

    return {"n": n, "train": shares(own), "fresh": shares(zip(xs, vs))}


@torch.no_grad()
def trajectory_fit(run, n: int, ref: dict | None = None) -> dict:
    """How far the velocity network's path drifts from the empirical Sinkhorn flow's, per pool step k = 1..T.

    From ``n`` fresh sources x_0 (in the pool's batches of ``pool.batch_size``), two flows A and B run the pool's
    simulator towards independent target draws, and the network integrates its own states on the pool's grid.
    A network of (x, t) can follow at best the flows' mean m_k over target draws, so with N_k its state:
    E|N_k - A_k|^2 = |N_k - m_k|^2 + E|A_k - m_k|^2 and E|A_k - B_k|^2 = 2 E|A_k - m_k|^2. Per step, as shares of
    the flow's mean squared displacement E|A_k - x_0|^2: ``network`` E|N_k - A_k|^2, ``flows`` E|A_k - B_k|^2 and
    ``bias`` = network - flows / 2, the network's own distance from the mean flow (what a better fit removes); and
    where the run's ``sample.nsgf_steps`` is another grid than the pool's (the sampler's k steps), ``sampler``: the
    same two shares and the sharpness for the end of the network's path on that grid, against the flows' end x_T.
    ``sharpness``: the network's states' squared neighbouring-pixel differences over the flow's (below 1: smoother
    than the flow; an average over target draws is). With ``ref`` (``fd_reference``'s), ``state_fd``: the same x_T
    compared in FD-CNN's feature space rather than in pixels, which is what the NSF's output is scored in:
    ``network`` FD(N_T, A_T), ``flows`` FD(A_T, B_T) (the floor at this n), and each against the held-out digits
    (``network_to_digits``, ``flow_to_digits``); ``sampler`` gets its end's ``state_fd`` too."""
    from sinkflow.methods.nsgf import PoolGrid
    from sinkflow.methods.nsgfpp import nsgf_grid, nsgf_part

    cfg = run.cfg
    times, steps = pool_grid(cfg)
    eta = float(PoolGrid.from_config(cfg).etas[-1])  # the pool's last step, not the network time's
    net = run.model("velocity")
    source, target = data.distributions(cfg)
    n = in_pool_batches(cfg, n)
    gen = torch.Generator().manual_seed(2**31 - 4)  # neither a pool batch's generator nor velocity_fit's
    x0 = source.sample(n, gen, "cpu")

    def flow(y):  # the states x_1..x_T of the flow from x0 towards y, flattened to (n, D)
        xs, vs = flow_in_pool_batches(cfg, x0, y)
        return [s.reshape(n, -1) for s in (*xs[1:], xs[-1] + eta * vs[-1])]

    a, b = (flow(target.sample(n, gen, "cpu")) for _ in range(2))
    mine = []
    nsgf_part(net, x0, times, steps, mine)  # every state of the network's path on the pool's grid

    def mean_sq(u, v) -> float:
        return float((u.reshape(len(u), -1) - v).pow(2).sum(1).mean())

    def edges(x) -> float:  # mean squared difference of neighbouring pixels: what a blur lowers
        return float((x[..., 1:, :] - x[..., :-1, :]).pow(2).mean() + (x[..., 1:] - x[..., :-1]).pow(2).mean())

    scale = [mean_sq(ak, x0.reshape(len(x0), -1)) for ak in a]
    network = [mean_sq(nk, ak) / s for nk, ak, s in zip(mine, a, scale)]
    flows = [mean_sq(ak, bk) / s for ak, bk, s in zip(a, b, scale)]
    out = {"n": n, "network": network, "flows": flows,
           "bias": [d - f / 2 for d, f in zip(network, flows)],
           "sharpness": [edges(nk.view_as(x0)) / edges(ak.view_as(x0)) for nk, ak in zip(mine, a)]}
    if ref is not None:
        from sinkflow.eval.fd_cnn import fd

        embed = embedder(ref)
        flow_a, flow_b = (embed(f[-1].view_as(x0)) for f in (a, b))

        def state_fd(x_T) -> dict:
            feats = embed(x_T.view_as(x0))
            return {"network": fd(feats, flow_a), "network_to_digits": fd(feats, ref["real"])}

        out["state_fd"] = {**state_fd(mine[-1]), "flows": fd(flow_a, flow_b),
                           "flow_to_digits": fd(flow_a, ref["real"])}
    sampler_times, sampler_steps = nsgf_grid(cfg)  # the run's sample.nsgf_steps over the same span of network time
    if len(sampler_steps) != len(steps):  # its path's end against the flows' end
        x_T = nsgf_part(net, x0, sampler_times, sampler_steps)
        end = mean_sq(x_T, a[-1]) / scale[-1]
        out["sampler"] = {"steps": len(sampler_steps), "network": end, "bias": end - flows[-1] / 2,
                          "sharpness": edges(x_T) / edges(a[-1].view_as(x0)),
                          **({"state_fd": state_fd(x_T)} if ref is not None else {})}
    return out


if __name__ == "__main__":
    main()
