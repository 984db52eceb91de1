"""Rollouts: environments and rewards, the sandbox, G samples per prompt, and batch assembly.

- :mod:`.environment`: the :class:`Environment` protocol, :class:`Prompt`, :class:`Score`.
- :mod:`.next_action`: next-action prediction on trace states (the embedded default reward).
- :mod:`.python_tasks`: Python tasks scored by unit tests run in :mod:`.sandbox`.
- :mod:`.sampling`: :func:`sample_rollouts` (G samples per prompt, old log-probs).
- :mod:`.assemble`: :func:`assemble_batch` (channel 1 + channel 2 at rollout error sites).
"""

from composer_replication.rollout.assemble import assemble_batch, rollout_stats
from composer_replication.rollout.environment import ERROR_KINDS, Environment, Prompt, Score, score_texts
from composer_replication.rollout.next_action import NextActionEnvironment, RewardWeights
from composer_replication.rollout.python_tasks import (
    PythonTask,
    PythonTaskEnvironment,
    extract_code,
    load_bundled_tasks,
)
from composer_replication.rollout.sampling import RolloutBatch, compute_token_logprobs, sample_rollouts
from composer_replication.rollout.sandbox import SandboxResult, run_python_sandboxed

__all__ = [
    "ERROR_KINDS",
    "Environment",
    "Prompt",
    "Score",
    "score_texts",
    "NextActionEnvironment",
    "RewardWeights",
    "PythonTask",
    "PythonTaskEnvironment",
    "extract_code",
    "load_bundled_tasks",
    "SandboxResult",
    "run_python_sandboxed",
    "RolloutBatch",
    "sample_rollouts",
    "compute_token_logprobs",
    "assemble_batch",
    "rollout_stats",
]
