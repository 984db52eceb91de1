"""The spec's import path ``composer_replication.opsd`` (``generalized_jsd_loss``): :mod:`.losses.jsd`."""
from composer_replication.losses.jsd import *  # noqa: F403
