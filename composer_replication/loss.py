"""The spec's import path ``composer_replication.loss`` (``compose_loss``, ``LossComponents``): :mod:`.losses`."""
from composer_replication.losses import *  # noqa: F403
