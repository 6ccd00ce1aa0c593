"""Worker tests run the graphs' step-input kernel on the CPU: Triton's interpreter must be on before triton is
imported (with CUDA the kernels run compiled)."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
