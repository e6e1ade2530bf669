"""The zoo's index: every ``Workload`` in the family modules beside this file, with its library and tags.

Each entry is loadable by ``memfit estimate`` / ``memfit measure`` as ``benchmarks/zoo/<module>.py:<name>``.
Listing the zoo imports the family modules, which import no model library: those are imported when a model is
built, so the index works where timm or MONAI is missing and says which entries need them.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

ZOO = Path(__file__).resolve().parent

MODULES = (
    "timm_models.py", "hf_transformers.py", "torchvision_models.py", "monai_models.py", "smp_models.py",
    "nnunet_models.py", "finetuning.py", "torch_features.py", "holdout.py", "holdout2.py", "holdout3.py",
    "holdout4.py",
    "holdout5.py",
    "holdout6.py",
    "holdout7.py",
    "holdout8.py",
    "holdout9.py",
    "holdout10.py",
    "holdout11.py",
    "cudnn_benchmark.py",
    "deterministic.py",
)
"""The family modules, in report order."""

LIBRARIES = {
    "timm": "timm", "transformers": "transformers", "torchvision": "torchvision", "monai": "monai",
    "segmentation_models_pytorch": "segmentation_models_pytorch",
    "dynamic_network_architectures": "dynamic_network_architectures", "peft": "peft",
}
"""Library tag -> the module to import. An entry needs every library among its tags."""


@dataclass(frozen=True, kw_only=True)
class ZooEntry:
    name: str
    module: str
    """File name of the family module (``timm_models.py``)."""
    library: str
    """The entry's main library: its first library tag, or ``torch``."""
    requires: tuple[str, ...]
    """Importable module names the entry needs besides torch."""
    tags: tuple[str, ...]
    description: str

    @property
    def spec(self) -> str:
        """What ``memfit estimate`` takes: ``/abs/path/benchmarks/zoo/<module>:<name>``."""
        return f"{ZOO / self.module}:{self.name}"

    def missing(self) -> list[str]:
        """The required libraries not importable here."""
        return [m for m in self.requires if importlib.util.find_spec(m) is None]


def _load(module: str) -> object:
    name = f"memfit_zoo_{module.removesuffix('.py')}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ZOO / module)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def entries(names: list[str] | None = None, family: str | None = None) -> list[ZooEntry]:
    """Every zoo entry, or those named, or those whose library, module stem or tags include ``family``."""
    from memfit import Workload

    found: list[ZooEntry] = []
    for module in MODULES:
        for value in vars(_load(module)).values():
            if not isinstance(value, Workload):
                continue
            libs = tuple(LIBRARIES[t] for t in value.tags if t in LIBRARIES)
            found.append(ZooEntry(
                name=value.name, module=module, library=next((t for t in value.tags if t in LIBRARIES), "torch"),
                requires=libs, tags=value.tags, description=value.description,
            ))
    seen: set[str] = set()
    for e in found:
        if e.name in seen:
            raise ValueError(f"zoo entry name {e.name!r} appears twice: names must be unique across modules")
        seen.add(e.name)
    if names:
        unknown = sorted(set(names) - seen)
        if unknown:
            raise ValueError(f"no zoo entry named {', '.join(unknown)}")
        found = [e for e in found if e.name in names]
    if family:
        found = [e for e in found if family in (e.library, e.module.removesuffix(".py"), *e.tags)]
    return found


if __name__ == "__main__":
    from collections import Counter

    all_entries = entries()
    for e in all_entries:
        print(f"{e.library:30s} {e.name:34s} {e.description}")
    print(f"\n{len(all_entries)} entries: " + ", ".join(f"{k} {v}" for k, v in Counter(
        e.library for e in all_entries).most_common()))
