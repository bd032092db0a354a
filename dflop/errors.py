"""Errors a user can act on.

Every error raised for bad input is a :class:`DflopError` whose message is one
line naming the input (file, key, line, entry) and what is wrong with it; the
CLI prints that line and exits with status 2. Anything else is a bug.
"""


class DflopError(Exception):
    """Bad input or an impossible request, explained in one line."""


class SpecError(DflopError):
    """A model, hardware, cluster, plan or run spec is invalid."""


class PlanError(DflopError):
    """A plan does not fit the cluster or the model."""


class ManifestError(DflopError):
    """A dataset manifest entry cannot be read."""


class InfeasibleError(DflopError):
    """No schedule or plan satisfies the constraints (caps, memory)."""


class NotYetAvailable(DflopError):
    """A command that a later piece of work fills in."""
