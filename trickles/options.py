"""Typed configuration sections: declaration, documentation and coercion.

Every section is a dataclass whose fields are declared with :func:`opt`, which stores a
one-line description next to the default. :func:`section_from_dict` builds a section from a
plain mapping (a TOML table or ``--set`` overrides), rejecting unknown keys and values of the
wrong type with a message that names the key and says what to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Union

from .errors import ConfigError


def opt(default: Any, doc: str, **kwargs: Any) -> Any:
    """A dataclass field with a default and a one-line description."""
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"doc": doc}, **kwargs)
    return dataclasses.field(default=default, metadata={"doc": doc}, **kwargs)


def field_docs(cls: type) -> dict[str, str]:
    """``{field name: description}`` for a section class."""
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        named = " or ".join(_type_name(a) for a in args if a is not type(None))
        return named + " (or none)" if type(None) in args else named
    if origin in (list, tuple):
        (inner, *_) = typing.get_args(tp) or (Any,)
        return f"a list of {_type_name(inner)}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Converts ``value`` to the annotated type ``tp`` or raises a ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}")
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args):
            if type(None) in args:
                return None
            raise bad
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, key)
            except ConfigError:
                continue
        raise bad
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        raise ConfigError(
            f"{key} must be {_type_name(tp)}, got {value!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
        )
    if origin in (list, tuple):
        (inner, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            value = [v for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise bad
        items = [coerce(v.strip() if isinstance(v, str) else v, inner, key) for v in value]
        return tuple(items) if origin is tuple else items
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                raise bad from None
        raise bad
    if tp is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    return value


def unknown_key_error(key: str, known: typing.Iterable[str], where: str = "") -> ConfigError:
    hint = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    suffix = f"; did you mean {hint[0]!r}?" if hint else f"; known keys: {', '.join(sorted(known))}"
    return ConfigError(f"unknown key {key!r}{where}{suffix}")


def section_from_dict(cls: type, values: dict[str, Any], prefix: str, base: Any = None, where: str = "") -> Any:
    """Builds section ``cls`` from ``values`` on top of ``base`` (default: the class defaults)."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in values.items():
        if k not in names:
            raise unknown_key_error(f"{prefix}.{k}", [f"{prefix}.{n}" for n in names], where)
        try:
            kwargs[k] = coerce(v, hints[k], f"{prefix}.{k}")
        except ConfigError as e:
            raise ConfigError(f"{e}{where}") from None
    base = base if base is not None else cls()
    return dataclasses.replace(base, **kwargs)
