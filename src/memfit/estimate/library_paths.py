"""Let libraries that look for a tracer take the path they take in a real run.

Some libraries test whether a tensor is a ``FakeTensor`` and, if so, take a path that is safe for compilers and
tracers instead of the one a real run takes. memfit's trace is not a compiler: it wants the real run's path, and
it answers the value reads that path makes (``memfit.estimate.values``: the real value where the step computed it
from constants, else 0 with a widened bound).

* **Hugging Face transformers** (``transformers.utils.import_utils.is_tracing``, which the attention-mask code
  calls): a real run with an all-ones ``attention_mask`` drops the mask and lets
  ``scaled_dot_product_attention`` run its mask-free kernel; a tracer gets a materialised B x L x L mask and the
  masked kernel. Seen on a BERT-MLM step (``benchmarks/corpus`` c068): an 8 MiB mask per batch in the trace that
  the H200's allocator stream does not have.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any


class RealRunPaths:
    """Context manager: while inside, the libraries above do not see fake tensors as a tracer's.

    Only libraries already imported are switched (the trace enters it after building the model).
    """

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> RealRunPaths:
        hf = sys.modules.get("transformers.utils.import_utils")
        if hf is not None and callable(getattr(hf, "is_fake_tensor", None)):
            self._saved.append((hf, "is_fake_tensor", hf.is_fake_tensor))
            setattr(hf, "is_fake_tensor", _never_fake)  # noqa: B010 (the module is untyped)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()


def _never_fake(x: Any) -> bool:
    return False
