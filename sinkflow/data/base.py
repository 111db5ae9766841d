"""The one interface every data source implements, so methods never care where points come from."""

from __future__ import annotations

import torch

from sinkflow.config.checks import is_whole, shown
from sinkflow.errors import SinkflowError

DEFAULT_TEST_SEED = 12345

_SAID: set = set()  # the (message, subject) pairs ``warn_once`` has logged in this process


def warn_once(log, subject, message: str, *args) -> None:
    """``log.warning(message, *args)`` once a process for ``subject``: a command opens a data set more than once
    (its checks, then the run; tune's trials), and one warning said twice reads as two problems."""
    if (message, subject) not in _SAID:
        _SAID.add((message, subject))
        log.warning(message, *args)


class Distribution:
    """A sampleable distribution over tensors of per-sample shape ``shape``.

    All randomness comes from the caller's CPU ``torch.Generator`` (part of the checkpointed phase
    state), so a resumed run draws exactly the batches an uninterrupted run would have drawn.
    """

    name: str = "distribution"
    shape: tuple[int, ...] = ()
    # what RUN/data_split.json records of data read from files (an image set's splits, a point file's hashes), so a
    # resume, an evaluation or a sample of the run can refuse data that changed; None: nothing to record (a formula)
    split_info: dict | None = None

    def sample(self, n: int, generator: torch.Generator, device="cpu") -> torch.Tensor:
        """``n`` float32 samples of shape ``(n, *shape)`` on ``device``."""
        raise NotImplementedError

    def test_set(self, n: int, seed: int = DEFAULT_TEST_SEED) -> torch.Tensor:
        """Fixed evaluation samples on CPU; the same ``(n, seed)`` always gives the same tensor."""
        return self.sample(n, torch.Generator().manual_seed(seed), device="cpu")

    def check_test_n(self, n: int, flag: str = "eval.n") -> None:
        """Refuse ``n`` test points where the distribution holds fewer (``flag``: the setting that asked for them,
        named in the error); a sampled distribution draws any number."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, shape={self.shape})"


def check_sample_size(n) -> None:
    """Refuse a sample size that is not a whole number >= 1 (``is_whole``: numpy integers count), the one
    message of every sampler (distributions, ``Run.sample``, ``FlowModel.sample``): an empty batch would fail
    later as a raw reshape of 0 elements, a float size as a raw torch TypeError."""
    if not is_whole(n):
        raise SinkflowError(f"sample size must be a positive int, got {shown(n)}", "pass n >= 1")


def check_sample_args(n: int, generator: torch.Generator, device="cpu") -> None:
    """Reject arguments that would silently draw from the global RNG or the wrong device, and a ``device`` this
    machine lacks (docs/data.md's ``device="cuda"`` without a GPU was torch's "Found no NVIDIA driver")."""
    check_sample_size(n)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise SinkflowError(f"sample(device={device!r}) is not a device", "use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SinkflowError(f"sample(device={device!r}) but CUDA is not available here", "sample on 'cpu'")
    if not isinstance(generator, torch.Generator):
        raise SinkflowError(
            f"sample() needs a torch.Generator, got {type(generator).__name__}",
            "pass the phase's CPU generator so runs stay reproducible",
        )
    if generator.device.type != "cpu":
        raise SinkflowError(
            f"sample() needs a CPU generator, got one on {generator.device}",
            "create it with torch.Generator() (device='cpu'); samples are moved to the device afterwards",
        )
