"""Wall-clock timing of device work: CUDA kernels run asynchronously, so a timer reads the clock only after
`synchronize` has waited for the work queued so far (a no-op on the CPU)."""

from __future__ import annotations

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on `device` when it is a CUDA device; nothing to wait for elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
