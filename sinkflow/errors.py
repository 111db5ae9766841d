"""User-facing errors: one line that names the problem and the fix.

Anything raised as ``SinkflowError`` is printed by the CLI as a single line (no traceback) and the
process exits with status 2. Raise it *before* work starts wherever the problem can be known then.
"""


class SinkflowError(Exception):
    """A problem the user can fix (bad config, bad data, wrong checkpoint, too little memory)."""

    def __init__(self, problem: str, fix: str | None = None, *, every_rank: bool = False):
        self.problem = problem
        self.fix = fix
        # raised alike on every rank of a torchrun job (their options differ; rank 0's check failed): rank 0 says it
        self.every_rank = every_rank
        super().__init__(f"{problem}; {fix}" if fix else problem)


class DataNotFound(SinkflowError):
    """The data set is not on this machine (an image folder that does not exist, a data set's folder without its
    files): preflight and doctor then check the run on synthetic data of the real shape (a CPU box before the GPU
    run). Data that is here but damaged or inconsistent is a plain ``SinkflowError``: those checks fail on it."""


def require(condition: bool, problem: str, fix: str | None = None) -> None:
    """Raise ``SinkflowError(problem, fix)`` unless ``condition`` holds."""
    if not condition:
        raise SinkflowError(problem, fix)


def human_bytes(n: float) -> str:
    """A size in the unit that keeps it readable: "12 B", "3.5 KiB", "1.2 MiB", "40.0 GiB", "1.6 PiB"."""
    n = float(n)
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
