"""Recipe loading and validation for the replaysim normalizer.

A recipe has data-juicer's YAML shape, so one file runs under either backend::

    text_keys: chosen            # the default text field of every operator (str, or a list: first wins)
    process:
      - text_length_filter: {min_len: 1, max_len: 20000}
      - text_length_filter: {min_len: 1, max_len: 20000, text_key: rejected}
      - document_deduplicator: {lowercase: false, text_key: text}

``load_recipe`` checks the shape (a mapping, ``process`` a list of one-key mappings whose value is a
mapping of arguments or null). ``resolve_ops`` additionally checks the operator names and arguments
against the native operators (``composer_replication.replaysim.ops``); the data-juicer backend skips
that step because data-juicer validates its own operators.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from composer_replication.replaysim.ops import NATIVE_OPS, validate_op_args

__all__ = ["Recipe", "OpSpec", "RecipeError", "load_recipe", "resolve_ops"]


class RecipeError(ValueError):
    """A recipe that is not valid YAML, has the wrong shape, or names unknown operators or arguments."""


@dataclass(frozen=True, kw_only=True)
class OpSpec:
    """One resolved operator of a recipe."""

    name: str
    """The operator name, e.g. ``"text_length_filter"``."""
    index: int
    """Position in ``process`` (0-based)."""
    text_key: str
    """The record field the operator reads (its ``text_key`` or the recipe's default)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Validated arguments, with data-juicer's defaults filled in (``text_key`` excluded)."""


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A loaded recipe: its path, the raw mapping, the default text key and the process list."""

    path: Path
    """Where the recipe was read from."""
    raw: dict[str, Any]
    """The YAML mapping as loaded (handed unchanged to data-juicer)."""
    text_key: str
    """Default text field: ``text_keys`` (first element when a list), else ``"text"`` as in data-juicer."""
    process: list[tuple[str, dict[str, Any]]]
    """``(op_name, args)`` per entry of ``process``, in order."""


def _default_text_key(raw: dict[str, Any], path: Path) -> str:
    text_keys = raw.get("text_keys", "text")
    if isinstance(text_keys, str) and text_keys:
        return text_keys
    if isinstance(text_keys, list) and text_keys and all(isinstance(k, str) and k for k in text_keys):
        return text_keys[0]
    raise RecipeError(
        f"recipe {path}: text_keys must be a non-empty string or list of strings, got {text_keys!r}"
    )


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Read and shape-check a recipe.

    Raises:
        FileNotFoundError: the file does not exist (the message names the path).
        RecipeError (a ``ValueError``): invalid YAML, not a mapping, ``process`` missing or not a
            list, an entry that is not a one-key mapping, or arguments that are not a mapping.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"replaysim recipe not found: {p} (pass recipe_path=... or skip_dj=True)")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {p} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe {p} must be a YAML mapping with a 'process' list, got {type(raw).__name__}")
    if "process" not in raw:
        raise RecipeError(f"recipe {p} has no 'process' key; add 'process: [- op_name: {{args}}]'")
    steps = raw["process"]
    if not isinstance(steps, list):
        raise RecipeError(f"recipe {p}: 'process' must be a list of operators, got {type(steps).__name__}")
    process: list[tuple[str, dict[str, Any]]] = []
    for i, step in enumerate(steps):
        if not isinstance(step, dict) or len(step) != 1:
            keys = list(step) if isinstance(step, dict) else step
            raise RecipeError(
                f"recipe {p}: process[{i}] must be a mapping with exactly one operator name, got {keys!r}; "
                "write each operator as its own list item ('- op_name: {args}')"
            )
        (name, args), = step.items()
        if not isinstance(name, str):
            raise RecipeError(f"recipe {p}: process[{i}] operator name must be a string, got {name!r}")
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise RecipeError(
                f"recipe {p}: arguments of process[{i}] ({name}) must be a mapping, got {args!r}"
            )
        process.append((name, dict(args)))
    return Recipe(path=p, raw=raw, text_key=_default_text_key(raw, p), process=process)


def resolve_ops(recipe: Recipe) -> list[OpSpec]:
    """Check every operator against the native implementations and fill in defaults.

    Raises:
        RecipeError: an operator the native backend does not implement (the message lists the known
            ones and points to ``backend="data_juicer"``), or a bad argument (name, type or range).
    """
    specs = []
    for i, (name, args) in enumerate(recipe.process):
        if name not in NATIVE_OPS:
            raise RecipeError(
                f"recipe {recipe.path}: process[{i}] uses unknown operator {name!r}; the native backend "
                f"implements {sorted(NATIVE_OPS)} (use backend='data_juicer' for other data-juicer operators)"
            )
        args = dict(args)
        text_key = args.pop("text_key", recipe.text_key)
        if not isinstance(text_key, str) or not text_key:
            raise RecipeError(f"recipe {recipe.path}: process[{i}] ({name}): text_key must be a string, got {text_key!r}")
        try:
            full = validate_op_args(name, args)
        except (TypeError, ValueError) as exc:
            raise RecipeError(f"recipe {recipe.path}: process[{i}] ({name}): {exc}") from exc
        specs.append(OpSpec(name=name, index=i, text_key=text_key, args=full))
    return specs
