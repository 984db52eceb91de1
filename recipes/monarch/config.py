"""The Monarch recipe's configuration tree, its presets, and every check that runs before a process is spawned.

``RecipeConfig`` nests the student's :class:`~composer_replication.engine.StudentConfig` with the recipe's own
sections (``data``, ``teachers``, ``mesh``, ``diloco``, ``run``). :func:`load_config` reads a preset name or a YAML
path, applies ``key.sub=value`` overrides, builds the typed tree (a bad key or type names the dotted key), then
:func:`check_config` checks the files. All of this runs in the controller, before any mesh.

Every number of the tree has an interval (a ``check_ranges`` table in each section's ``__post_init__``; timeouts
at most 7 days). Strings are at most 4096 characters; those that name files, models, teachers, workers or devices
are checked here, SLURM's own strings (``partition``, ``time``, ``extra_args``...) by ``sbatch`` before any spawn
(exit 2); ``mesh.slurm.job_name`` and ``partition`` are otherwise unbounded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from composer_replication.diloco.config import DilocoConfig
from composer_replication.engine import StudentConfig
from composer_replication.engine.config import apply_overrides, from_dict, load_yaml, to_dict, yaml_error_text
from composer_replication.losses.config import check_key, check_ranges, shown

__all__ = ["PRESETS_DIR", "DataConfig", "TeachersConfig", "MeshConfig", "SlurmConfig", "DilocoConfig", "RunConfig",
           "RecipeConfig", "list_presets", "load_config", "check_config", "config_to_yaml", "resume_config"]

PRESETS_DIR = Path(__file__).resolve().parent / "configs"
_WEEK, _BIG = "(0, 604800]", "[0, 1e9]"  # a timeout (seconds), a count


@dataclass(kw_only=True)
class DataConfig:
    """Where the traces and tasks come from, and which sessions are held out for evaluation."""

    sessions: list[str] = field(default_factory=lambda: ["bundled:sessions/train/*.jsonl"])
    """Training trace files or globs (any format ``ingest_any`` reads; ``recipes.monarch.data`` resolves them)."""
    max_states: int = 32
    """Trace states kept for replay and training: a fixed draw spread over all the sessions."""
    max_history_tokens: int | None = None
    """Trim each state's history to this many (approximate) tokens; ``null`` keeps the ingester's default."""
    tasks: str | None = None
    """Tasks JSONL: Python tasks for ``student.rollout.environment`` ``python_tasks``/``mixed``, agentic tasks
    (``rollout.agent`` format) for ``agentic``; ``null`` = the bundled ones (``agentic``: the train split)."""
    eval_tasks: str | None = None
    """``agentic``: held-out tasks JSONL, evaluated only (``null`` = the bundled held-out split; ``""``: none)."""
    max_tasks: int = 0
    """``agentic``: tasks kept for training, a fixed draw spread over them (0: all)."""
    max_eval_tasks: int = 0
    """``agentic``: held-out tasks evaluated, a fixed draw (0: all)."""
    pairs: str | None = None
    """A ``pairs.jsonl`` to train channel 3 on (the replay CLI writes one); ``null`` replays with ``teachers``."""
    eval_sessions: list[str] = field(default_factory=lambda: ["bundled:sessions/heldout/*.jsonl"])
    """Held-out sessions, read like ``sessions``: the evaluation prompts, in no training channel."""
    max_eval_states: int = 24
    """Held-out states evaluated: a fixed draw spread over the held-out sessions (0: all of them)."""
    eval_max_new_tokens: int | None = None
    """Tokens of a greedy evaluation answer; ``null``: ``student.rollout.max_new_tokens``."""
    num_eval_prompts: int = 0
    """With ``eval_sessions: []``: training prompts held out (with their pairs); 0: evaluate on the first ones."""

    def __post_init__(self) -> None:
        check_ranges(self, "data", {"max_states": "[1, 1e9]", "max_history_tokens": "[1, 1e9]", "max_eval_states": _BIG,
                                    "eval_max_new_tokens": "[1, 1048576]", "num_eval_prompts": _BIG,
                                    "max_tasks": _BIG, "max_eval_tasks": _BIG})
        check_key(bool(self.sessions), "data.sessions", "must list at least one trace file or glob")


@dataclass(kw_only=True)
class TeachersConfig:
    """Teacher replay (channel 3 data)."""

    slugs: list[str] = field(default_factory=lambda: ["recorded"])
    """``recorded`` (the session's recorded action, offline, cost 0; one teacher toward ``agreement_threshold``),
    OpenRouter-style ``author/model`` slugs (frontier teachers replay the traces), or ``local:<model>`` (in-process)."""
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
    """Teacher sampling seed (apart from ``student.seed``: runs that differ in it replay identical requests)."""
    timeout_s: float = 120.0
    """Per-request timeout of HTTP teachers."""
    normalize: bool = True
    """Run the replaysim normalizer (the bundled default recipe: drops degenerate teacher output) on the pairs."""
    student_samples: Literal["auto", "always", "never"] = "auto"
    """The rejected side of a pair. ``always``: the student's own action, drawn by each training step from its own
    rollouts at the pair's state (same policy, zero staleness; ``engine.pairs``). ``never``: the session's recorded
    action (frontier teachers replaying the traces). ``auto``: ``always`` when ``recorded`` is listed."""

    def __post_init__(self) -> None:
        check_ranges(self, "teachers", {"input_per_mtok": "[0, 1e6]", "output_per_mtok": "[0, 1e6]",
                                        "max_total_usd": "[0, 1e9]", "agreement_threshold": "[1, 1024]",
                                        "max_tokens": "[1, 1048576]", "temperature": "[0, 100]",
                                        "seed": "[0, 9223372036854775808)", "timeout_s": _WEEK})
        check_key(bool(self.slugs) and all(s.strip() for s in self.slugs), "teachers.slugs",
                  f"must list teachers (e.g. ['recorded']), none empty; got {shown(self.slugs)}")
        check_key(self.base_url is None or self.base_url.startswith(("http://", "https://")), "teachers.base_url",
                  f"must be an http:// or https:// URL or null, got {shown(self.base_url)}")


@dataclass(kw_only=True)
class SlurmConfig:
    """``mesh.launcher: slurm``: one batch job through ``monarch.job.SlurmJob``, a Monarch worker per node."""

    partition: str | None = None
    """Partition to submit to (``null``: the cluster's default)."""
    nodes: int = 0
    """Nodes of the job (0: ``diloco.replicas``); nodes beyond one per replica are spares for ``on_host_loss``."""
    cpus_per_task: int | None = None
    """``--cpus-per-task`` of each node's worker (``null``: the partition's default)."""
    gpus_per_node: int | None = None
    """``--gpus-per-node`` (``null``: none asked); a replica uses its node's first GPU (``student.device: auto``)."""
    time: str | None = "01:00:00"
    """``--time`` limit (``HH:MM:SS``): it also ends the job should the controller be killed."""
    job_name: str = "diloco"
    """Job name (SlurmJob appends the controller's pid)."""
    extra_args: list[str] = field(default_factory=list)
    """More ``sbatch`` options, e.g. ``["--account=a", "--qos=high", "--no-kill"]``."""
    attach: bool = False
    """Use the allocation this controller runs in (inside ``salloc`` or an ``sbatch`` script) instead of submitting."""
    pending_timeout_s: float = 600.0
    """Give up (and cancel) when the job has not started, or its workers do not listen, within this many seconds."""
    port: int = 26600
    """Node ``k``'s worker listens at ``<NodeAddr>:port+k``; restarted workers take the ports above."""

    def __post_init__(self) -> None:
        check_ranges(self, "mesh.slurm", {"nodes": "[0, 4096]", "cpus_per_task": "[1, 4096]", "gpus_per_node": "[0, 64]",
                                          "pending_timeout_s": _WEEK, "port": "[1, 65535]"})


@dataclass(kw_only=True)
class MeshConfig:
    """Process meshes, timeouts and supervision."""

    launcher: Literal["local", "workers", "slurm", "kubernetes"] = "local"
    """Where the hosts come from: ``local`` (this host), ``workers`` (the Monarch workers in ``workers``; listing
    workers implies it), ``slurm`` (a SLURM job, ``mesh.slurm``; one DiLoCo replica per node). ``kubernetes`` is
    not wired (untested here): start workers with ``KubernetesJob`` and use ``workers`` (docs/diloco.md)."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """The SLURM job of ``launcher: slurm``."""
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

    def __post_init__(self) -> None:
        check_ranges(self, "mesh", {"num_replicas": "[1, 1024]", "setup_timeout_s": _WEEK, "replay_timeout_s": _WEEK,
                                    "call_timeout_s": _WEEK, "threads_per_proc": "[0, 4096]",
                                    "teacher_worker": "[0, 4096]", "reducer_worker": "[0, 4096]"})
        if self.launcher == "local" and self.workers:
            self.launcher = "workers"
        if self.launcher == "kubernetes":
            raise ValueError("'mesh.launcher' kubernetes is not wired (untested here): start the workers with "
                             "monarch.job.kubernetes.KubernetesJob and set mesh.launcher=workers mesh.workers=[...] "
                             "(docs/diloco.md)")
        if self.launcher == "slurm" and (self.workers or self.spare_workers):
            raise ValueError("'mesh.workers' / 'mesh.spare_workers' come from the SLURM job with mesh.launcher=slurm; "
                             "leave them empty (spares: mesh.slurm.nodes above diloco.replicas)")


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

    def __post_init__(self) -> None:
        check_key(bool(self.dir.strip()), "run.dir", "must name a folder (e.g. runs/monarch-{time}), got an empty string")
        check_ranges(self, "run", {"checkpoint_every": _BIG, "keep_last": "[1, 1e9]", "eval_every": _BIG})


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
        t, m, r = self.teachers, self.mesh, self.student.rollout
        check_key(t.agreement_threshold <= len(t.slugs), "teachers.agreement_threshold",
                  f"({t.agreement_threshold}) cannot exceed the number of teachers in 'teachers.slugs' "
                  f"({len(t.slugs)}); lower it or add teachers")
        check_key("recorded" not in t.slugs or t.student_samples != "never", "teachers.slugs",
                  "lists 'recorded' but 'teachers.student_samples' is 'never': the rejected side would be the recorded "
                  "action itself; set teachers.student_samples=auto")
        if m.inject_fault:
            from meshes.supervision import FaultSpec

            check_key(len(m.inject_fault) <= 200, "mesh.inject_fault",
                      f"must look like 'ACTOR:RANK:STEP:MODE', got {shown(m.inject_fault)}")
            FaultSpec(m.inject_fault)
        self._check_diloco()
        check_key(r.max_new_tokens < self.student.max_seq_len, "student.rollout.max_new_tokens",
                  f"({r.max_new_tokens}) must be < 'student.max_seq_len' ({self.student.max_seq_len}): prompt and "
                  "response must fit in one sequence")

    def _check_diloco(self) -> None:
        """DiLoCo's cross-section rules (replicas, rounds against steps and checkpoints, workers)."""
        d, m = self.diloco, self.mesh
        for address in [*m.workers, *m.spare_workers]:
            check_key(address.startswith("tcp://") and address.rpartition(":")[2].isdigit(),
                      "mesh.workers' / 'mesh.spare_workers", f"entry {shown(address)} must look like tcp://HOST:PORT")
        check_key(len(set(m.workers + m.spare_workers)) == len(m.workers) + len(m.spare_workers),
                  "mesh.workers' and 'mesh.spare_workers", "must list each address once")
        for key in ("teacher_worker", "reducer_worker"):
            check_key(not m.workers or 0 <= getattr(m, key) < len(m.workers), f"mesh.{key}",
                      f"must index 'mesh.workers' (0..{len(m.workers) - 1}), got {getattr(m, key)}")
        if not d.enabled:
            check_key(m.num_replicas == 1, "mesh.num_replicas",
                      f"is {m.num_replicas}: replicas that do not sync train {m.num_replicas} separate models; set "
                      f"'diloco.replicas: {m.num_replicas}' instead (replicas that train one model, docs/diloco.md)")
            check_key(not m.workers and m.launcher != "slurm", "mesh.launcher",
                      f"{m.launcher} needs 'diloco.replicas' >= 2 (replicas are what runs on the hosts)")
            return
        check_key(m.num_replicas == 1, "mesh.num_replicas", f"is {m.num_replicas} and 'diloco.replicas' is "
                  f"{d.replicas}: set only diloco.replicas (replicas that train one model)")
        check_key(m.launcher != "slurm" or not 0 < m.slurm.nodes < d.replicas, "mesh.slurm.nodes",
                  f"({m.slurm.nodes}) is below 'diloco.replicas' ({d.replicas}): one replica per node; ask for "
                  "more nodes (or 0: one per replica)")
        check_key(self.student.num_steps % d.sync_every == 0, "student.num_steps", f"({self.student.num_steps}) must be "
                  f"a multiple of 'diloco.sync_every' ({d.sync_every}): the run ends on a sync, with one model")
        check_key(self.run.checkpoint_every % d.sync_every == 0, "run.checkpoint_every",
                  f"({self.run.checkpoint_every}) must be a multiple of 'diloco.sync_every' ({d.sync_every}) (or 0): "
                  "checkpoints are taken right after a sync")
        check_key(d.pg_timeout_s < m.call_timeout_s, "diloco.pg_timeout_s", f"({d.pg_timeout_s}) must be below "
                  f"'mesh.call_timeout_s' ({m.call_timeout_s}): a step waiting on a dead peer must end before its call "
                  "times out")

    def rejected_from_rollout(self) -> bool:
        """Whether the pairs' rejected side is drawn from the training step's rollouts (``teachers.student_samples``)
        rather than the recorded action."""
        t = self.teachers
        return t.student_samples == "always" or (t.student_samples == "auto" and "recorded" in t.slugs)

    def teacher_specs(self) -> list[dict[str, Any]]:
        """The ``TeacherSpec`` list of ``teachers.slugs`` (local and recorded teachers cost 0)."""
        t, out = self.teachers, []
        for slug in t.slugs:
            paid = not slug.startswith("local:") and slug != "recorded"
            out.append({"slug": slug, "input_per_mtok": t.input_per_mtok if paid else 0.0,
                        "output_per_mtok": t.output_per_mtok if paid else 0.0, "max_tokens": t.max_tokens,
                        "temperature": t.temperature, **({"base_url": t.base_url} if paid and t.base_url else {})})
        return out


def list_presets() -> list[str]:
    """Names of the bundled presets (``recipes/monarch/configs/*.yaml``)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def _load_yaml_file(path: Path, what: str) -> dict[str, Any]:
    """The mapping a YAML config file holds (``load_yaml``: plain YAML only; ``ValueError`` naming the file and the
    line for an unreadable file, bad YAML, a tag that builds a Python object, an anchor or alias, or no mapping)."""
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"{what} {path} is not valid YAML: {yaml_error_text(exc)}; fix the file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} {path} cannot be read as UTF-8 text ({exc})") from None
    if not isinstance(data, dict | None):
        raise ValueError(f"{what} {path} must hold a mapping of config sections, got {type(data).__name__}")
    return data or {}


def load_config(preset_or_path: str = "single_node", overrides: list[str] | None = None) -> RecipeConfig:
    """A preset or YAML file with ``key.sub=value`` overrides, as the checked typed tree (``run.dir``'s ``{time}``
    filled in). ``ValueError`` for an unknown preset, key or type, an impossible size, a missing file (names the key).
    """
    path = Path(preset_or_path).expanduser()
    if not (path.suffix in (".yaml", ".yml") or path.exists()):
        path = PRESETS_DIR / f"{preset_or_path}.yaml"
    if not path.is_file():
        raise ValueError(f"--config {shown(preset_or_path)} is neither a preset nor a YAML file; presets: "
                         f"{', '.join(list_presets())}")
    data = apply_overrides(_load_yaml_file(path, "--config"), list(overrides or []))
    config = from_dict(RecipeConfig, data)
    config.run.dir = config.run.dir.replace("{time}", time.strftime("%Y%m%d-%H%M%S"))
    check_config(config)
    return config


def check_config(config: RecipeConfig) -> None:
    """Checks that need the file system (trace, tasks and pairs files, model folders) or CUDA; ``ValueError`` naming
    the key and what is allowed."""
    from recipes.monarch.data import eval_session_files, resolve_path, session_files

    d = config.data
    session_files(config)
    eval_session_files(config)
    if d.pairs is not None:
        from composer_replication.teacher_replay import load_pairs

        check_key(_is(d.pairs, "file", repo=True), "data.pairs",
                  f"file {shown(d.pairs)} does not exist; give a pairs.jsonl or null")
        try:
            load_pairs(resolve_path(d.pairs))
        except ValueError as exc:
            raise ValueError(f"'data.pairs': {exc}") from None
    check_key(d.tasks is None or _is(d.tasks, "file", repo=True), "data.tasks",
              f"file {shown(d.tasks)} does not exist; give a tasks JSONL or null")
    model = config.student.model
    check_key(model in ("tiny", "smollm2-135m") or _is(model, "dir"), "student.model",
              f"must be 'tiny', 'smollm2-135m' or a model folder, got {shown(model)}")
    for slug in config.teachers.slugs:
        name = slug[len("local:"):].strip() if slug.startswith("local:") else None
        check_key(not name or name in ("tiny", "smollm2-135m") or _is(name, "dir"), "teachers.slugs",
                  f"entry {shown(slug)}: local teachers are 'local:tiny', 'local:smollm2-135m' or 'local:<model folder>'")
    if config.student.device.startswith("cuda"):
        import torch

        check_key(torch.cuda.is_available(), "student.device",
                  f"is {config.student.device!r} but CUDA is not available; use 'auto'")


def _is(path: str | Path, kind: str, *, repo: bool = False) -> bool:
    """Whether ``path`` (``repo``: also from the repository root) is a file (``kind="file"``) or a folder; ``False``
    for a name the OS cannot even look up (too long, a NUL byte)."""
    from recipes.monarch.data import resolve_path

    try:
        p = resolve_path(str(path)) if repo else Path(path).expanduser()
        return p.is_file() if kind == "file" else p.is_dir()
    except (OSError, ValueError):
        return False


def config_to_yaml(config: RecipeConfig) -> str:
    """The resolved config as YAML text (what ``config.yaml`` holds)."""
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def resume_config(run_dir: str, overrides: list[str] | None = None) -> RecipeConfig:
    """An earlier run's ``config.yaml`` with ``overrides`` (``run.dir`` stays the run; the retired key
    ``student.rollout.pair_refresh_every`` is dropped). ``ValueError``: no ``config.yaml`` there, or a bad override."""
    if not str(run_dir).strip():
        raise ValueError("--resume needs the folder of an earlier run, got an empty string")
    path = Path(run_dir) / "config.yaml"
    if not _is(path, "file"):
        raise ValueError(f"--resume {shown(run_dir)}: no config.yaml there; give the folder of an earlier run")
    data = apply_overrides(_load_yaml_file(path, f"--resume {shown(run_dir)}:"), list(overrides or []))
    ((data.get("student") or {}).get("rollout") or {}).pop("pair_refresh_every", None)
    data.setdefault("run", {})["dir"] = str(run_dir)
    config = from_dict(RecipeConfig, data)
    check_config(config)
    return config
