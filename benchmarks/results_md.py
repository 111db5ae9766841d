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
