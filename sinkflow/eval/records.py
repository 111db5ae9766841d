"""What an evaluation record (`metrics.jsonl`, phase ``eval``) holds besides its scores."""

from __future__ import annotations

METRIC_KEYS = ("w2", "tv", "confidence", "fd_cnn", "fid", "nfe")  # what an image evaluation records per row


def setting(cfg: dict, n: int, seeds: int) -> dict:
    """What an evaluation record says of how it was made, beside its scores: samples per seed, seeds, protocol.
    `sinkflow eval --n 64 --seeds 1` wrote the same keys at the same step as the run's own evaluation, and
    `status` then showed the quick look as the run's latest scores."""
    return {"n": n, "seeds": seeds, "protocol": cfg["eval"]["protocol"]}
