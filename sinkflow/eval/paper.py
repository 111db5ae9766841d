"""The paper's numbers (arXiv:2401.14069v1), gathered from the methods that own them, for benchmarks and reports.

Each method keeps its own rows (``Method.paper``: {task: {euler_steps: w2}}); a method or a data set the paper
has no number for simply has none here (``paper_w2`` returns None, nothing raises).
"""

from sinkflow.methods import get
from sinkflow.methods.flow_matching import PAPER_W2_FM as TABLE1_FM
from sinkflow.methods.flow_matching import PAPER_W2_OTCFM as TABLE1_OTCFM
from sinkflow.methods.nsgf import PAPER_W2 as TABLE1_NSGF
from sinkflow.methods.nsgfpp import PAPER_FID

TABLE3_MNIST = PAPER_FID["mnist"]
TABLE2_CIFAR10 = PAPER_FID["cifar10"]
__all__ = ["TABLE1_NSGF", "TABLE1_OTCFM", "TABLE1_FM", "TABLE3_MNIST", "TABLE2_CIFAR10", "paper_w2"]


def paper_w2(method: str, task: str, steps: int) -> float | None:
    """The paper's W2 of registered method ``method`` on ``task`` at ``steps`` Euler steps, or None."""
    try:
        return get(method).paper_w2(task, steps)
    except Exception:  # an unknown method has no paper number either
        return None
