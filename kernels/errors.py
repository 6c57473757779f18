"""The kernels' error type: a launch or a layer the kernels cannot take (no CuPy or no GPU, a tile or shape
they are not built for, inputs of the wrong dtype or size). A :class:`~unionsparse.formats.errors.UnionsparseError`,
so the command line reports it in one line like every library error."""

from ..formats.errors import UnionsparseError


class KernelError(UnionsparseError):
    """The kernels cannot run on these inputs or on this machine."""
