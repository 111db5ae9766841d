"""Ablations behind the flow-digits preset: validation bits/dim of one Glow under one change at a time.

A plain training loop equivalent to the runner's flow phase (Adam, linear warm-up, grad clip 100, batch 64,
uniform dequantisation, ActNorm data init; its cosine decay spans all steps and multiplies the warm-up ramp,
where the runner's starts after warm-up), on the same split: the digits train split minus a validation
split of 10% drawn with ``sinkflow.data.images.VAL_SEED``. It reads the validation split only (never test).
Each argument is one JSON run spec, e.g.

    OMP_NUM_THREADS=1 python benchmarks/flow_digits_ablation.py '{"name": "base"}' \
        '{"name": "logit", "logit": 0.001}' '{"name": "logit-cos", "logit": 0.001, "sched": "cosine"}'

Keys: steps, lr, hidden, depth, levels, logit (alpha), aug (max shift in pixels), sched (constant | cosine),
wd (AdamW weight decay), bs, warm, every (validation every N steps), scale, seed.
"""
import inspect
import json
import math
import sys
import time

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from sklearn.datasets import load_digits
from sinkflow.data.sources import DigitsSource
from sinkflow.data.images import val_split
from sinkflow.flows import build_flow, dequantize, preprocess, bits_per_dim

def data():
    d = load_digits(); X = (torch.tensor(d.images, dtype=torch.float32) / 16).unsqueeze(1)
    tr = DigitsSource.split_indices(d.target, "train")
    Xtr = X[tr]  # the test split (te) is never touched here
    ti, vi = val_split(len(Xtr), 0.1)
    return Xtr[ti], Xtr[vi]

def shift(x, s, g):
    if s == 0: return x
    n = len(x); dx = torch.randint(-s, s + 1, (n,), generator=g); dy = torch.randint(-s, s + 1, (n,), generator=g)
    p = torch.nn.functional.pad(x, (s, s, s, s))
    out = torch.empty_like(x)
    for i in range(n):
        out[i] = p[i, :, s + dy[i]: s + dy[i] + 8, s + dx[i]: s + dx[i] + 8]
    return out

def evalb(m, X, seeds=3):
    m.eval(); v = []
    with torch.no_grad():
        for s in range(seeds):
            g = torch.Generator().manual_seed(1000 + s)
            z = preprocess(dequantize(X, g, 17, torch.float32), 17)
            v.append(float(bits_per_dim(m.log_prob(z), 64, 17).mean()))
    m.train(); return sum(v) / len(v)

def run(name, steps=2000, lr=1e-3, hidden=64, depth=8, levels=2, logit=0.0, aug=0, sched="constant", wd=0.0, bs=64, warm=100, every=250, scale=None, seed=0):
    torch.manual_seed(seed)
    Xtr, Xva = data()
    cfg = dict(arch="glow", levels=levels, depth_per_level=depth, hidden_channels=hidden, logit_alpha=logit)
    if scale: cfg["scale"] = scale
    m = build_flow(cfg, (1, 8, 8))
    g = torch.Generator().manual_seed(seed + 1)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd) if wd else torch.optim.Adam(m.parameters(), lr=lr)
    def f(t):
        w = min(1.0, (t + 1) / warm)
        if sched == "cosine": w *= 0.5 * (1 + math.cos(math.pi * min(t, steps) / steps))
        return w
    sc = torch.optim.lr_scheduler.LambdaLR(opt, f)
    with torch.no_grad():
        idx = torch.randint(0, len(Xtr), (bs,), generator=torch.Generator().manual_seed(99))
        m.log_prob(preprocess(dequantize(Xtr[idx], g, 17, torch.float32), 17))
    curve = []; t0 = time.time(); tl = []
    for t in range(steps):
        idx = torch.randint(0, len(Xtr), (bs,), generator=g)
        x = shift(Xtr[idx], aug, g)
        z = preprocess(dequantize(x, g, 17, torch.float32), 17)
        loss = bits_per_dim(m.log_prob(z), 64, 17).mean()
        opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 100); opt.step(); sc.step()
        tl.append(float(loss.detach()))
        if (t + 1) % every == 0:
            vb = evalb(m, Xva)
            curve.append((t + 1, round(sum(tl[-100:]) / len(tl[-100:]), 3), round(vb, 4)))
            print(name, curve[-1], f"{time.time()-t0:.0f}s", flush=True)
    best = min(curve, key=lambda r: r[2])
    print("RESULT", name, "best", best, "last", curve[-1], flush=True)
    return best

def main(argv=None):
    """Each argument one JSON run spec; returns each run's best (step, train bits/dim, validation bits/dim)."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("specs", nargs="+", metavar="JSON", help='one run spec, e.g. \'{"name": "base"}\'')
    specs = []
    for spec in p.parse_args(argv).specs:  # every spec checked before the first run trains
        try:
            kw = json.loads(spec)
        except json.JSONDecodeError as exc:
            p.error(f"{spec!r} is not a JSON run spec ({exc.msg}); e.g. '{{\"name\": \"base\", \"steps\": 500}}'")
        if not isinstance(kw, dict) or "name" not in kw:
            p.error(f"{spec!r} needs a \"name\" key, e.g. '{{\"name\": \"base\"}}'")
        unknown = sorted(set(kw) - set(inspect.signature(run).parameters))  # a typo would end the runs before it
        if unknown:
            p.error(f"{spec!r}: unknown key {', '.join(unknown)}; the keys are "
                    f"{', '.join(inspect.signature(run).parameters)}")
        specs.append(kw)
    best = {}
    for kw in specs:
        name = kw.pop("name")
        best[name] = run(name, **kw)
    return best

if __name__ == "__main__":
    main()
