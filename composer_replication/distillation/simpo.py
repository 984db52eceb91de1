"""The spec's import path ``composer_replication.distillation.simpo``: :mod:`composer_replication.losses.simpo`."""
from composer_replication.losses.simpo import *  # noqa: F403
