"""Model weights for weight sync and DiLoCo: CPU copies that keep tied tensors shared, and loading them back."""

from __future__ import annotations

import torch

__all__ = ["cpu_weights", "load_weights"]


def cpu_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's ``state_dict`` (parameters and buffers) cloned to CPU.

    Tied tensors (e.g. ``lm_head.weight`` and ``embed_tokens.weight``) stay one shared CPU tensor under both
    names, so they are copied and pickled once.
    """
    out: dict[str, torch.Tensor] = {}
    clones: dict[tuple[int, int], torch.Tensor] = {}
    for k, v in model.state_dict().items():
        key = (v.data_ptr(), v.numel())
        if key not in clones:
            clones[key] = v.detach().to("cpu", copy=True)
        out[k] = clones[key]
    return out


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy ``weights`` (``{name: tensor}``, any device/dtype) into the model in place.

    Raises:
        ValueError: keys or shapes differ from the model's, or two names of one tied tensor carry different
            values.
    """
    own = model.state_dict()
    missing, extra = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    if missing or extra:
        raise ValueError(f"set_weights: missing keys {missing[:5]}, unexpected keys {extra[:5]}")
    bad = [k for k in own if tuple(own[k].shape) != tuple(weights[k].shape)]
    if bad:
        raise ValueError(f"set_weights: shape mismatch for {bad[:5]} (e.g. {bad[0]}: model "
                         f"{tuple(own[bad[0]].shape)}, got {tuple(weights[bad[0]].shape)})")
    first: dict[tuple[int, int], str] = {}
    for k, v in own.items():
        key = (v.data_ptr(), v.numel())
        if key in first:
            if weights[k] is not weights[first[key]] and not torch.equal(weights[k], weights[first[key]]):
                raise ValueError(
                    f"set_weights: {k!r} and {first[key]!r} are one tied tensor in the model but got "
                    "different values; send the same tensor under both names"
                )
            continue
        first[key] = k
    with torch.no_grad():
        for k in first.values():
            own[k].copy_(weights[k].to(device=own[k].device, dtype=own[k].dtype))
