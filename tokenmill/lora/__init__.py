"""Multi-LoRA serving: adapter requests (request.py), PEFT adapter loading (peft.py), the per-model adapter manager
with its device slots and host LRU (manager.py), and the ops that add each token's adapter product (ops.py).

This package file imports nothing, so `tokenmill.lora.request` (which the engine's messages carry) stays free of
torch and of the layers the rest of the package builds on.
"""
