"""User-facing errors: one line that names the problem and the fix.

Anything raised as ``SinkflowError`` is printed by the CLI as a single line (no traceback) and the
process exits with status 2. Raise it *before* work starts wherever the problem can be known then.
"""


class SinkflowError(Exception):
    """A problem the user can fix (bad config, bad data, wrong checkpoint, too little memory)."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}; {fix}" if fix else problem)


def require(condition: bool, problem: str, fix: str | None = None) -> None:
    """Raise ``SinkflowError(problem, fix)`` unless ``condition`` holds."""
    if not condition:
        raise SinkflowError(problem, fix)
