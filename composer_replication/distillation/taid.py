"""Import path ``composer_replication.distillation.taid``: a re-export of :mod:`composer_replication.losses.taid`."""

from composer_replication.losses.taid import TAIDScheduler, taid_loss, taid_per_token

__all__ = ["taid_loss", "taid_per_token", "TAIDScheduler"]
