"""Zoo steps run again under a process-wide setting their training script makes: the thirteenth draw
(``cudnn_benchmark.py``) and the fourteenth (``deterministic.py``). Each variant is its step with the setting made
just before the model is built, as a script makes it before its first step; the measurement runs every step in a
fresh process (``memfit.estimate.measure.run_trial``), so the setting stays with its step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memfit import Workload

VARIANT_MODULES = ("cudnn_benchmark.py", "deterministic.py")
"""The family modules made of variants: left out of the steps they draw from (each would load the other)."""


def zoo_steps() -> dict[str, Workload]:
    """Every zoo step of the family modules that are not variants, by name (not through ``registry.entries``, which
    loads the variant modules too)."""
    from registry import MODULES, _load

    return {v.name: v for m in MODULES if m not in VARIANT_MODULES
            for v in vars(_load(m)).values() if isinstance(v, Workload)}


def variants(names: list[str], prefix: str, setup: Callable[[], None], note: str, tag: str) -> dict[str, Workload]:
    """``<prefix>_<step>`` for each of ``names``: the step with ``setup()`` run before its model is built, described
    with ``note`` and tagged ``tag`` instead of its draw's tag (``--family holdoutN`` stays the draw it was)."""
    steps = zoo_steps()
    found = {}
    for step in names:
        base, name = steps[step], f"{prefix}_{step}"

        def model(build: Callable[[], Any] = base.model) -> Any:
            setup()
            return build()

        found[name] = base.replace(name=name, model=model, description=f"{base.description}; {note}",
                                   tags=(*(t for t in base.tags if not t.startswith("holdout")), tag))
    return found
