"""Device selection."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.config.utils import check_choices, config_field


@dataclass
class DeviceConfig:
    """Which device runs the model."""
    device: str = config_field("auto", help="auto: CUDA when available, else CPU.", choices=("auto", "cuda", "cpu"))

    def __post_init__(self) -> None:
        check_choices(self)
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but torch sees no CUDA device; use device='cpu'.")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)
