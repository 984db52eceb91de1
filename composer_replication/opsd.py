"""The spec's import path for the generalized JSD: a re-export of :mod:`composer_replication.losses.jsd`."""

from composer_replication.losses.jsd import generalized_jsd_loss, generalized_jsd_per_token

__all__ = ["generalized_jsd_loss", "generalized_jsd_per_token"]
