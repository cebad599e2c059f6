"""Where hf_lmc runs its large tensor products (weight matching, export)."""

from __future__ import annotations

import torch


def compute_device(device: str | torch.device | None = None) -> torch.device:
    """``device`` if given, else the current CUDA device when there is one, else the CPU.

    Under ``accelerate launch`` each process's current CUDA device is its own GPU.
    """
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} asked for, but torch sees no CUDA device; use cpu (or leave the device unset)")
    return device
