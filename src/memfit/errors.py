"""The exception tree of memfit.

Every error says what happened, the value, the limit and the fix. Each class also derives from the builtin
that a caller would naturally catch (``ValueError`` for bad input, ``RuntimeError`` for failures at run time),
so ``except ValueError`` keeps working.
"""

from __future__ import annotations


class MemfitError(Exception):
    """Base class of every error memfit raises on purpose."""


class UsageError(MemfitError, ValueError):
    """Bad input from the user: a malformed size, an unknown name, an impossible option."""


class WorkloadError(MemfitError, ValueError):
    """A workload file or built-in could not be loaded or built."""


class UserCodeError(WorkloadError):
    """The user's own code (a factory, the model's forward, the loss) raised: the message names the file and line,
    the module and the op, and the user's exception is the ``__cause__``."""


class TraceError(MemfitError, RuntimeError):
    """The training step could not be traced without a GPU (an op with no fake implementation, say)."""


class DeviceError(MemfitError, RuntimeError):
    """A GPU measurement was asked for but no usable CUDA device is present."""


class BudgetTooSmallError(MemfitError, ValueError):
    """No configuration fits the memory budget."""


class StepOOMError(MemfitError, RuntimeError):
    """A guarded training step ran out of memory even at the smallest micro-batch."""


class OptimizerStepOOMError(MemfitError, RuntimeError):
    """Out of memory inside ``optimizer.step()``: parameters may be half-updated, so it is never retried."""


class RankAgreementError(MemfitError, RuntimeError):
    """The ranks of a distributed job did not agree in time (a rank died or hangs)."""


class NumericsError(MemfitError, FloatingPointError):
    """A non-finite loss or gradient where the user asked to raise on it."""


class DataError(MemfitError, ValueError):
    """A data file cannot be read, or does not fit its use: a corrupt TIFF, an empty raster, a label volume whose
    shape differs from its image. The message names the file (and the window or patch being read)."""


class DataLoaderMemoryWarning(UserWarning):
    """A Dataset holds large Python containers that every DataLoader worker will copy (pytorch issue 13246)."""


class MissingExtraError(MemfitError, ImportError):
    """An optional dependency (an "extra" such as ``memfit[data]``) is needed but not installed."""
