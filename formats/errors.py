"""Errors raised by encoders and decoders."""


class FormatError(ValueError):
    """Encoded arrays are malformed, inconsistent, or the parameters do not fit the format."""
