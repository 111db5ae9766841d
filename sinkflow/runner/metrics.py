"""Training health while it runs: a JSONL log, TensorBoard events and a heartbeat file.

``metrics.jsonl`` is one JSON object per logged step (easy to grep, load with pandas, or tail);
TensorBoard gets the same scalars; ``status.json`` is rewritten atomically on every log so
``sinkflow status RUN`` can tell a live run from a dead one by the heartbeat's age.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

from sinkflow.data.atomic_write import atomic_write_text


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self._tb = None
        self._jsonl = None  # opened on the first record: creating a logger writes nothing

    @property
    def jsonl(self):
        if self._jsonl is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        return self._jsonl

    @property
    def tb(self):
        """TensorBoard writer, created lazily (importing tensorboard costs ~1 s)."""
        if self._tb is None and self.enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"))
        return self._tb

    def log(self, phase: str, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"time": time.time(), "phase": phase, "step": step}
        for key, value in values.items():
            value = float(value) if hasattr(value, "__float__") and not isinstance(value, (str, bool)) else value
            record[key] = value
            if isinstance(value, float) and math.isfinite(value):
                self.tb.add_scalar(f"{phase}/{key}", value, step)
        self.jsonl.write(json.dumps(record) + "\n")

    def histogram(self, tag: str, values, step: int) -> None:
        if self.enabled:
            self.tb.add_histogram(tag, values, step)

    def heartbeat(self, **status: Any) -> None:
        """Rewrite ``status.json`` (phase, step, total, rate, eta, state) with the current time."""
        if not self.enabled:
            return
        status = {"time": time.time(), "pid": os.getpid(), "host": socket.gethostname(), **status}
        atomic_write_text(self.run_dir / "status.json", json.dumps(status))

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
