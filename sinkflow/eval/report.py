"""What `sinkflow train` prints and draws when it finishes, and what `sinkflow eval` computes."""

from __future__ import annotations

from sinkflow import methods


def is_points(cfg: dict) -> bool:
    return len(methods.sample_shape(cfg)) == 1


def evaluate(run, seeds: int | None = None, n: int | None = None) -> str:
    cfg = run.cfg
    if is_points(cfg):
        from sinkflow.eval.points import format_table, w2_table

        rows = w2_table(run, n=n, seeds=seeds)
        run.logger.log("eval", 0, {f"w2_{r['steps']}": r["w2_mean"] for r in rows})
        from sinkflow.eval.points import is_paper_task

        task = cfg["experiment"]["preset"] if is_paper_task(cfg) else f"{cfg['data']['source']} -> {cfg['data']['target']}"
        return format_table(rows, cfg["experiment"]["method"], task)
    if cfg["experiment"]["method"] == "flow":  # normalizing flows: test bits/dim first (methods/flow.py)
        return methods.get("flow").evaluate(run, seeds=seeds, n=n)
    from sinkflow.eval.images import evaluate_images

    return evaluate_images(run, seeds=seeds, n=n)


def final_report(run) -> str:
    text = evaluate(run)
    if is_points(run.cfg):
        from sinkflow.eval.points import plots

        written = plots(run)
    elif run.cfg["experiment"]["method"] == "flow":  # no sampling path to draw: the grid only
        written = methods.get("flow").plots(run)
    else:
        from sinkflow.eval.images import plots as image_plots

        written = image_plots(run)
    return text + "\nwrote " + ", ".join(str(p) for p in written)
