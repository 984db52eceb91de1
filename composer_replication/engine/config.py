"""Training configuration: one typed ``@dataclass(kw_only=True)`` tree per student trainer (:class:`StudentConfig`),
and the generic helpers that recipes use for their own trees.

Each ``__post_init__`` checks every number against its interval (``losses.config.check_ranges``: a table per
class) and the cross-field rules, naming the key. :func:`from_dict` builds a tree from plain dicts (YAML), naming the
dotted key of an unknown key or a wrong type (``'optim.lr' must be a float, got 'abc'``; strings at most 4096
characters; a rejected value shown to 200); :func:`to_dict` gives what ``config.yaml`` holds; :func:`load_yaml` reads
plain YAML (no anchors or aliases), :func:`apply_overrides` applies ``key.sub=value`` strings; :func:`yaml_error_text`
says where a YAML file is broken.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, Union

import torch
import yaml

from composer_replication.losses.config import LossConfig, check_ranges, shown  # LossConfig: under ``loss``
from composer_replication.losses.config import check_choice as _check_choice
from composer_replication.losses.config import check_key as _check

__all__ = ["OptimConfig", "LossConfig", "RolloutConfig", "StudentConfig", "resolve_device", "from_dict",
           "to_dict", "apply_overrides"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MAX_STR = 4096  # characters of any string value (a path's limit): a longer one is a typo or an attack


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW and its learning-rate schedule (the inner optimizer of the student)."""

    lr: float = 1e-5
    """Peak learning rate reached after warm-up."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW ``(beta1, beta2)``."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Steps of linear warm-up from ``lr / (warmup_steps + 1)`` to ``lr``."""
    scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """Shape after warm-up: ``constant``; ``linear`` decay to 0 at ``num_steps``; ``cosine`` decay to 0."""
    max_grad_norm: float = 1.0
    """Gradient clipping threshold on the global L2 norm; ``0`` disables clipping (the norm is still reported)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step (whole prompt groups; each channel weighted by its share, so the update is
    the whole batch's: ``engine.accumulate``). Lowers peak memory; at most ``rollout.prompts_per_step``."""

    def __post_init__(self) -> None:
        _check(isinstance(self.betas, tuple | list) and len(self.betas) == 2, "optim.betas",
               f"must be two numbers in [0, 1), got {shown(self.betas)}")
        check_ranges(self, "optim", {"lr": "(0, 10]", "weight_decay": "[0, 100]", "betas": "[0, 1)", "eps": "(0, 1]",
                                     "warmup_steps": "[0, 1e9]", "max_grad_norm": "[0, 1e9]",
                                     "grad_accum_steps": "[1, 65536]"})
        _check_choice(self.scheduler, "optim.scheduler", ("constant", "linear", "cosine"))


@dataclass(kw_only=True)
class RolloutConfig:
    """On-policy sampling and the data drawn per step."""

    environment: Literal["next_action", "python_tasks", "mixed", "agentic"] = "next_action"
    """Reward environment: next-action prediction on trace states, bundled Python tasks, both, or ``agentic``
    (multi-turn episodes on repositories with tests, ``rollout.agent``: a prompt is a task, a sample an episode)."""
    prompts_per_step: int = 4
    """Distinct prompts per step and per rank."""
    num_generations: int = 4
    """Samples per prompt (the GRPO group size G)."""
    max_new_tokens: int = 64
    """Generation length limit per sample."""
    temperature: float = 1.0
    """Sampling temperature (> 0; greedy decoding is only used by ``evaluate``)."""
    top_p: float = 1.0
    """Nucleus sampling threshold in (0, 1]."""
    pairs_per_step: int = 2
    """Trace-replay DPO pairs per step and per rank (0 disables channel 3). The state of a drawn pair whose rejected
    side comes from the rollouts (the ``recorded`` teacher's) is one of the step's prompts, so a step may have
    more than ``prompts_per_step`` prompts (``engine.data.draw_step``). ``agentic``: pairs where episodes depart
    from their tasks' ``solution_actions``, at most this many per step."""
    max_turns: int = 0
    """``agentic``: turns per episode, at most each task's ``max_turns`` (0: the task's own)."""

    def __post_init__(self) -> None:
        _check_choice(self.environment, "rollout.environment", ("next_action", "python_tasks", "mixed", "agentic"))
        check_ranges(self, "rollout", {"prompts_per_step": "[1, 65536]", "num_generations": "[1, 4096]",
                                       "max_new_tokens": "[1, 1048576]", "temperature": "(0, 100]", "top_p": "(0, 1]",
                                       "pairs_per_step": "[0, 65536]", "max_turns": "[0, 4096]"})


