"""The worker's adapters: max_loras device slots, an LRU of max_cpu_loras adapters in host memory, and the output
deltas that apply each token's adapter inside the model's linear layers.

Every projection an adapter may target (q/k/v, o, gate/up, down, and a Gated DeltaNet layer's in_proj_qkv, in_proj_z,
in_proj_b/a and out_proj; restricted by lora_target_modules) gets stacked
slot buffers once, at start (lora/ops.py's layout: the output slices of a fused qkv_proj or gate_up_proj share
one A and one B), R = max_lora_rank, on this rank's share of the layer (column-parallel layers keep B's rows of
their output slice, row-parallel ones A's columns of their input slice, so the partial products sum in the
layer's own all-reduce). A slot not used by an adapter for a module is zero there.

Per step the runner calls `activate(req_ids, n_sched)`: adapters of the step's requests are moved into slots
(least recently used slots of adapters the step does not need are reused; the scheduler never puts more distinct
adapters in a step than there are slots) and the step's lora map (which tokens use which slot) goes to the
deltas. On CUDA the deltas are the Triton kernels of lora/triton_ops.py, attached for good: they read the map from
one device buffer, so the CUDA graphs are captured with them and every step, with adapters or not, replays them (a
step without adapters publishes an empty map and the kernels return at once). On the CPU the torch reference
(lora/ops.py) is attached only for steps with adapters; `deactivate()` detaches it, so other steps keep the fused
paths. `prefetch(lora)` (the engine core calls it when a request names an adapter it has not seen) reads the
adapter from disk in a background thread, so the step that first needs it only waits for what is left of the
read; the host LRU itself is only touched by the step loop.
"""
from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from tokenmill.config.lora import LoRAConfig
from tokenmill.layers.linear import LinearBase, MergedColumnParallelLinear
from tokenmill.lora.ops import build_lora_map, lora_delta_ref, map_groups
from tokenmill.lora.peft import LoRAAdapter, read_adapter
from tokenmill.lora.request import LoRARequest

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# tokenmill's projection -> the module names an adapter may target it by.
_LEAVES = {"qkv_proj": ("qkv_proj", "q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
           "gate_up_proj": ("gate_up_proj", "gate_proj", "up_proj"), "down_proj": ("down_proj",),
           # Gated DeltaNet (Qwen3.5's linear attention)
           "in_proj_qkv": ("in_proj_qkv",), "in_proj_z": ("in_proj_z",),
           "in_proj_ba": ("in_proj_ba", "in_proj_b", "in_proj_a"), "out_proj": ("out_proj",)}


class _LayerSlots:
    """One linear layer's slot buffers (lora/ops.py's layout) and its output slices."""

    def __init__(self, layer: LinearBase, max_loras: int, rank: int, dtype, device) -> None:
        self.layer, self.rank = layer, rank
        if isinstance(layer, MergedColumnParallelLinear):
            self.slices = list(layer.shards)  # shard ids in output order
            self.offsets = [layer.shards[s][0] for s in self.slices]
            self.sizes = [layer.shards[s][1] for s in self.slices]
        else:
            self.slices, self.offsets, self.sizes = [None], [0], [layer.shape.output_size_per_rank]
        if self.offsets != [sum(self.sizes[:j]) for j in range(len(self.sizes))]:
            raise ValueError(f"{layer.prefix}: LoRA needs the output slices contiguous from 0, got offsets "
                             f"{self.offsets} for sizes {self.sizes}")
        self._shapes = ((max_loras, len(self.sizes) * rank, layer.shape.input_size_per_rank),
                        (max_loras, sum(self.sizes), rank))
        self._dtype, self._device = dtype, device
        self.allocate()

    def allocate(self) -> None:
        """Empty (zero) slot buffers: at start-up, and on waking from sleep."""
        self.a, self.b = (torch.zeros(shape, dtype=self._dtype, device=self._device) for shape in self._shapes)

    def release(self) -> None:
        self.a = self.b = torch.empty(0, dtype=self._dtype, device=self._device)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def write(self, slot: int, shard, a: torch.Tensor, b: torch.Tensor) -> None:
        """Copy one adapter module's full (A [r, in], B [out, r]) into `slot`, this rank's share; shard None with
        several slices: a fused module (qkv_proj, gate_up_proj) whose B stacks every slice."""
        layer, r = self.layer, a.shape[0]
        if shard is None and len(self.slices) > 1:
            full = [layer.shards[s][2] for s in self.slices]
            for sid, piece in zip(self.slices, b.split(full, dim=0)):
                self.write(slot, sid, a, piece)
            return
        j = self.slices.index(shard)
        n = self.sizes[j]
        if layer.sums_over_ranks:  # row-parallel: this rank's input columns
            k = layer.shape.input_size_per_rank
            a = a[:, layer.tp_rank * k:(layer.tp_rank + 1) * k]
        else:
            start = layer.shard_start(shard) if shard is not None else layer.tp_rank * n
            b = b[start:start + n]
        self.a[slot, j * self.rank:j * self.rank + r].copy_(a)
        self.b[slot, self.offsets[j]:self.offsets[j] + n, :r].copy_(b)


class LoRAModelManager:
    """Adapters of one model replica (one rank's share): see the module docstring. Requests are registered with
    `add_request(req_id, lora_request)` and dropped with `remove_request`."""

    def __init__(self, model: torch.nn.Module, config: LoRAConfig, model_dtype: torch.dtype, device: torch.device,
                 text_config, served_names: list[str], max_num_tokens: int) -> None:
        self.config, self.device = config, device
        self.dtype = _DTYPES.get(config.lora_dtype, model_dtype)
        self.text_config, self.served_names = text_config, served_names
        self.mapping = model.weight_mapping
        self.layers: dict[str, _LayerSlots] = {}
        for mod in model.modules():
            leaf = mod.prefix.rsplit(".", 1)[-1] if isinstance(mod, LinearBase) else None
            if leaf in _LEAVES and any(config.targets(m) for m in _LEAVES[leaf]):
                self.layers[mod.prefix] = _LayerSlots(mod, config.max_loras, config.max_lora_rank, self.dtype, device)
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU, most recent last
        self.slots: list[int | None] = [None] * config.max_loras
        self._slot_lru: list[int] = list(range(config.max_loras))  # least recently used first
        self.req_lora: dict[str, LoRARequest] = {}
        self._groups: list[tuple[int, torch.Tensor]] = []  # the CPU step's (slot, token rows)
        # On CUDA the Triton kernels read the step's lora map from a device buffer and stay attached (the graphs
        # are captured with them); elsewhere the torch reference runs by group, attached for steps with adapters.
        self.use_triton = False
        self._side: torch.cuda.Stream | None = None
        self._map_cap = config.max_loras + 1 + max_num_tokens
        self.set_kernels(device.type == "cuda")
        self.loads = 0  # adapters read from disk (the host LRU's misses)
        self._pending: dict[int, Future] = {}  # lora_int_id -> the background read of a prefetched adapter
        self._pool: ThreadPoolExecutor | None = None

    # ----- requests -----
    def add_request(self, req_id: str, lora: LoRARequest | None) -> None:
        if lora is not None:
            self.req_lora[req_id] = lora
            if lora.load_inplace:  # read again (the prefetch started already): the old copy and slot are stale
                self.host.pop(lora.lora_int_id, None)
                if lora.lora_int_id in self.slots:
                    self.slots[self.slots.index(lora.lora_int_id)] = None

    def remove_request(self, req_id: str) -> None:
        self.req_lora.pop(req_id, None)

    # ----- adapters -----
    def _read(self, lora: LoRARequest) -> LoRAAdapter:
        return read_adapter(lora.lora_name, lora.lora_int_id, lora.lora_path, max_rank=self.config.max_lora_rank,
                            text_config=self.text_config, served_names=self.served_names,
                            base_model_name=lora.base_model_name, mapping=self.mapping)

    def prefetch(self, lora: LoRARequest) -> None:
        """Start reading `lora` from disk in the background unless it is in the host LRU or being read."""
        lid = lora.lora_int_id
        if (lid in self.host and not lora.load_inplace) or lid in self._pending:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-lora-load")
        self._pending[lid] = self._pool.submit(self._read, lora)

    def _host_adapter(self, lora: LoRARequest) -> LoRAAdapter:
        pending = self._pending.pop(lora.lora_int_id, None)
        ad = self.host.get(lora.lora_int_id) if pending is None else None
        if ad is not None:
            self.host.move_to_end(lora.lora_int_id)
            return ad
        ad = pending.result() if pending is not None else self._read(lora)
        self.loads += 1
        self.host[lora.lora_int_id] = ad
        self.host.move_to_end(lora.lora_int_id)
        while len(self.host) > self.config.max_cpu_loras:
            self.host.popitem(last=False)
        return ad

    def remove_adapter(self, lora_int_id: int) -> None:
        """Forget an adapter (host copy and slot); requests still running under it must be gone."""
        self.host.pop(lora_int_id, None)
        if lora_int_id in self.slots:
            self.slots[self.slots.index(lora_int_id)] = None

    def release_slots(self) -> None:
        """Sleep: the slot buffers' device memory goes back and every slot is empty; the adapters stay in the host
        LRU. `restore_slots` brings empty buffers back, and the next steps write their adapters again (the deltas
        read the buffers when called, and the CUDA graphs are captured again after waking)."""
        for ls in self.layers.values():
            ls.release()
        self.slots = [None] * len(self.slots)

    def restore_slots(self) -> None:
        for ls in self.layers.values():
            ls.allocate()

    def _slot_for(self, lora: LoRARequest, needed: set[int]) -> int:
        lid = lora.lora_int_id
        if lid in self.slots:
            slot = self.slots.index(lid)
        else:
            ad = self._host_adapter(lora)
            free = [s for s in self._slot_lru if self.slots[s] is None or self.slots[s] not in needed]
            if not free:
                raise RuntimeError(f"A step needs more than max_loras={len(self.slots)} adapters; the scheduler "
                                   "must not plan that.")
            slot = free[0]
            self._write_slot(slot, ad)
        self._slot_lru.remove(slot)
        self._slot_lru.append(slot)
        return slot

    def _write_slot(self, slot: int, ad: LoRAAdapter) -> None:
        for ls in self.layers.values():
            ls.clear(slot)
        for module, (a, b) in ad.weights.items():
            leaf = module.rsplit(".", 1)[-1]
            if not self.config.targets(leaf):
                continue
            target, shard = self.mapping.target(self.mapping.rename(module + ".weight"))
            ls = self.layers.get(target[:-len(".weight")])
            if ls is None:
                continue  # a module on another pipeline stage
            ls.write(slot, shard, a.to(self.device, self.dtype), b.to(self.device, self.dtype))
        self.slots[slot] = ad.lora_int_id

    # ----- one step -----
    def activate(self, req_ids: list[str], n_sched: np.ndarray) -> bool:
        """Put the step's adapters into slots and publish the step's lora map to the deltas; False when no request
        of the step has an adapter (on the CPU nothing is attached then)."""
        loras = [self.req_lora.get(r) for r in req_ids]
        S = len(self.slots)
        if not any(loras):
            if self.use_triton and not self._map_empty:
                self._stage(np.zeros(S + 1, dtype=np.int32))
                self._map_empty = True
            return False
        needed = {lo.lora_int_id for lo in loras if lo is not None}
        slot_of: dict[int, int] = {}
        for lo in loras:
            if lo is not None and lo.lora_int_id not in slot_of:
                slot_of[lo.lora_int_id] = self._slot_for(lo, needed)
        per_req = np.array([slot_of[lo.lora_int_id] if lo is not None else -1 for lo in loras], dtype=np.int64)
        lora_map = build_lora_map(np.repeat(per_req, n_sched), S)
        if self.use_triton:
            self._stage(lora_map)
            self._map_empty = False
        else:
            self._groups = [(s, torch.from_numpy(rows.astype(np.int64)).to(self.device))
                            for s, rows in map_groups(lora_map, S)]
            self._attach()
        return True

    def deactivate(self) -> None:
        """End the step: on the CPU the deltas are detached (steps without adapters keep the fused paths)."""
        if not self.use_triton and self._groups:
            for ls in self.layers.values():
                ls.layer.set_output_delta(None)
            self._groups = []

    def set_kernels(self, triton: bool) -> None:
        """Pick the deltas: the Triton kernels (attached from now on) or the torch reference (attached per step).
        The CUDA graphs are captured with whichever is set, so this is for start-up and tests."""
        self.use_triton = triton
        if triton:
            pin = torch.cuda.is_available()
            self._map_dev = torch.zeros(self._map_cap, dtype=torch.int32, device=self.device)
            self._map_host = [torch.zeros(self._map_cap, dtype=torch.int32, pin_memory=pin) for _ in range(4)]
            self._map_turn, self._map_empty = 0, True
            self._attach()
        else:
            for ls in self.layers.values():
                ls.layer.set_output_delta(None)

    def side_stream(self) -> torch.cuda.Stream:
        """The stream the deltas' shrinks run on beside the products inside CUDA graphs (_TritonDelta)."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def _stage(self, lora_map: np.ndarray) -> None:
        """Copy the step's map into the device buffer the deltas (and the graphs) read, through the next pinned
        host buffer of a ring: the engine has at most one step in flight, so a buffer is free again long before
        its turn comes back."""
        n = len(lora_map)
        if n > self._map_dev.shape[0]:
            raise RuntimeError(f"A step has {n - len(self.slots) - 1} adapter tokens; the LoRA map holds at most "
                               f"{self._map_dev.shape[0] - len(self.slots) - 1} (max_num_batched_tokens).")
        host = self._map_host[self._map_turn % len(self._map_host)]
        self._map_turn += 1
        host[:n].numpy()[:] = lora_map
        self._map_dev[:n].copy_(host[:n], non_blocking=True)

    def _attach(self) -> None:
        for ls in self.layers.values():
            ls.layer.set_output_delta(self._delta(ls))

    def _delta(self, ls: _LayerSlots):
        if self.use_triton:
            return _TritonDelta(self, ls)

        def delta(x: torch.Tensor, y: torch.Tensor) -> None:
            lora_delta_ref(x, y, self._groups, ls.a, ls.b, ls.sizes, ls.rank)
        return delta


class _TritonDelta:
    """One layer's delta on CUDA: the shrink, then the expand into the product's output.

    While a CUDA graph is being captured, `prepare` queues the shrink on a side stream before the product, so in the
    replayed graph the shrink (which needs only x) runs beside the product instead of after it; the expand waits
    for both. Eager steps keep one stream, so they pay no per-layer fork and join on the host."""

    def __init__(self, manager: LoRAModelManager, ls: _LayerSlots) -> None:
        from tokenmill.lora.triton_ops import lora_expand_triton, lora_shrink_triton
        self.manager, self.ls = manager, ls
        self._shrink, self._expand = lora_shrink_triton, lora_expand_triton
        self._h: torch.Tensor | None = None

    def prepare(self, x: torch.Tensor) -> None:
        self._h = None
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            self._h = self._shrink(x, self.manager._map_dev, self.ls.a, stream=self.manager.side_stream())

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        h, self._h = self._h, None
        if h is None:
            h = self._shrink(x, self.manager._map_dev, self.ls.a)
        else:
            torch.cuda.current_stream(y.device).wait_stream(self.manager.side_stream())
        self._expand(h, y, self.manager._map_dev, self.ls.b, self.ls.sizes, self.ls.rank)
