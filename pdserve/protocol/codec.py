"""Typed msgpack messages: the one checked codec every process boundary uses.

A message is a frozen dataclass registered under a type tag. On the wire it is a msgpack map
`{"type": tag, field: value, ...}`; decoding checks the tag, that every required field is
present, that no unknown field is, and that each value has its declared type (nested
messages and lists included), and only then builds the dataclass. Nothing is ever unpickled or
evaluated: a malformed or hostile payload becomes a `WireError`, which the receiver logs and
answers or drops.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar, Union

import msgpack

MAX_MESSAGE_BYTES = 256 * 1024 * 1024

T = TypeVar("T")

# Types whose values msgpack decodes to exactly that type (a bool is not an int here).
_EXACT_SCALARS = (int, str, bytes, bool)


class WireError(ValueError):
    """A payload that is not a valid message of the expected protocol."""


class Protocol:
    """A registry of message types for one process boundary."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._types: dict[str, type] = {}
        self._hints: dict[type, dict[str, Any]] = {}

    def message(self, tag: str):
        """Class decorator: register a frozen dataclass as message `tag`."""

        def register(cls: type[T]) -> type[T]:
            if not dataclasses.is_dataclass(cls):
                raise TypeError(f"{cls.__name__} must be a dataclass")
            if tag in self._types:
                raise ValueError(f"duplicate message tag {tag!r} in {self.name}")
            self._types[tag] = cls
            cls.TAG = tag  # type: ignore[attr-defined]
            return cls

        return register

    def _fields(self, cls: type) -> dict[str, Any]:
        if cls not in self._hints:
            self._hints[cls] = typing.get_type_hints(cls)
        return self._hints[cls]

    def encode(self, message: Any) -> bytes:
        tag = getattr(type(message), "TAG", None)
        if tag is None or self._types.get(tag) is not type(message):
            raise WireError(f"{type(message).__name__} is not a {self.name} message")
        top = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
        top["type"] = tag
        return msgpack.packb(top, default=_fields_of, use_bin_type=True)

    def decode(self, raw: bytes) -> Any:
        if len(raw) > MAX_MESSAGE_BYTES:
            raise WireError(f"message of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
        try:
            # Map keys of any scalar type: `dict[int, float]` fields (a token's top logprobs)
            # have int keys, which strict_map_key refuses. `_check` then holds every key to
            # its field's declared key type, so a str-keyed field still gets only str keys.
            obj = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several types on garbage
            raise WireError(f"not msgpack: {type(exc).__name__}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
            raise WireError("a message must be a map with a string 'type'")
        tag = obj.pop("type")
        cls = self._types.get(tag)
        if cls is None:
            raise WireError(f"unknown {self.name} message type {tag!r}")
        return self._build(cls, obj, tag)

    def _build(self, cls: type, obj: Any, where: str) -> Any:
        if not isinstance(obj, dict):
            raise WireError(f"{where}: expected a map")
        hints = self._fields(cls)
        unknown = set(obj) - set(hints)
        if unknown:
            raise WireError(f"{where}: unknown fields {sorted(map(repr, unknown))}")
        kwargs = {}
        for field in dataclasses.fields(cls):
            if field.name in obj:
                kwargs[field.name] = self._check(hints[field.name], obj[field.name],
                                                 f"{where}.{field.name}")
            elif (field.default is dataclasses.MISSING
                  and field.default_factory is dataclasses.MISSING):
                raise WireError(f"{where}: missing field {field.name!r}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:  # __post_init__ checks
            raise WireError(f"{where}: {exc}") from None

    def _check(self, hint: Any, value: Any, where: str) -> Any:
        origin = typing.get_origin(hint)
        if origin in (Union, types.UnionType):
            for option in typing.get_args(hint):
                try:
                    return self._check(option, value, where)
                except WireError:
                    continue
            raise WireError(f"{where}: {type(value).__name__} is not {hint}")
        if hint is type(None):
            if value is None:
                return None
            raise WireError(f"{where}: expected null")
        if hint is Any:
            return value
        if origin is list:
            if not isinstance(value, list):
                raise WireError(f"{where}: expected a list")
            (item,) = typing.get_args(hint)
            if item in _EXACT_SCALARS and set(map(type, value)) <= {item}:
                return value  # fast path: a list of token or block ids checks in C speed
            return [self._check(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        if origin is tuple:  # only the homogeneous form, tuple[X, ...]; a list on the wire
            item, ellipsis = typing.get_args(hint)
            if ellipsis is not Ellipsis:
                raise WireError(f"{where}: unsupported field type {hint}")
            if not isinstance(value, list):
                raise WireError(f"{where}: expected a list")
            if item in _EXACT_SCALARS and set(map(type, value)) <= {item}:
                return tuple(value)
            return tuple(self._check(item, v, f"{where}[{i}]") for i, v in enumerate(value))
        if origin is dict:
            if not isinstance(value, dict):
                raise WireError(f"{where}: expected a map")
            key_t, val_t = typing.get_args(hint)
            return {self._check(key_t, k, where): self._check(val_t, v, f"{where}.{k}")
                    for k, v in value.items()}
        if dataclasses.is_dataclass(hint):
            return self._build(hint, value, where)
        if hint is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            raise WireError(f"{where}: expected a number")
        if hint is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            raise WireError(f"{where}: expected an integer")
        if hint in (str, bytes, bool):
            if isinstance(value, hint):
                return value
            raise WireError(f"{where}: expected {hint.__name__}")
        raise WireError(f"{where}: unsupported field type {hint}")


def _fields_of(value: Any) -> Any:
    """msgpack's hook for what it cannot pack itself: a nested message becomes its fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    raise TypeError(f"cannot encode {type(value).__name__}")
