"""The spec's import path ``composer_replication.distillation.taid``: :mod:`composer_replication.losses.taid`."""
from composer_replication.losses.taid import *  # noqa: F403
