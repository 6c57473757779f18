"""Errors of the compress pipeline and the commands built on it."""

from ..formats.errors import UnionsparseError


class UserError(UnionsparseError):
    """Bad input from the user: a missing file, an out-of-range option, a store that is not an artifact."""
