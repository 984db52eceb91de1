"""replaysim: normalise teacher-replay DPO pairs with a data-juicer-style recipe (ADR-004).

Pipeline: ``replay_trace`` (teachers answer each frozen state) -> ``extract_dpo_pairs`` (consensus
vs. student) -> ``DJNormalizer.normalize`` (filters and dedup) -> ``NormalizedDPOPair``.

Each pair becomes a record with the chosen and rejected actions as flat strings (``chosen``,
``rejected``, and ``text = chosen + "\\n" + rejected``) beside the chat-message lists, so a
data-juicer recipe runs unchanged. The default ``backend="native"`` runs the operators of
``composer_replication.replaysim.ops``; ``backend="data_juicer"`` runs the real data-juicer, which is
never a dependency (it installs packages while running; see ``docs/replaysim.md``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any, ClassVar

import yaml

from composer_replication import teacher_replay
from composer_replication.replaysim.degenerate import RULES, degeneracy
from composer_replication.replaysim.ops import NATIVE_OPS, REPLAYSIM_OPS, action_limits, dedup_hash, op_keep
from composer_replication.replaysim.recipe import OpSpec, Recipe, load_recipe, resolve_ops
from composer_replication.teacher_replay import recorded as recorded_teacher
from composer_replication.types import PreferencePair, TeacherCallResult

__all__ = [
    "NormalizedDPOPair",
    "DroppedPair",
    "NormalizeReport",
    "DJNormalizer",
    "replay_and_normalize_trace",
    "replay_and_normalize_trace_sync",
]

log = logging.getLogger(__name__)

_BACKENDS = ("native", "data_juicer")
_REQUIRED = ("state_id", "state_messages", "chosen", "rejected", "n_teachers_agreeing")
_DJ_HINT = "pip install py-data-juicer"


NormalizedDPOPair = PreferencePair
"""The spec's name for a pair after normalisation: the one :class:`~composer_replication.types.PreferencePair`
record, its ``metadata`` annotated with the backend, the recipe and the operators that ran (or
``{"skipped": True}``)."""


@dataclass(frozen=True, kw_only=True)
class DroppedPair:
    """Why one input pair was dropped."""

    index: int
    """Position of the pair in the input of ``normalize``."""
    state_id: str
    """The pair's state id."""
    op: str
    """The operator that dropped it (``"data_juicer"`` when that backend cannot say)."""
    reason: str
    """A readable reason, e.g. ``"text_length_filter on chosen: len=0 outside [1, 20000]"``."""
    kind: str = ""
    """The count key: the broken rule for ``degenerate_action_filter`` (``empty``, ``truncated_call``,
    ``repetition``, ``text_for_call``), else the operator (``text_length_filter``, ``document_deduplicator``...)."""


@dataclass(kw_only=True)
class NormalizeReport:
    """What the last ``normalize`` call did."""

    backend: str
    """``"native"``, ``"data_juicer"`` or ``"skipped"``."""
    recipe: str | None
    """The recipe path (``None`` when skipped)."""
    n_in: int
    """Pairs received."""
    n_out: int
    """Pairs kept."""
    ops: list[str] = field(default_factory=list)
    """Operators run, in order."""
    dropped: list[DroppedPair] = field(default_factory=list)
    """One entry per dropped pair."""

    def drop_counts(self, prefix: str = "") -> dict[str, int]:
        """Dropped pairs per :attr:`DroppedPair.kind` (e.g. ``{"replay/dropped/repetition": 3}`` with
        ``prefix="replay/dropped/"``), keys sorted; every rule of ``degenerate_action_filter`` and every other
        operator that ran is listed, with 0 when it dropped nothing."""
        kinds = [k for op in dict.fromkeys(self.ops) for k in (RULES if op in REPLAYSIM_OPS else (op,))]
        counts: dict[str, int] = {prefix + k: 0 for k in kinds}
        for d in self.dropped:
            key = prefix + (d.kind or d.op)
            counts[key] = counts.get(key, 0) + 1
        return dict(sorted(counts.items()))


