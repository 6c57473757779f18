"""The library's error types. Every package raises a subclass of :class:`UnionsparseError` (a ``ValueError``)
for inputs it cannot take, with a message about the values; the command line alone turns them into one line
and exit code 2. Any other exception is a bug (exit 3)."""


class UnionsparseError(ValueError):
    """Root of the errors unionsparse raises about its inputs."""


class FormatError(UnionsparseError):
    """Encoded arrays are malformed, inconsistent, or the parameters do not fit the format."""
