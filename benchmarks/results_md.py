"""Replace one generated section of benchmarks/RESULTS.md (between ``<!-- name:begin -->`` and
``<!-- name:end -->``), or append it under ``heading`` the first time, so a script rerun updates its own table
and nothing else. Written atomically: a killed write leaves the old file. ``machine`` names what a number was
measured on, the same way in every script."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from sinkflow.data.atomic_write import atomic_write_text

RESULTS = Path(__file__).with_name("RESULTS.md")


def write_section(name: str, body: str, heading: str, path: Path = RESULTS, *, scored: int | None = None) -> None:
    """``scored``: how many results the body's table holds, where the caller counts them; 0 is refused, so a run
    that found nothing (a wrong --runs-dir) cannot replace a committed table with an empty one."""
    if scored == 0:
        raise SystemExit(f"error: not writing the {name} section of {path}: no scored rows (the section is kept)")
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    section = f"{begin}\n{body}{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text += f"\n## {heading}\n\n{section}\n"
    atomic_write_text(path, text)


def trained_budget(run_dirs, iters: int, batch: int = 256) -> str:
    """"N steps, batch B" of the velocity phase the tabulated runs were trained with, read from their config.yaml
    (each run's own: a table collected from runs trained with another --iters or batch said this command's), or
    every distinct pair where they differ; ``iters`` / ``batch`` (the command's) only where no config.yaml is found."""
    import yaml

    trained = set()
    for run_dir in run_dirs:
        cfg_file = Path(run_dir) / "config.yaml"
        if cfg_file.is_file():
            v = yaml.safe_load(cfg_file.read_text())["train"]["velocity"]
            trained.add((v["iters"], v["batch_size"]))
    if len(trained) == 1:
        (i, b), = trained
        return f"{i} steps, batch {b}"
    if trained:
        return "steps / batch per run " + ", ".join(f"{i} / {b}" for i, b in sorted(trained))
    return f"{iters} steps (--iters; no config.yaml found), batch {batch}"


def machine(device: torch.device | str) -> str:
    """The card (and its CUDA), the CPU model, torch threads and torch version: the line a measured number needs."""
    device = torch.device(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    host = f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda}); host {host}"
    return f"CPU {host}"
