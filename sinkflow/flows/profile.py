"""Measure activation memory without a GPU: bytes saved for backward, via saved-tensor hooks.

Counts each distinct storage once (views of one tensor are not double counted) and leaves out parameter
storages (weights are not activations). This is the memory held between forward and backward; the
backward pass additionally holds one recomputed segment (checkpoint) or one layer (invertible).
"""

from __future__ import annotations

import torch


class SavedTensorCounter(torch.autograd.graph.saved_tensors_hooks):
    """``with SavedTensorCounter(model) as c: loss = ...``; then ``c.bytes`` (unique, non-parameter)."""

    def __init__(self, model: torch.nn.Module | None = None):
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()} if model else set()
        self._seen: dict[int, int] = {}
        super().__init__(self._pack, lambda t: t)

    def __enter__(self):
        super().__enter__()
        return self

    def _pack(self, t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self._params and ptr not in self._seen:
            self._seen[ptr] = st.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())
