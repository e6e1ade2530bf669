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

Libraries also cache tensors between calls, keyed by shape, device and dtype rather than by model (Hugging Face's
RT-DETR caches its position embeddings and anchors so, ``compile_compatible_method_lru_cache``): what one trace
computed on fake tensors, the next trace of the same shapes — the real forward that sizes a detector's outputs —
got back, and a caller's own run after memfit would too. ``RealRunPaths(model)`` empties the caches on the
methods of the model's classes when the step ends (``clear_method_caches``).
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any


class RealRunPaths:
    """Context manager: while inside, the libraries above do not see fake tensors as a tracer's.

    Only libraries already imported are switched (the trace enters it after building the model).
    """

    def __init__(self, model: Any = None) -> None:
        self._saved: list[tuple[Any, str, Any]] = []
        self._model = model

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
        if self._model is not None:
            clear_method_caches(self._model)


def clear_method_caches(model: Any) -> None:
    """Empty the ``functools`` caches on the methods of ``model``'s module classes: a cached method itself
    (``functools.lru_cache``, ``functools.cache``), or one a wrapper closes over (Hugging Face's
    ``compile_compatible_method_lru_cache``)."""
    seen: set[type] = set()
    for module in model.modules():
        for cls in type(module).__mro__:
            if cls in seen or cls.__module__.startswith(("torch.", "builtins")):
                continue
            seen.add(cls)
            for attr in list(vars(cls).values()):
                func = getattr(attr, "__func__", attr)  # staticmethod, classmethod
                cells = getattr(func, "__closure__", None) or ()
                for candidate in (func, *(_contents(cell) for cell in cells)):
                    clear = getattr(candidate, "cache_clear", None)
                    if callable(clear):
                        clear()


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return None


def _never_fake(x: Any) -> bool:
    return False
