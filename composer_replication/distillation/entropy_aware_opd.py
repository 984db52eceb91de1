"""The spec's import path ``composer_replication.distillation.entropy_aware_opd``: :mod:`..losses.entropy_aware_opd`."""
from composer_replication.losses.entropy_aware_opd import *  # noqa: F403
