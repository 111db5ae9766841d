"""A training phase's speed settings with ``auto`` resolved for its device, network and process count.

``train.<phase>.precision``, ``compile`` and ``compile_mode`` default to ``auto``: the fast path where it was
measured faster, the plain path everywhere else. Measured on one H100 (docs/performance.md, 2026-11-26): the
``mnist`` preset's UNet phases train 4-5x faster with bf16 autocast and CUDA graphs
(``torch.compile(mode="reduce-overhead")``; the 1.1M-parameter UNet's step is launch-bound), with the same
timed-window loss as fp32 eager to three decimals. So ``auto`` means, for a UNet phase on a CUDA card:

* precision: fp16 (autocast + GradScaler) on a card of compute capability 8.0+ (Ampere on, where half precision
  was measured); fp32 on older cards (unmeasured there: a T4 has fp16 tensor cores, ``precision=fp16`` is one key
  away) and for every other network (2D MLPs, flows, the time predictor: unmeasured). Why fp16 and not bf16 (the
  default until 2026-11-27): the same speed on an H100 (174.5 steps/s each, the step graph), but bf16's 8-bit
  mantissa moved the 2,000-step ``mnist`` loss curve +0.00067 above fp32's at the same seed, at each of 3 seeds
  (0.73 of fp32's seed-to-seed sd), fp16's 11 bits +0.00002 (``benchmarks/loss_curve.py``, RESULTS.md). A run
  whose gradients overflow float16 even unscaled stops at its next log step with the fix
  (``Trainer.raise_if_non_finite``);
* graph: ``step`` (the whole step, Adam included, one CUDA graph: ``sinkflow.engine.step_graph``) for one process
  and a network it was measured on: the UNet phases 1.5x / 1.9x and the time predictor 3.6x faster than the
  model-only graphs below, the same timed-window loss to four decimals (H100, 2026-11-27); also under fp16
  (GradScaler's unscale, skip and scale update are device ops the graph holds); not under DDP (the all-reduce is
  not captured);
* compile: on, in mode ``reduce-overhead`` for one process (``default`` under ``graph: step``, which captures the
  whole step itself); off under DDP (CUDA graphs with NCCL unmeasured);
* off on a CPU, where compiling costs minutes and buys little (docs/performance.md).

Each setting stays one key away (``precision=fp32``, ``compile=false``), and the phase's first log line prints
what it resolved to (``Trainer.speed_settings``).
"""

from __future__ import annotations

import torch

from sinkflow.runtime.autocast import FAST_KINDS, bf16_tensor_cores

GRAPH_KINDS = ("unet", "time_predictor")  # the networks whole-step capture was measured on (both faster)
# torch.compile's modes that make no CUDA graphs of their own: they run inside the whole-step graph (graph: step)
GRAPHLESS_MODES = ("default", "max-autotune-no-cudagraphs")


def fp16_hint(tcfg: dict, kind: str, device: torch.device | str, key: str) -> str | None:
    """One line for a UNet phase left in fp32 by ``precision: auto`` on a card with float16 tensor cores that
    sinkflow has not measured (compute capability 7.x: V100, T4, the free Kaggle and Colab card), naming the key
    that uses them; None elsewhere. A T4 does about 8x the fp32 rate in fp16 matrix products by its specification."""
    device = torch.device(device)
    if tcfg.get("precision") != "auto" or kind not in FAST_KINDS or device.type != "cuda":
        return None
    cc = torch.cuda.get_device_capability(device)
    if not (7, 0) <= cc < (8, 0):
        return None
    return (f"{key}: fp32 on this card (compute capability {cc[0]}.{cc[1]}), which has float16 tensor cores "
            f"sinkflow has not measured; train.{key}.precision=fp16 uses them (autocast + GradScaler, the default "
            "from compute capability 8.0: docs/performance.md)")


def ddp_graph_hint(tcfg: dict, kind: str, device: torch.device | str, world: int, key: str) -> str | None:
    """One line for a UNet or time-predictor phase under torchrun on CUDA cards with ``graph: auto``, which is ``none``
    there (DDP's hooks are not captured; the split step's speed on several cards is unmeasured): the step runs eagerly,
    and nothing said so (the ``mnist`` UNet's eager fp32 step trained at an eighth of the captured fp16 step's rate on
    an H100). None elsewhere, and where ``graph`` was set."""
    if tcfg.get("graph") != "auto" or world < 2 or torch.device(device).type != "cuda" or kind not in GRAPH_KINDS:
        return None
    return (f"{key}: under torchrun the step runs eagerly through DDP (the mnist UNet's step: 20-22 steps/s eager in "
            "fp32, 174 with the whole step captured in one process, one H100, 2026-11-27); "
            f"train.{key}.graph=step captures it as two CUDA graphs with one all-reduce between "
            "(opt-in: its speed on several cards is unmeasured, docs/performance.md)")


def cpu_fp16_hint(precision: str, device: torch.device | str, key: str, kind: str) -> str | None:
    """One line for a phase set to fp16 that runs on a CPU, naming the key that gives it fp32 there; None elsewhere. A
    run trained on a GPU with ``precision=fp16`` set (the key a T4 user is told, ``fp16_hint``) and resumed on a laptop
    keeps it: float16 autocast has no fast CPU kernels (a moons step 5-6x slower than fp32, 3x3 convolutions 18x,
    on a 2-core VM, 2026-11-30), and only the first line's "fp16" said so. What ``auto`` is on a card follows the
    network ``kind`` (``resolve``: fp16 for a UNet only; an MLP's line had promised it fp16 there too)."""
    if precision != "fp16" or torch.device(device).type != "cpu":
        return None
    card = ("fp16 on a CUDA card of compute capability 8.0+" if kind in FAST_KINDS
            else "on a CUDA card too: auto's fp16 is a UNet's")
    return (f"{key}: fp16 on a CPU, which has no fast float16 kernels (steps several times slower than fp32's); "
            f"train.{key}.precision=auto is fp32 here and {card}")


def resolve(tcfg: dict, kind: str, device: torch.device | str, world: int = 1, bf16: bool | None = None) -> dict:
    """``tcfg`` (a ``train.<phase>`` section) with ``auto`` precision / compile / compile_mode made concrete.

    ``bf16`` overrides the card check, "has bf16 tensor cores" = compute capability 8.0+ (the memory planner plans
    for a card it does not have in hand; fp16 and bf16 take the same bytes)."""
    device = torch.device(device)
    fast = device.type == "cuda" and kind in FAST_KINDS
    out = dict(tcfg)
    if out.get("precision", "fp32") == "auto":
        native = bf16_tensor_cores(device) if bf16 is None else bf16
        out["precision"] = "fp16" if fast and native else "fp32"
    if out.get("graph", "none") == "auto":
        captured = (device.type == "cuda" and world == 1 and kind in GRAPH_KINDS
                    and out.get("compile_mode", "auto") in ("auto", *GRAPHLESS_MODES))  # an asked-for graphs mode wins
        out["graph"] = "step" if captured else "none"
    if out.get("compile", False) == "auto":  # under DDP not (unmeasured), but in a torchrun job's captured step:
        out["compile"] = fast and (world == 1 or out.get("graph") == "step")  # the plain model, as in one process
    if out.get("compile_mode", "default") == "auto":  # graph=step captures the whole step: no graphs inside it
        graphs = device.type == "cuda" and world == 1 and out.get("graph", "none") != "step"
        out["compile_mode"] = "reduce-overhead" if graphs else "default"
    return out
