"""One exception tree for autoplace; the CLI maps each branch to an exit code.

Expected outcomes (bad input, an infeasible problem) are exceptions of this tree,
never bare ``assert``: the message is what the user reads, so it names the file,
the field, the value and what would be valid.
"""

from __future__ import annotations


class AutoplaceError(Exception):
    """Base of every error autoplace raises on purpose."""

    exit_code = 1


class SpecError(AutoplaceError, ValueError):
    """Bad input: a model, cluster, plan or profile that cannot be used (exit 2).

    Args:
        message: what is wrong and what would be valid.
        source: the file (or option) the bad value came from, if known.
        field: dotted path of the offending field, if known.
    """

    exit_code = 2

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None) -> None:
        self.source = source
        self.field = field
        self.detail = message
        parts = [p for p in (source, field) if p]
        super().__init__(": ".join([*parts, message]))


class Infeasible(AutoplaceError):
    """No plan fits (exit 3); carries the nearest plan and how far it misses."""

    exit_code = 3


class SolverError(AutoplaceError):
    """A search back end failed or is not installed."""


class BenchmarkError(AutoplaceError):
    """A benchmark trial could not run or produced no result."""


class EmitError(AutoplaceError):
    """A plan cannot be expressed in the requested framework's config (exit 2: the plan and
    the format asked for do not go together -- bad input, one line naming the format and what
    it cannot say)."""

    exit_code = 2


class Incomplete(AutoplaceError):
    """A study ended with candidates unmeasured or given up (exit 4); re-running finishes them."""

    exit_code = 4
