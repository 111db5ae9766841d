"""NSGF++ on the embedded 8x8 digits through the pipeline API: train every phase, sample, save a grid, evaluate.

    python examples/nsgfpp_digits.py                 # the digits preset: a few minutes on a CPU
    python examples/nsgfpp_digits.py --tiny          # seconds (what the test runs)
"""

import argparse

import sinkflow

p = argparse.ArgumentParser()
p.add_argument("--tiny", action="store_true")
p.add_argument("--runs-dir", default="runs")
args = p.parse_args()
tiny = dict(train_iters=4, batch_size=8, **{"pool.batches": 2, "pool.batch_size": 16, "pool.chunk": 1,
                                            "model.velocity.channels": 8, "model.nsf.channels": 8}) if args.tiny else {}

run = sinkflow.train("digits", runs_dir=args.runs_dir, device="cpu", **tiny)   # pool, velocity, NSF, time predictor
x = run.sample(64, steps=20)                       # 10 NSGF (the preset's sample.nsgf_steps) + 1 predictor + 20 NSF = 31 network evaluations
print(run, "samples", tuple(x.shape), f"in [{x.min():.2f}, {x.max():.2f}]")

from sinkflow.eval.images import save_grid        # noqa: E402  (matplotlib-free PNG grid)

save_grid(x, run.dir / "example_grid.png", nrow=8)
print(f"wrote {run.dir / 'example_grid.png'}")
