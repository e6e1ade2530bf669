"""``MemfitCallback`` for a ``pytorch_lightning`` Trainer (the package's name before 2.0's ``lightning``).

The same callback as ``memfit.integrations.lightning.MemfitCallback``, on ``pytorch_lightning.Callback``: a
Trainer accepts only callbacks of its own package.
"""

from __future__ import annotations

from types import ModuleType
from typing import ClassVar

from memfit.errors import MissingExtraError
from memfit.integrations.lightning import MemfitCallbackBase

try:
    import pytorch_lightning as _pl
except ImportError as exc:
    raise MissingExtraError(
        "memfit.integrations.pytorch_lightning needs pytorch_lightning >= 2.1, which is not installed. Install it "
        "(pip install pytorch_lightning), or use memfit.integrations.lightning with the lightning package."
    ) from exc

__all__ = ["MemfitCallback"]


class MemfitCallback(MemfitCallbackBase, _pl.Callback):
    """Plan the micro-batch under a budget, survive an OOM in ``training_step``, explain one that ends ``fit``.

    Arguments: see :class:`memfit.integrations.lightning.MemfitCallbackBase`.
    """

    lightning: ClassVar[ModuleType] = _pl
