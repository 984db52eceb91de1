"""PRIME-RL integration: a custom loss for PRIME-RL's ``CustomLossConfig`` (:mod:`recipes.prime_rl.composer_loss`,
which imports without PRIME-RL; see ``docs/integrations.md``)."""