def _record(i: int, pair: PreferencePair | Mapping[str, Any]) -> tuple[PreferencePair, dict[str, Any]]:
    """The pair (read with ``PreferencePair.from_mapping``) and the flat text record the operators read.

    ``recorded`` is the state's recorded action: ``metadata["recorded_action"]`` (set by
    ``extract_dpo_pairs``), else the rejected side unless that is a student sample (then unknown: ``None``).
    """
    pair = PreferencePair.from_mapping(pair, where=f"pairs[{i}]")
    chosen, rejected = pair.chosen, pair.rejected
    recorded = pair.metadata.get("recorded_action")
    if not isinstance(recorded, str):
        recorded = None if recorded_teacher.is_student_sample(pair) else rejected
    return pair, {"state_id": pair.state_id, "chosen": chosen, "rejected": rejected, "text": f"{chosen}\n{rejected}",
                  "recorded": recorded}


def _annotated(pair: PreferencePair, metadata: dict[str, Any]) -> PreferencePair:
    """``pair`` with ``metadata`` merged into its own (the normalizer annotates; it never converts)."""
    return dataclasses.replace(pair, metadata={**pair.metadata, **metadata})


class DJNormalizer:
    """Normalise DPO pairs with a data-juicer-shaped recipe.

    Args:
        recipe_path: the YAML recipe; ``None`` means ``DJNormalizer.DEFAULT_RECIPE``.
        skip_dj: pass pairs through unchanged with ``metadata={"skipped": True}``; no recipe is read.
        backend: ``"native"`` (built-in operators, the default) or ``"data_juicer"`` (the real
            data-juicer, which must be installed: ``pip install py-data-juicer``).

    Raises:
        FileNotFoundError: the recipe does not exist (unless ``skip_dj``).
        ValueError: an unknown backend, or a malformed recipe (``RecipeError`` names the operator/key).
        RuntimeError: ``backend="data_juicer"`` but data-juicer is not importable.
    """

    DEFAULT_RECIPE: ClassVar[Path] = Path(str(files("composer_replication.replaysim") / "default.yaml"))

    def __init__(
        self,
        recipe_path: str | os.PathLike[str] | None = None,
        *,
        skip_dj: bool = False,
        backend: str = "native",
    ) -> None:
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        self.backend = backend
        self.skip_dj = skip_dj
        self.recipe_path = Path(recipe_path) if recipe_path is not None else self.DEFAULT_RECIPE
        self.recipe: Recipe | None = None
        self.ops: list[OpSpec] = []
        self.last_report: NormalizeReport | None = None
        if skip_dj:
            return
        self.recipe = load_recipe(self.recipe_path)
        if backend == "native":
            self.ops = resolve_ops(self.recipe)
            bad = [op for op in self.ops if op.text_key not in ("chosen", "rejected", "text")]
            if bad:
                raise ValueError(
                    f"recipe {self.recipe_path}: process[{bad[0].index}] ({bad[0].name}) reads text_key "
                    f"{bad[0].text_key!r}; records have 'chosen', 'rejected' and 'text' (chosen + newline + rejected)"
                )
        else:
            if importlib.util.find_spec("data_juicer") is None:
                raise RuntimeError(f"backend='data_juicer' needs data-juicer, which is not installed: {_DJ_HINT}")
            own = [step for step in self.recipe.process if step[0] in REPLAYSIM_OPS]  # run natively first
            self.ops = resolve_ops(dataclasses.replace(self.recipe, process=own))

    def normalize_report(self) -> NormalizeReport | None:
        """The report of the last ``normalize`` call (``None`` before the first)."""
        return self.last_report

    def normalize(self, pairs: Iterable[PreferencePair | Mapping[str, Any]]) -> list[PreferencePair]:
        """Filter ``pairs`` with the recipe; the output keeps input order and may be shorter.

        Pairs are :class:`~composer_replication.types.PreferencePair` records (spec ``DPOPair`` dicts are read
        with ``PreferencePair.from_mapping``); kept pairs come back as the same records with their
        ``metadata`` annotated.

        Raises:
            ValueError: a pair that lacks a key or has an empty action.
        """
        read = [_record(i, p) for i, p in enumerate(pairs)]
        items, records = [p for p, _ in read], [r for _, r in read]
        if self.skip_dj:
            self.last_report = NormalizeReport(backend="skipped", recipe=None, n_in=len(records), n_out=len(records))
            return [_annotated(p, {"skipped": True}) for p in items]
        if self.backend == "native":
            kept, meta = self._normalize_native(records)
        else:
            kept, meta = self._normalize_data_juicer(records)
        return [_annotated(items[i], {**meta, "ops": [dict(o) for o in meta["ops"]], "source_index": i})
                for i in kept]

    # ------------------------------------------------------------------------------------------
    def _apply_native(self, records: list[dict[str, Any]]) -> tuple[list[int], list[DroppedPair]]:
        """Run ``self.ops`` natively: the surviving record indices and the drops."""
        alive = list(range(len(records)))
        dropped: list[DroppedPair] = []
        for op in self.ops:
            kept: list[int] = []
            seen: dict[str, int] = {}
            kind = NATIVE_OPS[op.name].kind
            for i in alive:
                text, label = records[i][op.text_key], op.name
                if kind == "deduplicator":
                    first = seen.setdefault(dedup_hash(text, op.args), i)
                    ok, why = first == i, f"duplicate of pair #{first} ({records[first]['state_id']})"
                elif kind == "action_filter":
                    recorded = records[i]["recorded"] if op.args["check_text_for_call"] else None
                    bad = degeneracy(text, recorded_action=recorded, limits=action_limits(op.args))
                    ok, why = bad is None, f"{bad.rule}: {bad.detail}" if bad else ""
                    label = bad.rule if bad else label
                else:
                    ok, why = op_keep(op.name, text, op.args)
                if ok:
                    kept.append(i)
                else:
                    dropped.append(DroppedPair(index=i, state_id=records[i]["state_id"], op=op.name,
                                               reason=f"{op.name} on {op.text_key}: {why}", kind=label))
            alive = kept
        return alive, dropped

    def _normalize_native(self, records: list[dict[str, Any]]) -> tuple[list[int], dict[str, Any]]:
        alive, dropped = self._apply_native(records)
        ran = [{"op": op.name, "text_key": op.text_key, "backend": "native"} for op in self.ops]
        meta = {"backend": "native", "recipe": str(self.recipe_path), "ops": ran}
        self.last_report = NormalizeReport(
            backend="native", recipe=str(self.recipe_path), n_in=len(records), n_out=len(alive),
            ops=[op.name for op in self.ops], dropped=sorted(dropped, key=lambda d: d.index),
        )
        return alive, meta

    def _normalize_data_juicer(self, records: list[dict[str, Any]]) -> tuple[list[int], dict[str, Any]]:
        try:
            from data_juicer.config import init_configs
            from data_juicer.core import DefaultExecutor
        except ImportError as exc:
            raise RuntimeError(f"backend='data_juicer' could not import data-juicer ({exc}): {_DJ_HINT}") from exc
        alive, pre_dropped = self._apply_native(records)  # replaysim's own operators, natively
        process = [step for step in self.recipe.raw.get("process", []) if next(iter(step)) not in REPLAYSIM_OPS]
        with tempfile.TemporaryDirectory(prefix="replaysim_dj_") as tmp:
            data, out, cfg_path = Path(tmp) / "pairs.jsonl", Path(tmp) / "out" / "result.jsonl", Path(tmp) / "recipe.yaml"
            with data.open("w", encoding="utf-8") as f:
                for i in alive:
                    f.write(json.dumps({**records[i], "_replaysim_index": i}) + "\n")
            cfg = {"np": 1, **self.recipe.raw, "process": process, "dataset_path": str(data), "export_path": str(out)}
            cfg_path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
            DefaultExecutor(init_configs(args=["--config", str(cfg_path)])).run()
            kept_idx = []
            if out.exists():
                for line in out.read_text(encoding="utf-8").splitlines():
                    if line.strip():
                        kept_idx.append(int(json.loads(line)["_replaysim_index"]))
        ops = [name for name, _ in self.recipe.process]
        kept_set = set(kept_idx)
        dropped = pre_dropped + [
            DroppedPair(index=i, state_id=records[i]["state_id"], op="data_juicer",
                        reason="dropped by data-juicer (this backend does not report the operator)")
            for i in alive if i not in kept_set]
        self.last_report = NormalizeReport(backend="data_juicer", recipe=str(self.recipe_path),
                                           n_in=len(records), n_out=len(kept_idx), ops=ops,
                                           dropped=sorted(dropped, key=lambda d: d.index))
        ran = [{"op": name, "backend": "native" if name in REPLAYSIM_OPS else "data_juicer"} for name in ops]
        return sorted(kept_set), {"backend": "data_juicer", "recipe": str(self.recipe_path), "ops": ran}


