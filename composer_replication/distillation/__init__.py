"""The spec's import path ``composer_replication.distillation`` (SimPO, TAID, entropy-aware OPD): :mod:`..losses`."""
from composer_replication.losses.entropy_aware_opd import *  # noqa: F403
from composer_replication.losses.simpo import *  # noqa: F403
from composer_replication.losses.taid import *  # noqa: F403
