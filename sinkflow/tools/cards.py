"""The GPU cards the memory planner knows, by name, without importing torch: `sinkflow preflight --gpu NAME` checks
the name before the planner loads (a misspelt card answered after 2.6 s of imports)."""

from __future__ import annotations

from sinkflow.errors import SinkflowError

GiB = 2**30
# nvidia-smi's total memory (MiB) of the cards people rent
GPUS: dict[str, int] = {"T4": 15360, "L4": 23034, "A100-40GB": 40960, "A100-80GB": 81920, "H100-80GB": 81559,
                        "H200": 143771}


def gpu_bytes(name: str | None = None, gib: float | None = None) -> tuple[str, int]:
    """(label, total bytes) for ``--gpu NAME`` or ``--gpu-mem GiB``."""
    if gib is not None:
        return f"{gib:g} GiB", int(gib * GiB)
    key = {k.lower().replace("-", "").replace("gb", ""): k for k in GPUS}
    norm = (name or "").lower().replace("-", "").replace("gb", "").replace(" ", "")
    if norm in key:
        return key[norm], GPUS[key[norm]] * 2**20
    matches = [k for k in GPUS if k.lower().startswith((name or "").lower())]
    if len(matches) == 1:
        return matches[0], GPUS[matches[0]] * 2**20
    raise SinkflowError(f"unknown GPU '{name}'", f"use one of {', '.join(GPUS)} or --gpu-mem GiB")
