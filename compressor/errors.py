"""The one error type that the command line turns into a single line and exit code 2."""


class UserError(Exception):
    """Bad input from the user: a missing file, an out-of-range option, a store that is not an artifact."""
