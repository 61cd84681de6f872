"""A wall clock that counts a device's queued work: CUDA runs ahead of the host, so a timer read
right after a launch would measure the launch, not the work."""

from __future__ import annotations

import time

import torch


def clock(device: torch.device | str) -> float:
    """`time.perf_counter()` once `device` has finished everything queued on it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