# ----------------------------------------------------------------------------------------------
# End to end: replay -> pairs -> normalise
# ----------------------------------------------------------------------------------------------
async def replay_and_normalize_trace(
    *,
    states: Any,
    teachers: Any = None,
    agreement_threshold: int = 2,
    max_total_usd: float = 5.0,
    normalizer: DJNormalizer | None = None,
    **replay_kwargs: Any,
) -> tuple[list[TeacherCallResult], list[NormalizedDPOPair]]:
    """Replay ``states`` against the teachers, extract consensus pairs and normalise them.

    ``teachers=None`` uses ``teacher_replay``'s defaults; ``replay_kwargs`` (e.g. ``api_key``) go to
    ``replay_trace``; ``normalizer=None`` builds ``DJNormalizer()`` (the default recipe, native ops).
    With ``student=`` (a ``local:<model>`` slug or a ``LocalTeacher``; needed by the ``recorded`` teacher) and
    optionally ``student_sampling=``, the student's own sampled actions are the rejected side
    (``teacher_replay.recorded``).

    Returns:
        ``(raw_teacher_results, normalized_pairs)``.
    """
    if normalizer is not None and not isinstance(normalizer, DJNormalizer):
        raise TypeError(f"normalizer must be a DJNormalizer or None, got {type(normalizer).__name__}")
    normalizer = normalizer if normalizer is not None else DJNormalizer()
    if teachers is not None:
        replay_kwargs["teachers"] = teachers
    student_kwargs: dict[str, Any] = {}
    if replay_kwargs.get("student") is not None:  # one student model for the replay and the samples
        student, sampling = _student(replay_kwargs)
        replay_kwargs.update(student=student, student_sampling=sampling)
        samples = await asyncio.to_thread(recorded_teacher.sample_student_actions, student, list(states), sampling)
        student_kwargs = {"student_actions": samples, "student_meta": sampling.metadata(0)}
    raw = await teacher_replay.replay_trace(states, max_total_usd=max_total_usd, **replay_kwargs)
    pairs = teacher_replay.extract_dpo_pairs(states, raw, agreement_threshold=agreement_threshold, **student_kwargs)
    normalized = normalizer.normalize(pairs)
    log.info("replaysim: %d teacher results, %d pairs, %d after normalisation", len(raw), len(pairs), len(normalized))
    return raw, normalized


def _student(replay_kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The ``student`` of ``replay_kwargs`` as a ``LocalTeacher`` and its ``StudentSampling`` (default settings)."""
    from composer_replication.teacher_replay.local import LocalTeacher, local_model_name

    student = replay_kwargs["student"]
    if isinstance(student, str):
        student = LocalTeacher(local_model_name(student), device=replay_kwargs.get("local_device", "cpu"))
    return student, replay_kwargs.get("student_sampling") or recorded_teacher.StudentSampling()


def replay_and_normalize_trace_sync(
    *args: Any, **kwargs: Any
) -> tuple[list[TeacherCallResult], list[NormalizedDPOPair]]:
    """``asyncio.run(replay_and_normalize_trace(...))``; inside a running loop, await the async form.

    Raises:
        RuntimeError: called from a thread that already runs an event loop.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(replay_and_normalize_trace(*args, **kwargs))
    raise RuntimeError(
        "replay_and_normalize_trace_sync was called inside a running event loop; "
        "use 'await replay_and_normalize_trace(...)' instead"
    )
