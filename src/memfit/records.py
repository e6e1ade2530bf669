"""What memfit's results (``Estimate``, ``Explanation``, ``Plan``) share: a versioned JSON form of every field."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar


class JsonRecord:
    """``to_dict`` and ``to_json`` for a result dataclass: its fields, with ``schema`` set to the class's
    current ``_schema`` (what a reader checks before trusting the layout)."""

    _schema: ClassVar[int]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)  # type: ignore[call-overload]
        d["schema"] = self._schema
        return d

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)
