"""Import path of the chunked log-prob kernels: a re-export of :mod:`composer_replication.losses.logprobs`."""

from composer_replication.losses.logprobs import (
    DEFAULT_CHUNK_SIZE,
    chunked_cross_entropy,
    chunked_distillation,
    chunked_distillation_loss,
    chunked_row_logprobs,
    chunked_token_logprobs,
    decoder_of,
    hidden_states,
    output_head,
    predicted_positions,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "hidden_states",
    "decoder_of",
    "output_head",
    "predicted_positions",
    "chunked_token_logprobs",
    "chunked_row_logprobs",
    "chunked_cross_entropy",
    "chunked_distillation",
    "chunked_distillation_loss",
]
