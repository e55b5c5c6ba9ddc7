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
from collections.abc import Callable
from typing import Any, TypeVar, Union

import msgpack

MAX_MESSAGE_BYTES = 256 * 1024 * 1024

T = TypeVar("T")

# Types whose values msgpack decodes to exactly that type (a bool is not an int here).
_EXACT_SCALARS = (int, str, bytes, bool)


class WireError(ValueError):
    """A payload that is not a valid message of the expected protocol."""


_Check = Callable[[Any, str], Any]  # (value, where in the message) -> the field's value


class Protocol:
    """A registry of message types for one process boundary."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._types: dict[str, type] = {}
        self._checks: dict[Any, _Check] = {}  # a declared type -> its compiled check

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

    def encode(self, message: Any) -> bytes:
        tag = getattr(type(message), "TAG", None)
        if tag is None or self._types.get(tag) is not type(message):
            raise WireError(f"{type(message).__name__} is not a {self.name} message")
        top = {name: getattr(message, name) for name in _field_names(type(message))}
        top["type"] = tag
        return msgpack.packb(top, default=_fields_of, use_bin_type=True)

    def decode(self, raw: bytes) -> Any:
        if len(raw) > MAX_MESSAGE_BYTES:
            raise WireError(f"message of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
        try:
            # Map keys of any scalar type: `dict[int, float]` fields (a token's top logprobs)
            # have int keys, which strict_map_key refuses. The checks then hold every key to
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
        return self._checker(cls)(obj, tag)

    def _checker(self, hint: Any) -> _Check:
        """The check of a value declared `hint`, made once per type. Reading the type hints
        for every value (get_origin and get_args per field, dataclasses.fields per message)
        took a token's Output 20 us to decode, most of what the router spent receiving it."""
        check = self._checks.get(hint)
        if check is not None:
            return check
        if dataclasses.is_dataclass(hint):
            # A message may hold messages of its own type: while its builder is being made,
            # they find this stand-in, which calls the builder once it exists.
            self._checks[hint] = lambda value, where: self._checks[hint](value, where)
            check = self._compile_message(hint)
        else:
            check = self._compile(hint)
        self._checks[hint] = check
        return check

    def _compile_message(self, cls: type) -> _Check:
        hints = typing.get_type_hints(cls)
        fields = [(f.name, self._checker(hints[f.name]),
                   f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                  for f in dataclasses.fields(cls)]
        names = frozenset(hints)

        def build(obj: Any, where: str) -> Any:
            if not isinstance(obj, dict):
                raise WireError(f"{where}: expected a map")
            if not names.issuperset(obj):
                unknown = set(obj) - names
                raise WireError(f"{where}: unknown fields {sorted(map(repr, unknown))}")
            kwargs = {}
            for name, check, required in fields:
                if name in obj:
                    kwargs[name] = check(obj[name], f"{where}.{name}")
                elif required:
                    raise WireError(f"{where}: missing field {name!r}")
            try:
                return cls(**kwargs)
            except (TypeError, ValueError) as exc:  # __post_init__ checks
                raise WireError(f"{where}: {exc}") from None

        return build

    def _compile(self, hint: Any) -> _Check:
        origin = typing.get_origin(hint)
        if origin in (Union, types.UnionType):
            return self._compile_union(hint)
        if hint is Any:
            return lambda value, where: value
        if origin in (list, tuple):
            return self._compile_sequence(hint, origin)
        if origin is dict:
            return self._compile_map(hint)
        if hint is type(None):
            return _check_none
        if hint is float:
            return _check_float
        if hint is int:
            return _check_int
        if hint in (str, bytes, bool):
            def check_exact(value: Any, where: str) -> Any:
                if isinstance(value, hint):
                    return value
                raise WireError(f"{where}: expected {hint.__name__}")

            return check_exact
        return _unsupported(hint)

    def _compile_union(self, hint: Any) -> _Check:
        args = typing.get_args(hint)
        options = [self._checker(option) for option in args]
        optional = type(None) in args

        def check_union(value: Any, where: str) -> Any:
            if value is None and optional:  # what the first option to take None returns
                return None
            for option in options:
                try:
                    return option(value, where)
                except WireError:
                    continue
            raise WireError(f"{where}: {type(value).__name__} is not {hint}")

        return check_union

    def _compile_sequence(self, hint: Any, origin: type) -> _Check:
        """list[X], or tuple[X, ...] (the homogeneous form only; a list on the wire)."""
        args = typing.get_args(hint)
        if origin is tuple and (len(args) != 2 or args[1] is not Ellipsis):
            return _unsupported(hint)
        item_type = args[0]
        item = self._checker(item_type)
        exact = item_type in _EXACT_SCALARS
        make = list if origin is list else tuple

        def check_sequence(value: Any, where: str) -> Any:
            if not isinstance(value, list):
                raise WireError(f"{where}: expected a list")
            if exact and set(map(type, value)) <= {item_type}:
                # fast path: a list of token or block ids checks at C speed
                return value if make is list else tuple(value)
            return make(item(v, f"{where}[{i}]") for i, v in enumerate(value))

        return check_sequence

    def _compile_map(self, hint: Any) -> _Check:
        key_type, value_type = typing.get_args(hint)
        check_key, check_value = self._checker(key_type), self._checker(value_type)

        def check_map(value: Any, where: str) -> Any:
            if not isinstance(value, dict):
                raise WireError(f"{where}: expected a map")
            return {check_key(k, where): check_value(v, f"{where}.{k}")
                    for k, v in value.items()}

        return check_map


def _unsupported(hint: Any) -> _Check:
    """A field type the codec cannot check: a value of it is refused where it is read."""

    def refuse(value: Any, where: str) -> Any:
        raise WireError(f"{where}: unsupported field type {hint}")

    return refuse


def _check_none(value: Any, where: str) -> Any:
    if value is None:
        return None
    raise WireError(f"{where}: expected null")


def _check_float(value: Any, where: str) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise WireError(f"{where}: expected a number")


def _check_int(value: Any, where: str) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise WireError(f"{where}: expected an integer")


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    """A message class's field names, read once: dataclasses.fields() per message took a
    third of the store master's time encoding a lookup's holders (one nested message each)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _fields_of(value: Any) -> Any:
    """msgpack's hook for what it cannot pack itself: a nested message becomes its fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: getattr(value, name) for name in _field_names(type(value))}
    raise TypeError(f"cannot encode {type(value).__name__}")
