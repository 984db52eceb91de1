"""Config trees as plain data: typed dataclass trees from dicts (YAML), back to dicts, and ``key=value`` overrides.

- :func:`from_dict` builds nested dataclasses from plain dicts, rejecting unknown keys and values of the
  wrong type with an error that names the dotted key (``'optim.lr' must be a float, got 'abc'``);
- :func:`to_dict` turns a tree back into plain dicts/lists (what ``config.yaml`` holds);
- :func:`apply_overrides` applies command-line ``key.sub=value`` strings (values parsed as YAML);
- :func:`yaml_error_text` says where a YAML file is broken.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from typing import Any, Literal, TypeVar, Union

import yaml

__all__ = ["from_dict", "to_dict", "apply_overrides", "yaml_error_text"]

T = TypeVar("T")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    return {float: "a float", int: "an integer", bool: "a boolean", str: "a string"}.get(tp, str(tp))


def _coerce_float(value: Any, key: str) -> float:
    """A finite float from a number or a numeric string (YAML 1.1 reads ``1e-5`` as a string)."""
    out = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            out = float(value)
        except OverflowError:  # an integer too large for a float
            out = math.inf
    elif isinstance(value, str):
        try:
            out = float(value)
        except ValueError:
            pass
    if out is None:
        raise ValueError(f"'{key}' must be a float, got {value!r}")
    if not math.isfinite(out):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        raise ValueError(f"'{key}' must be a finite number, got {shown} (inf and nan are refused)")
    return out


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert ``value`` to the annotated type ``tp``; raise ``ValueError`` naming ``key``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if len(errors) == 1 else f"'{key}' has an invalid value {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ValueError(f"'{key}' must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"'{key}' must be a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, path=key)
    if origin in (tuple, list):
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"'{key}' must be a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ValueError(f"'{key}' must have {len(args)} items, got {value!r}")
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        out = [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ValueError(f"'{key}' must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"'{key}' must be a boolean (true/false), got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"'{key}' must be an integer, got {value!r}")
        return value
    if tp is float:
        return _coerce_float(value, key)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"'{key}' must be a string, got {value!r}")
        return value
    return value


def from_dict(cls: type[T], data: dict[str, Any], *, path: str = "") -> T:
    """Build the (nested) dataclass ``cls`` from a plain dict, e.g. a parsed YAML file.

    Missing keys keep their defaults. Values are checked against the field annotations
    (``int``, ``float`` (finite; ints and numeric strings accepted), ``bool``, ``str``, ``Literal``,
    ``X | None``, ``tuple``/``list``, ``dict``, nested dataclasses); ``__post_init__`` then
    runs the cross-field checks.

    Args:
        cls: a ``@dataclass`` type.
        data: plain dict (``None`` is treated as ``{}``).
        path: dotted prefix of ``data`` inside the root tree, used in error messages.

    Raises:
        ValueError: an unknown key (``unknown key 'loss.alhpa_sdpo'; allowed: ...``), a wrong type
            (``'optim.lr' must be a float, got 'abc'``), or a failed cross-field check.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"'{path or cls.__name__}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ValueError(
            f"unknown key '{_join(path, str(unknown[0]))}'; allowed: {', '.join(sorted(fields))}"
        )
    kwargs = {name: _coerce(value, hints[name], _join(path, name)) for name, value in data.items()}
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """A dataclass tree as plain dicts/lists/scalars (tuples become lists), ready for ``yaml.safe_dump``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def yaml_error_text(exc: yaml.YAMLError) -> str:
    """One line saying what YAML refused (unsafe tags such as ``!!python/object`` are refused by name)."""
    problem = str(getattr(exc, "problem", None) or exc).strip().splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    if isinstance(exc, yaml.constructor.ConstructorError) and "tag" in problem:
        problem += " (tags that build Python objects are never read; write plain values)"
    return problem + where


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides to a plain config dict; returns a new dict.

    Values are parsed with ``yaml.safe_load`` (``0.2`` -> float, ``true`` -> bool, ``null`` -> None,
    ``[0.9, 0.95]`` -> list, anything else a string). Missing intermediate mappings are created;
    unknown keys are reported later by :func:`from_dict`.

    Raises:
        ValueError: an override without ``=``, with an empty key, with a value that is not plain YAML
            (syntax error, or an unsafe tag such as ``!!python/object``), or that descends into a non-mapping.
    """
    out = copy.deepcopy(data) if data is not None else {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ValueError(f"override {item!r} must look like 'key.sub=value' (e.g. 'loss.alpha_sdpo=0.2')")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            problem = yaml_error_text(exc)
            raise ValueError(f"override {item!r}: the value is not plain YAML ({problem})") from None
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ValueError(
                    f"override {item!r}: '{'.'.join(parts[: i + 1])}' is {child!r}, not a mapping"
                )
            node = child
        node[parts[-1]] = value
    return out
