"""Triton kernel tests. Without CUDA the kernels run in Triton's interpreter on the CPU (tests/conftest.py turns it
on before anything imports triton). With CUDA the same tests run compiled on the GPU (the interpreter stays off)
and the `gpu`-marked variants add larger shapes and bf16."""
