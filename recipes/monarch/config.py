"""The Monarch recipe's configuration tree, its presets, and every check that runs before a process is spawned.

``RecipeConfig`` nests the student's :class:`~composer_replication.engine.StudentConfig` with the
recipe's own sections (``data``, ``teachers``, ``mesh``, ``diloco``, ``run``). :func:`load_config` reads a preset
name (``single_node``, ``tiny``, ``gpu_single_node``...) or a YAML path, applies ``key.sub=value``
overrides, builds the typed tree (unknown keys and wrong types name the dotted key), then
:func:`check_config` checks files and sizes. All of this happens in the controller, before any mesh.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from composer_replication.diloco.config import DilocoConfig
from composer_replication.engine import StudentConfig, apply_overrides, from_dict, to_dict
from composer_replication.engine.config import yaml_error_text
from composer_replication.losses.config import check_key
from recipes.monarch.run_folder import check_fresh_run_dir, open_run_dir

__all__ = [
    "PRESETS_DIR",
    "DataConfig",
    "TeachersConfig",
    "MeshConfig",
    "DilocoConfig",
    "RunConfig",
    "RecipeConfig",
    "list_presets",
    "load_config",
    "check_config",
    "config_to_yaml",
    "resume_config",
    "check_fresh_run_dir",
    "open_run_dir",
]

PRESETS_DIR = Path(__file__).resolve().parent / "configs"


@dataclass(kw_only=True)
class DataConfig:
    """Where the traces and tasks come from, and which sessions are held out for evaluation."""

    sessions: list[str] = field(default_factory=lambda: ["bundled:sessions/train/*.jsonl"])
    """Training trace files or glob patterns (any format ``ingest_any`` reads); relative paths are tried from the
    current folder, then from the repository root; ``bundled:<glob>`` names the bundled data (synthetic
    Claude Code sessions: ``sessions/train/`` and ``sessions/heldout/``)."""
    max_states: int = 32
    """Trace states kept for replay and training: a fixed draw spread over all the sessions."""
    max_history_tokens: int | None = None
    """Trim each state's history to this many (approximate) tokens; ``null`` keeps the ingester's default."""
    tasks: str | None = None
    """Python tasks JSONL for ``student.rollout.environment`` ``python_tasks``/``mixed``; ``null`` = bundled."""
    pairs: str | None = None
    """A ``pairs.jsonl`` to train channel 3 on (e.g. written by ``python -m composer_replication.teacher_replay``
    with or without ``--normalize``); ``null`` replays the states with ``teachers`` instead."""
    eval_sessions: list[str] = field(default_factory=lambda: ["bundled:sessions/heldout/*.jsonl"])
    """Held-out session files or globs (read like ``sessions``; none may also be a training file). Their states
    are the evaluation prompts, scored against the recorded actions, and enter no training channel (no replay,
    no pairs, no rollouts). ``[]``: evaluate on training prompts (see ``num_eval_prompts``)."""
    max_eval_states: int = 24
    """Held-out states evaluated: a fixed draw spread over the held-out sessions (0: all of them)."""
    eval_max_new_tokens: int | None = None
    """Tokens of a greedy evaluation answer; ``null``: ``student.rollout.max_new_tokens``."""
    num_eval_prompts: int = 0
    """Only with ``eval_sessions: []``: training prompts held out for the evaluation (they and their pairs are
    not trained on). 0 evaluates on the first training prompts."""

    def __post_init__(self) -> None:
        if self.num_eval_prompts and self.eval_sessions:
            raise ValueError(
                f"'data.num_eval_prompts' ({self.num_eval_prompts}) holds out training prompts, but "
                "'data.eval_sessions' already holds out whole sessions; set data.eval_sessions=[] or "
                "data.num_eval_prompts=0"
            )
        if self.max_eval_states < 0:
            raise ValueError(f"'data.max_eval_states' must be >= 0 (0: all held-out states), got {self.max_eval_states}")
        if self.eval_max_new_tokens is not None and self.eval_max_new_tokens < 1:
            raise ValueError(f"'data.eval_max_new_tokens' must be >= 1 or null, got {self.eval_max_new_tokens}")


@dataclass(kw_only=True)
class TeachersConfig:
    """Teacher replay (channel 3 data)."""

    slugs: list[str] = field(default_factory=lambda: ["recorded"])
    """Teachers: ``recorded`` (the session's recorded action: distil the agent that recorded the traces, offline,
    cost 0), OpenRouter-style ``author/model`` slugs (frontier teachers replay the traces), or ``local:<model>``
    (an in-process model, offline, cost 0). ``recorded`` counts as one teacher toward ``agreement_threshold``."""
    base_url: str | None = None
    """OpenAI-compatible endpoint for every non-local teacher (``null``: OpenRouter; key from ``$OPENROUTER_API_KEY``)."""
    input_per_mtok: float = 0.0
    """USD per million prompt tokens of non-local teachers (budget worst case)."""
    output_per_mtok: float = 0.0
    """USD per million completion tokens of non-local teachers."""
    max_total_usd: float = 0.0
    """Hard spend cap of the replay (0 is fine for local teachers)."""
    agreement_threshold: int = 1
    """Teachers that must agree against the student for a pair (use >= 2 with several frontier teachers)."""
    max_tokens: int = 48
    """Completion cap per teacher call."""
    temperature: float = 0.0
    """Teacher sampling temperature (0: greedy, reproducible)."""
    seed: int = 0
    """Teacher sampling seed (kept apart from ``student.seed``, so runs that differ only in the student's
    seed replay identical requests and can share a ledger)."""
    timeout_s: float = 120.0
    """Per-request timeout of HTTP teachers."""
    normalize: bool = True
    """Run the replaysim normalizer (the bundled default recipe: drops degenerate teacher output) on the pairs."""
    student_samples: Literal["auto", "always", "never"] = "auto"
    """The rejected side of a pair. ``always``: the student's own action at the state, sampled from ``student.model``
    with the student's rollout settings (``student.rollout.max_new_tokens`` / ``temperature`` / ``top_p``, seed
    ``teachers.seed``); on-policy, and re-sampled during training every ``student.rollout.pair_refresh_every``
    steps. ``never``: the session's recorded action (frontier teachers replaying the student's recorded traces).
    ``auto``: ``always`` when ``recorded`` is listed, else ``never``."""


@dataclass(kw_only=True)
class MeshConfig:
    """Process meshes, timeouts and supervision."""

    num_replicas: int = 1
    """Trainer processes without DiLoCo: 1 (more would train separate models and is refused; use
    ``diloco.replicas`` for replicas that train one model)."""
    setup_timeout_s: float = 600.0
    """Timeout of every ``setup`` call (model loading)."""
    replay_timeout_s: float = 1800.0
    """Timeout of the whole teacher replay."""
    call_timeout_s: float = 600.0
    """Timeout of every other call (one train step, a checkpoint, the evaluation)."""
    threads_per_proc: int = 0
    """``torch.set_num_threads`` in each actor process (0: torch's default)."""
    inject_fault: str | None = None
    """Testing aid: ``ACTOR:RANK:STEP:MODE`` (e.g. ``trainer:0:1:exit``) makes that actor raise or exit."""
    workers: list[str] = field(default_factory=list)
    """Monarch workers to run on (``python -m recipes.monarch.worker --address tcp://HOST:PORT`` on each host);
    empty = this host. DiLoCo replica ``i`` runs on ``workers[i % len(workers)]``."""
    spare_workers: list[str] = field(default_factory=list)
    """Workers held back for ``diloco.on_host_loss: replace`` (each at an address not used before in the run)."""
    teacher_worker: int = 0
    """Index into ``workers`` of the teacher's host."""
    reducer_worker: int = 0
    """Index into ``workers`` of the reducer's host."""


@dataclass(kw_only=True)
class RunConfig:
    """The run folder, checkpoints and display."""

    dir: str = "runs/monarch-{time}"
    """Run folder; ``{time}`` becomes the start time (``20261130-171500``)."""
    checkpoint_every: int = 10
    """Save every N steps (and always after the last step); 0 saves only at the end."""
    keep_last: int | None = 3
    """Keep only the newest N checkpoints; ``null`` keeps all."""
    evaluate: bool = True
    """Greedy evaluation on the held-out sessions at the start and at the end (``eval_start`` / ``eval_end``)."""
    eval_every: int = 0
    """Also evaluate every N steps (``eval/*`` rows: the learning curve); 0: only at the start and the end."""
    display: Literal["rich", "plain", "none"] = "rich"
    """Progress display: ``rich`` (live bar + table), ``plain`` (a line per step) or ``none``."""


@dataclass(kw_only=True)
class RecipeConfig:
    """Everything ``python -m recipes.monarch.run`` needs (``config.yaml`` of a run holds this tree)."""

    student: StudentConfig = field(default_factory=StudentConfig)
    """The student trainer (model, device, steps, optimizer, loss, rollouts)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Traces and tasks."""
    teachers: TeachersConfig = field(default_factory=TeachersConfig)
    """Teacher replay."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """Meshes and timeouts."""
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    """DiLoCo across replicas that train one model (``replicas: 1`` = plain training)."""
    run: RunConfig = field(default_factory=RunConfig)
    """Run folder and display."""

    def __post_init__(self) -> None:
        if not self.run.dir.strip():
            raise ValueError("'run.dir' must name a folder (e.g. runs/monarch-{time}), got an empty string")
        for key, value in (("data.max_states", self.data.max_states), ("mesh.num_replicas", self.mesh.num_replicas),
                           ("teachers.agreement_threshold", self.teachers.agreement_threshold),
                           ("teachers.max_tokens", self.teachers.max_tokens)):
            check_key(value >= 1, key, f"must be >= 1, got {value!r}")
        for key in ("setup_timeout_s", "replay_timeout_s", "call_timeout_s"):
            if getattr(self.mesh, key) <= 0:
                raise ValueError(f"'mesh.{key}' must be > 0 seconds, got {getattr(self.mesh, key)!r}")
        if self.teachers.agreement_threshold > len(self.teachers.slugs):
            raise ValueError(
                f"'teachers.agreement_threshold' ({self.teachers.agreement_threshold}) cannot exceed the number of "
                f"teachers in 'teachers.slugs' ({len(self.teachers.slugs)}); lower it or add teachers"
            )
        if not self.teachers.slugs:
            raise ValueError("'teachers.slugs' must list at least one teacher (e.g. ['recorded'])")
        if "recorded" in self.teachers.slugs and self.teachers.student_samples == "never":
            raise ValueError("'teachers.slugs' lists 'recorded' but 'teachers.student_samples' is 'never': the rejected "
                             "side would be the recorded action itself; set teachers.student_samples=auto")
        if self.teachers.max_total_usd < 0 or self.teachers.temperature < 0:
            raise ValueError("'teachers.max_total_usd' and 'teachers.temperature' must be >= 0")
        if self.run.checkpoint_every < 0:
            raise ValueError(f"'run.checkpoint_every' must be >= 0, got {self.run.checkpoint_every}")
        if self.run.keep_last is not None and self.run.keep_last < 1:
            raise ValueError(f"'run.keep_last' must be >= 1 or null, got {self.run.keep_last}")
        if self.mesh.inject_fault:
            from meshes.trainer import FaultSpec

            FaultSpec(self.mesh.inject_fault)
        self._check_diloco()
        r = self.student.rollout
        if r.max_new_tokens >= self.student.max_seq_len:
            raise ValueError(
                f"'student.rollout.max_new_tokens' ({r.max_new_tokens}) must be < 'student.max_seq_len' "
                f"({self.student.max_seq_len}): prompt and response must fit in one sequence"
            )

    def _check_diloco(self) -> None:
        """DiLoCo's cross-section rules (replicas, rounds against steps and checkpoints, workers)."""
        d, m = self.diloco, self.mesh
        for address in [*m.workers, *m.spare_workers]:
            host_port = address.removeprefix("tcp://")
            if not address.startswith("tcp://") or not host_port.rpartition(":")[2].isdigit():
                raise ValueError(f"'mesh.workers' / 'mesh.spare_workers' entry {address!r} must look like "
                                 "tcp://HOST:PORT")
        if len(set(m.workers + m.spare_workers)) != len(m.workers) + len(m.spare_workers):
            raise ValueError("'mesh.workers' and 'mesh.spare_workers' must list each address once")
        for key in ("teacher_worker", "reducer_worker"):
            if m.workers and not 0 <= getattr(m, key) < len(m.workers):
                raise ValueError(f"'mesh.{key}' must index 'mesh.workers' (0..{len(m.workers) - 1}), "
                                 f"got {getattr(m, key)}")
        if not d.enabled:
            if m.num_replicas > 1:
                raise ValueError(f"'mesh.num_replicas' is {m.num_replicas}: replicas that do not sync train "
                                 f"{m.num_replicas} separate models; set 'diloco.replicas: {m.num_replicas}' "
                                 "instead (replicas that train one model, docs/diloco.md)")
            if m.workers:
                raise ValueError("'mesh.workers' needs 'diloco.replicas' >= 2 (replicas are what runs on the workers)")
            return
        if m.num_replicas != 1:
            raise ValueError(f"'mesh.num_replicas' is {m.num_replicas} and 'diloco.replicas' is {d.replicas}: "
                             "set only diloco.replicas (replicas that train one model)")
        if self.student.num_steps % d.sync_every:
            raise ValueError(f"'student.num_steps' ({self.student.num_steps}) must be a multiple of "
                             f"'diloco.sync_every' ({d.sync_every}): the run ends on a sync, with one model")
        if self.run.checkpoint_every % d.sync_every:
            raise ValueError(f"'run.checkpoint_every' ({self.run.checkpoint_every}) must be a multiple of "
                             f"'diloco.sync_every' ({d.sync_every}) (or 0): checkpoints are taken right after a sync")
        if d.pg_timeout_s >= self.mesh.call_timeout_s:
            raise ValueError(f"'diloco.pg_timeout_s' ({d.pg_timeout_s}) must be below 'mesh.call_timeout_s' "
                             f"({self.mesh.call_timeout_s}): a step waiting on a dead peer must end before its call "
                             "times out")

    def student_samples(self) -> dict[str, Any] | None:
        """What the teacher actor needs to sample the student's own actions (``teachers.student_samples``), or
        ``None`` when the rejected side is the recorded action."""
        t, r = self.teachers, self.student.rollout
        if t.student_samples == "never" or (t.student_samples == "auto" and "recorded" not in t.slugs):
            return None
        return {"model": self.student.model, "model_seed": self.student.seed, "max_new_tokens": r.max_new_tokens,
                "temperature": r.temperature, "top_p": r.top_p, "seed": t.seed}

    def teacher_specs(self) -> list[dict[str, Any]]:
        """The ``TeacherSpec`` list of ``teachers.slugs`` (local and recorded teachers cost 0)."""
        t, out = self.teachers, []
        for slug in t.slugs:
            spec: dict[str, Any] = {"slug": slug, "input_per_mtok": 0.0, "output_per_mtok": 0.0,
                                    "max_tokens": t.max_tokens, "temperature": t.temperature}
            if not slug.startswith("local:") and slug != "recorded":
                spec.update(input_per_mtok=t.input_per_mtok, output_per_mtok=t.output_per_mtok)
                if t.base_url:
                    spec["base_url"] = t.base_url
            out.append(spec)
        return out


def list_presets() -> list[str]:
    """Names of the bundled presets (``recipes/monarch/configs/*.yaml``)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def _read_yaml(preset_or_path: str) -> dict[str, Any]:
    path = Path(preset_or_path).expanduser()
    if not (path.suffix in (".yaml", ".yml") or path.exists()):
        path = PRESETS_DIR / f"{preset_or_path}.yaml"
    if not path.is_file():
        raise ValueError(
            f"--config {preset_or_path!r} is neither a preset nor a YAML file; presets: {', '.join(list_presets())}"
        )
    return _load_yaml_file(path, "--config")


def _load_yaml_file(path: Path, what: str) -> dict[str, Any]:
    """The mapping a YAML config file holds, read with ``yaml.safe_load`` (plain YAML only).

    Raises:
        ValueError: the file cannot be read, is not valid YAML, uses a tag that would build a Python object
            (``!!python/object``...), or does not hold a mapping; names the file and the line.
    """
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"{what} {path} is not valid YAML: {yaml_error_text(exc)}; fix the file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} {path} cannot be read as UTF-8 text ({exc})") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path} must hold a mapping of config sections, got {type(data).__name__}")
    return data


def load_config(preset_or_path: str = "single_node", overrides: list[str] | None = None) -> RecipeConfig:
    """Read a preset or YAML file, apply ``key.sub=value`` overrides, build and check the typed tree.

    ``run.dir``'s ``{time}`` is filled in here, so the returned config is fully resolved.

    Raises:
        ValueError: unknown preset, unknown key, wrong type, impossible size, or a missing file (names the key).
    """
    data = apply_overrides(_read_yaml(preset_or_path), list(overrides or []))
    config = from_dict(RecipeConfig, data)
    config.run.dir = config.run.dir.replace("{time}", time.strftime("%Y%m%d-%H%M%S"))
    check_config(config)
    return config


def check_config(config: RecipeConfig) -> None:
    """Checks that need the file system: trace files, tasks file, local model folders.

    Raises:
        ValueError: naming the key and what is allowed.
    """
    if not config.data.sessions:
        raise ValueError("'data.sessions' must list at least one trace file or glob")
    from recipes.monarch.data import eval_session_files, resolve_path, session_files

    session_files(config)
    eval_session_files(config)
    if config.data.pairs is not None:
        from composer_replication.teacher_replay import load_pairs

        path = resolve_path(config.data.pairs)
        if not path.is_file():
            raise ValueError(f"'data.pairs' file {config.data.pairs!r} does not exist; give a pairs.jsonl or null")
        try:
            load_pairs(path)
        except ValueError as exc:
            raise ValueError(f"'data.pairs': {exc}") from None
    if config.data.tasks is not None and not resolve_path(config.data.tasks).is_file():
        raise ValueError(f"'data.tasks' file {config.data.tasks!r} does not exist; give a tasks JSONL or null")
    model = config.student.model
    if model not in ("tiny", "smollm2-135m") and not Path(model).expanduser().is_dir():
        raise ValueError(f"'student.model' must be 'tiny', 'smollm2-135m' or a model folder, got {model!r}")
    for slug in config.teachers.slugs:
        name = slug[len("local:"):].strip() if slug.startswith("local:") else None
        if name and name not in ("tiny", "smollm2-135m") and not Path(name).expanduser().is_dir():
            raise ValueError(
                f"'teachers.slugs' entry {slug!r}: local teachers are 'local:tiny', 'local:smollm2-135m' or "
                "'local:<model folder>'"
            )
    if config.student.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"'student.device' is {config.student.device!r} but CUDA is not available; use 'auto'")


def config_to_yaml(config: RecipeConfig) -> str:
    """The resolved config as YAML text (what ``config.yaml`` holds)."""
    return yaml.safe_dump(to_dict(config), sort_keys=False)


# ---------------------------------------------------------------------------- controller-side data


def resume_config(run_dir: str, overrides: list[str] | None = None) -> RecipeConfig:
    """The config of an existing run (its ``config.yaml``) with ``overrides`` applied; ``run.dir`` stays the run.

    Raises:
        ValueError: the folder has no ``config.yaml``, or a bad override.
    """
    if not str(run_dir).strip():
        raise ValueError("--resume needs the folder of an earlier run, got an empty string")
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ValueError(f"--resume {run_dir!r}: no config.yaml there; give the folder of an earlier run")
    data = apply_overrides(_load_yaml_file(path, f"--resume {run_dir!r}:"), list(overrides or []))
    data.setdefault("run", {})["dir"] = str(run_dir)
    config = from_dict(RecipeConfig, data)
    check_config(config)
    return config
