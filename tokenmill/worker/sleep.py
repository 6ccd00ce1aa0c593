"""Sleep mode (vLLM's LLM.sleep / wake_up): a worker gives back the device memory of its weights and KV cache
between uses, and takes it back.

Two parts sleep, and wake on their own (`wake_up(tags)`):
- "weights": the parameters and buffers of the model (and of a drafter with a model of its own). Level 1 copies
  them to host memory (pinned on CUDA) and copies them back on waking. Level 2 discards the parameters: they come
  back with their shapes but uninitialised, for the caller to load or sync the weights into (collective_rpc /
  apply_model with the model's load_weights); buffers (RoPE tables and the like) are kept on the host as at level 1,
  as vLLM keeps them. The Parameter objects stay (with their weight_loader and other attributes); only their storage
  moves. Tensors a layer keeps outside its parameters and buffers stay where they are; those derived from its
  weights (another layout's copy) would outlive a level-2 weight sync, so a module with `discard_weight_copies()`
  has it called at level 2.
- "kv_cache": discarded at both levels, with the recurrent state, the drafter's cache and the CUDA graphs.
- LoRA slot buffers (enable_lora) go with the weights at both levels and come back empty; the adapters stay in the
  host LRU and are written into slots again by the next steps that use them.

Waking rebuilds the KV cache and recaptures the CUDA graphs (ModelRunner.initialize_kv_cache, the start-up path)
rather than putting the memory back at its old addresses. The graphs hold raw pointers into the KV cache and the
weights; keeping those addresses valid would need a virtual-memory allocator that unmaps the pages but keeps the
address range reserved (vLLM's cuMem pool), which torch's caching allocator cannot do, and anything allocated while
asleep (a trainer's tensors) may take the old range. A graph replayed over freed or reused memory corrupts silently;
a recapture costs the start-up's capture time once per wake and is always right. So the KV cache is rebuilt when
both parts are awake again: waking "kv_cache" while the weights still sleep claims its memory when they wake (a
capture runs the model).
"""
from __future__ import annotations

import gc
from typing import Callable

import torch

from tokenmill.logger import init_logger

logger = init_logger(__name__)
GiB = 1 << 30
PARTS = ("weights", "kv_cache")


class _Slept:
    """One parameter or buffer while asleep: its host copy (None: discarded) and its layout."""
    __slots__ = ("tensor", "host", "shape", "stride", "alias")

    def __init__(self, tensor: torch.Tensor, host: torch.Tensor | None, alias: int | None) -> None:
        self.tensor, self.host, self.alias = tensor, host, alias
        self.shape, self.stride = tuple(tensor.shape), tuple(tensor.stride())


class SleepState:
    """A worker's sleeping parts. `modules()` gives the modules whose weights sleep; `rebuild_kv()` makes the KV
    cache and graphs again (the runner's `release_kv_cache` drops them)."""

    def __init__(self, runner, rebuild_kv: Callable[[], None]) -> None:
        self.runner = runner
        self.rebuild_kv = rebuild_kv
        self.asleep: set[str] = set()
        self._slept: list[_Slept] = []
        self._kv_released = False

    def modules(self) -> list[torch.nn.Module]:
        mods = [self.runner.model]
        proposer = self.runner.proposer
        if proposer is not None and proposer.has_model and getattr(proposer, "model", None) is not None:
            mods.append(proposer.model)
        return mods

    def sleep(self, level: int) -> None:
        device = self.runner.device
        before = _free_bytes(device)
        if "weights" not in self.asleep:
            self._offload_weights(keep_params=level == 1)
            if getattr(self.runner, "lora", None) is not None:
                self.runner.lora.release_slots()
        if "kv_cache" not in self.asleep:
            self.runner.release_kv_cache()
            self._kv_released = True
        self.asleep = set(PARTS)
        gc.collect()  # the graphs and caches may sit in reference cycles
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            logger.info("Sleep level %d: %.2f GiB of device memory freed, %.2f GiB in use by this process", level,
                        (_free_bytes(device) - before) / GiB, torch.cuda.memory_reserved(device) / GiB)

    def wake_up(self, tags: list[str]) -> None:
        if "weights" in tags and "weights" in self.asleep:
            self._restore_weights()
            if getattr(self.runner, "lora", None) is not None:
                self.runner.lora.restore_slots()
            self.asleep.discard("weights")
        if "kv_cache" in tags:
            self.asleep.discard("kv_cache")
        if self._kv_released and not self.asleep:
            self.rebuild_kv()
            self._kv_released = False
        elif self._kv_released and "kv_cache" in tags:
            logger.info("The KV cache comes back when the weights wake (its CUDA graphs run the model).")

    # ----- weights -----
    @torch.no_grad()
    def _offload_weights(self, keep_params: bool) -> None:
        pin = self.runner.device.type == "cuda"
        seen: dict[int, int] = {}  # id(tensor) -> index in _slept (a tensor shared by two modules sleeps once)
        views: dict[tuple, int] = {}  # two tensor objects over the same memory (tied weights) wake as one again
        slept: list[_Slept] = []
        for mod in self.modules():
            for kind, tensors in (("param", mod.parameters()), ("buffer", mod.buffers())):
                for t in tensors:
                    if id(t) in seen or t.numel() == 0:
                        continue
                    seen[id(t)] = len(slept)
                    key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
                    alias = views.get(key)
                    host = None
                    if alias is None:
                        views[key] = len(slept)
                        if keep_params or kind == "buffer":
                            host = _to_host(t.data, pin)
                    slept.append(_Slept(t, host, alias))
        for s in slept:  # every alias has been recorded: now free the device copies
            s.tensor.data = torch.empty(0, dtype=s.tensor.dtype, device=s.tensor.device)
        self._slept = slept
        if not keep_params:
            for mod in self.modules():
                for sub in mod.modules():
                    discard = getattr(sub, "discard_weight_copies", None)
                    if callable(discard):
                        discard()

    @torch.no_grad()
    def _restore_weights(self) -> None:
        device = self.runner.device
        restored: list[torch.Tensor] = []
        for s in self._slept:
            if s.alias is not None:
                data = restored[s.alias]
            elif s.host is not None:
                data = s.host.to(device, non_blocking=True)
            else:  # level 2: the caller loads the weights into it
                data = torch.empty_strided(s.shape, s.stride, dtype=s.tensor.dtype, device=device)
            s.tensor.data = data
            restored.append(data)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the pinned host copies are freed below
        self._slept = []


def _to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    if t.device.type == "cpu":
        return t  # the weights already live in host memory: the tensor itself is kept aside
    host = torch.empty_like(t, device="cpu", pin_memory=pin)
    host.copy_(t)
    return host


def _free_bytes(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
