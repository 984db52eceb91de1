"""Rollouts: environments and rewards, generation, G samples per prompt, and batch assembly.

:mod:`.environment` (the protocol), :mod:`.next_action` (the default reward), :mod:`.python_tasks` (unit tests
in :mod:`.sandbox`), :mod:`.generate` (the one generation loop), :mod:`.sampling` (:func:`sample_rollouts`),
:mod:`.assemble` (:func:`assemble_batch`: channel 1, and channel 2 at error sites).
"""

from composer_replication.rollout.assemble import assemble_batch, rollout_stats
from composer_replication.rollout.environment import Environment, Prompt, Score, score_texts
from composer_replication.rollout.next_action import NextActionEnvironment
from composer_replication.rollout.python_tasks import PythonTask, PythonTaskEnvironment, load_bundled_tasks
from composer_replication.rollout.sampling import RolloutBatch, sample_rollouts
from composer_replication.rollout.sandbox import run_python_sandboxed

__all__ = ["Environment", "Prompt", "Score", "score_texts", "NextActionEnvironment", "PythonTask",
           "PythonTaskEnvironment", "load_bundled_tasks", "run_python_sandboxed", "RolloutBatch",
           "sample_rollouts", "assemble_batch", "rollout_stats"]
