"""Triton kernel tests. Without CUDA the kernels run in Triton's interpreter on the CPU (TRITON_INTERPRET=1 must be
set before triton is imported, hence here, at collection). With CUDA the same tests run compiled on the GPU (the
interpreter stays off) and the `gpu`-marked variants add larger shapes and bf16."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
