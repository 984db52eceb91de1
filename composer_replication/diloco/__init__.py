"""DiLoCo outer loop over torchft (``make_diloco_outer_loop``) and torchft's own names.

``DiLoCo``, ``Manager`` and ``_DummyWork`` are torchft's classes, or ``None`` when torchft is not
importable (``_TORCHFT_AVAILABLE`` says which).
"""

from composer_replication.diloco.outer import (
    _TORCHFT_AVAILABLE,
    DiLoCo,
    Manager,
    _DummyWork,
    make_diloco_outer_loop,
)

__all__ = ["DiLoCo", "Manager", "_DummyWork", "_TORCHFT_AVAILABLE", "make_diloco_outer_loop"]
