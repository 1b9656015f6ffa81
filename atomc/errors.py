"""One error family for every user-facing failure.

A message says what was seen, what was expected and what to do. The CLI prints it on one
line and exits 2; `--debug` shows the traceback.
"""

from __future__ import annotations


class AtomcError(Exception):
    """Base class: anything the user can fix by changing their input."""


class UsageError(AtomcError):
    """Bad command-line values: sizes, names, ranges."""


class IRError(AtomcError):
    """A JSON file that is malformed, of another schema version, or of another kind."""


class ModelFileError(AtomcError):
    """A model file that is missing, does not import, or breaks the model-file contract."""


class TraceError(AtomcError):
    """No frontend could trace the model."""


class ProfileError(AtomcError):
    """Profiling failed, or a hardware profile is unknown or malformed."""


class InfeasiblePlanError(AtomcError):
    """No partition satisfies the memory or overlap constraints."""


class CodegenError(AtomcError):
    """Generated code could not be produced or checked."""


class RuntimeMismatchError(AtomcError):
    """The runtime was given a package, batch, checkpoint or device that does not match."""


class NetworkError(AtomcError):
    """A network description (devices, delay and bandwidth matrices) is invalid."""


class LayoutError(AtomcError):
    """A layout does not match the network, the plan or the launched world."""


class PeerError(AtomcError):
    """Peers could not be reached or agreed with."""


class CalibrationError(AtomcError):
    """Measured steps that cannot calibrate a profile: a failed step, another device, another
    plan or profile, or a trace that lacks what the plan's schedule does."""
