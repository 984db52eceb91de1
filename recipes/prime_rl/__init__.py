"""PRIME-RL integration: a custom loss for PRIME-RL's ``CustomLossConfig`` (``recipes.prime_rl.composer_loss``).

Importing it does not need PRIME-RL; see ``docs/integrations.md``.
"""

from recipes.prime_rl.composer_loss import (
    PRIME_RL_AVAILABLE,
    ComposerLossInputs,
    DPPOMaskWarning,
    LossInputs,
    LossOutputs,
    composer_loss,
)

__all__ = [
    "PRIME_RL_AVAILABLE",
    "ComposerLossInputs",
    "DPPOMaskWarning",
    "LossInputs",
    "LossOutputs",
    "composer_loss",
]