@dataclass(kw_only=True)
class StudentConfig:
    """One student trainer: model, device, schedule, optimizer, loss and rollouts."""

    model: str = "smollm2-135m"
    """``smollm2-135m`` (embedded default), ``tiny`` (tests), or a local Hugging Face model folder."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the student and the reference."""
    device: str = "auto"
    """``auto`` (``cuda:<local rank>`` when CUDA is available, else ``cpu``), ``cpu``, ``cuda`` or ``cuda:N``."""
    seed: int = 0
    """Seed of the model init (``tiny``), data order and sampling; combined with (step, rank); in ``[0, 2**63)``
    (``torch.manual_seed``'s range)."""
    num_steps: int = 100
    """Planned optimizer steps (sets the LR schedule and the TAID floor)."""
    max_seq_len: int = 2048
    """Longest preference row (prompt + response) the trainer accepts (see ``over_length``)."""
    over_length: Literal["truncate_left", "skip"] = "truncate_left"
    """Over-length policy of preference rows (``composer_replication.batching``): cut the history from the left,
    or skip the pair; a response that alone reaches ``max_seq_len`` is always skipped. Counted in the metrics."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Loss channels and their weights."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling and per-step data."""

    def __post_init__(self) -> None:
        _check(bool(self.model), "model", "must be a non-empty model name or folder")
        _check_choice(self.dtype, "dtype", tuple(_DTYPES))
        _check(self.device in ("auto", "cpu", "cuda") or _is_cuda_n(self.device), "device",
               f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {shown(self.device)}")
        check_ranges(self, "", {"seed": "[0, 9223372036854775808)", "num_steps": "[1, 1e9]",
                                "max_seq_len": "[8, 16777216]"})
        _check_choice(self.over_length, "over_length", ("truncate_left", "skip"))
        _check(self.optim.warmup_steps <= self.num_steps, "optim.warmup_steps",
               f"must be <= 'num_steps' ({self.num_steps}), got {self.optim.warmup_steps}")
        _check(self.optim.grad_accum_steps <= self.rollout.prompts_per_step, "optim.grad_accum_steps",
               f"must be <= 'rollout.prompts_per_step' ({self.rollout.prompts_per_step}): micro-batches hold whole "
               f"prompt groups; got {self.optim.grad_accum_steps}")


def _is_cuda_n(device: str) -> bool:
    head, _, idx = device.partition(":")
    return head == "cuda" and idx.isdigit() and len(idx) < 6


def resolve_dtype(name: str) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16"`` -> the torch dtype (``ValueError`` otherwise)."""
    _check_choice(name, "dtype", tuple(_DTYPES))
    return _DTYPES[name]


def resolve_device(device: str, *, local_rank: int | None = None) -> torch.device:
    """A config device string as a ``torch.device``: ``"auto"`` is ``cuda:<local_rank % device_count>`` when CUDA
    is available (``local_rank`` default: ``$LOCAL_RANK``, else 0), else ``cpu``.

    Raises:
        ValueError: a CUDA device is requested but CUDA is unavailable, or the string is malformed.
    """
    if device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        rank = int(os.environ.get("LOCAL_RANK", "0") or 0) if local_rank is None else local_rank
        return torch.device("cuda", rank % torch.cuda.device_count())
    if device == "cpu":
        return torch.device("cpu")
    _check(device == "cuda" or _is_cuda_n(device), "device", f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"'device' is {device!r} but CUDA is not available on this machine; use 'auto' or 'cpu'.")
    return torch.device(device)


def build_lr_lambda(*, warmup_steps: int, num_steps: int, scheduler: str) -> Callable[[int], float]:
    """The ``LambdaLR`` multiplier ``f(s)`` (``s`` = optimizer steps taken): linear warm-up ``(s + 1) /
    (warmup_steps + 1)`` for ``s < warmup_steps``, then ``constant`` 1, or ``linear`` / ``cosine`` decay to 0 at
    ``num_steps``."""

    def lr_lambda(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / (warmup_steps + 1)
        progress = min(1.0, (s - warmup_steps) / max(1, num_steps - warmup_steps))
        if scheduler == "linear":
            return max(0.0, 1.0 - progress)
        return 1.0 if scheduler == "constant" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return lr_lambda


T = TypeVar("T")
_SCALARS = {bool: "a boolean (true/false)", int: "an integer", str: "a string"}


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _coerce_float(value: Any, key: str) -> float:
    """A finite float from a number or a numeric string (YAML 1.1 reads ``1e-5`` as a string)."""
    out = None
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            out = float(value)
        except OverflowError:  # an integer too large for a float
            out = math.inf
        except ValueError:
            pass
    if out is None:
        raise ValueError(f"'{key}' must be a float, got {shown(value)}")
    if not math.isfinite(out):
        raise ValueError(f"'{key}' must be a finite number, got {shown(value)} (inf and nan are refused)")
    return out


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert ``value`` to the annotated type ``tp``; ``ValueError`` naming ``key``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if len(errors) == 1 else f"'{key}' has an invalid value {shown(value)}")
    if origin is Literal:
        if value not in args:
            raise ValueError(f"'{key}' must be one of {', '.join(map(repr, args))}, got {shown(value)}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"'{key}' must be a mapping of {tp.__name__} fields, got {shown(value)}")
        return from_dict(tp, value, path=key)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"'{key}' must be a list, got {shown(value)}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ValueError(f"'{key}' must have {len(args)} items, got {shown(value)}")
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        out = [_coerce(v, args[0] if args else Any, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ValueError(f"'{key}' must be a mapping, got {shown(value)}")
        return dict(value)
    if tp is float:
        return _coerce_float(value, key)
    if tp in _SCALARS and (not isinstance(value, tp) or (tp is int and isinstance(value, bool))):
        raise ValueError(f"'{key}' must be {_SCALARS[tp]}, got {shown(value)}")
    if tp is str and len(value) > _MAX_STR:
        raise ValueError(f"'{key}' is {len(value)} characters long, more than {_MAX_STR}: {shown(value)}")
    return value


def from_dict(cls: type[T], data: dict[str, Any], *, path: str = "") -> T:
    """The (nested) dataclass ``cls`` from a plain dict (e.g. parsed YAML; ``path``: its dotted prefix in the root
    tree). Missing keys keep their defaults; values are checked against the annotations (``int``, finite ``float``
    (ints and numeric strings accepted), ``bool``, ``str``, ``Literal``, ``X | None``, ``tuple``/``list``, ``dict``,
    nested dataclasses), then ``__post_init__`` runs. ``ValueError``: an unknown key (``unknown key
    'loss.alhpa_sdpo'; allowed: ...``), a wrong type, or a failed cross-field check.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"'{path or cls.__name__}' must be a mapping, got {shown(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ValueError(f"unknown key {shown(_join(path, str(unknown[0])))}; allowed: {', '.join(sorted(fields))}")
    return cls(**{name: _coerce(value, hints[name], _join(path, name)) for name, value in data.items()})


def to_dict(obj: Any) -> Any:
    """A dataclass tree as plain dicts/lists/scalars (tuples become lists), ready for ``yaml.safe_dump``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return [to_dict(v) for v in obj] if isinstance(obj, (list, tuple)) else obj


class _PlainLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` refusing anchors and aliases (``&a`` / ``*a``: each level of an alias bomb multiplies the
    value ten-fold)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise yaml.composer.ComposerError(None, None, "YAML anchors and aliases (&name, *name) are refused in "
                                              "configs; write each value out", event.start_mark)
        return super().compose_node(parent, index)


def load_yaml(text: str) -> Any:
    """``text`` as plain YAML: ``yaml.safe_load`` without anchors or aliases. ``yaml.YAMLError``: bad YAML, a tag
    that builds a Python object, an anchor or alias, nesting deeper than Python's recursion, an unreadable number."""
    try:
        return yaml.load(text, Loader=_PlainLoader)  # noqa: S506 - a SafeLoader
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None
    except ValueError as exc:  # e.g. an int beyond Python's 4300-digit limit
        raise yaml.YAMLError(f"a value cannot be read ({str(exc)[:100]})") from None


def yaml_error_text(exc: yaml.YAMLError) -> str:
    """One line saying what YAML refused, and where (unsafe tags such as ``!!python/object`` are refused by name)."""
    problem = str(getattr(exc, "problem", None) or exc).strip().splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    if isinstance(exc, yaml.constructor.ConstructorError) and "tag" in problem:
        problem += " (tags that build Python objects are never read; write plain values)"
    return problem + (f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of ``data`` with ``key.sub=value`` overrides (values read by :func:`load_yaml`: ``0.2``, ``true``,
    ``null``, ``[0.9, 0.95]``, else a string; missing mappings created; unknown keys left to :func:`from_dict`).
    ``ValueError``: no ``=`` or an empty key, a value that is not plain YAML, or a path into a non-mapping.
    """
    out = copy.deepcopy(data) if data is not None else {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ValueError(f"override {shown(item)} must look like 'key.sub=value' (e.g. 'loss.alpha_sdpo=0.2')")
        try:
            value = load_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ValueError(f"override {shown(item)}: the value is not plain YAML ({yaml_error_text(exc)})") from None
        node = out
        for i, part in enumerate(parts[:-1]):
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                raise ValueError(f"override {shown(item)}: {shown('.'.join(parts[: i + 1]))} is {shown(node[part])}, "
                                 "not a mapping")
            node = node[part]
        node[parts[-1]] = value
    return out
