"""What every memfit result shares: one versioned JSON form, ``to_dict()`` and ``to_json()``.

A result is a frozen dataclass that inherits ``JsonRecord``. ``to_dict`` walks its fields in order: a nested result
(another ``JsonRecord``) gives its own ``to_dict``; other dataclasses, lists, tuples and dicts are converted as
``dataclasses.asdict`` converts them. ``"schema"`` carries the class's ``_schema``, the layout version a reader checks
before trusting the rest: first, or where the class declares a ``schema`` field. Three knobs, and no hand-written
dicts:

* ``_schema = None``: a part versioned by the result that holds it (``Trial`` inside ``Measurement``), no key;
* ``_json_properties``: computed values appended after the fields (``ModelStateMemory.total_bytes``);
* ``field(metadata=NOT_IN_JSON)`` leaves a field out (a tensor), ``field(metadata=json_as(f))`` writes ``f(value)``.

Example::

    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Fill(JsonRecord):
    ...     written: int
    >>> Fill(written=3).to_json()
    '{"schema": 1, "written": 3}'
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

__all__ = ["NOT_IN_JSON", "JsonRecord", "json_as", "to_json_value"]

_JSON = "memfit.json"
NOT_IN_JSON: Mapping[str, Any] = {_JSON: None}
"""``field(metadata=NOT_IN_JSON)``: the field stays out of ``to_dict`` (a tensor, a callable)."""

_ATOMIC = (str, int, float, bool, type(None))


def json_as(convert: Callable[[Any], Any]) -> Mapping[str, Any]:
    """``field(metadata=json_as(convert))``: the field's JSON form is ``convert(value)``."""
    return {_JSON: convert}


class JsonRecord:
    """``to_dict`` and ``to_json`` for a result dataclass (see the module docstring)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]  # what makes a subclass a dataclass, for the type checker
    _schema: ClassVar[int | None] = 1
    """The JSON layout's version; bump it when a field is renamed or changes meaning. None: no ``schema`` key."""
    _json_properties: ClassVar[tuple[str, ...]] = ()
    """Properties written after the fields, for readers of the JSON who cannot call them."""

    def to_dict(self) -> dict[str, Any]:
        d = _fields_json(self)
        for name in self._json_properties:
            d[name] = to_json_value(getattr(self, name))
        if self._schema is None:
            return d
        if "schema" in d:  # a declared ``schema`` field keeps its place and holds the current version
            d["schema"] = self._schema
            return d
        return {"schema": self._schema, **d}

    def to_json(self, **kwargs: Any) -> str:
        """``json.dumps(self.to_dict(), **kwargs)``: ``indent=2`` for people, none for files read back."""
        return json.dumps(self.to_dict(), **kwargs)


def to_json_value(value: Any) -> Any:
    """``value`` as ``to_dict`` writes it: results by their own ``to_dict``, other dataclasses field by field."""
    if isinstance(value, _ATOMIC):
        return value
    if isinstance(value, JsonRecord):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _fields_json(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple keeps its type, as in asdict
        return type(value)(*[to_json_value(v) for v in value])
    if isinstance(value, (list, tuple)):
        return type(value)(to_json_value(v) for v in value)
    if isinstance(value, dict):
        return type(value)((to_json_value(k), to_json_value(v)) for k, v in value.items())
    return copy.deepcopy(value)


def _fields_json(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        convert = f.metadata.get(_JSON, to_json_value)
        if convert is not None:
            out[f.name] = convert(getattr(obj, f.name))
    return out
