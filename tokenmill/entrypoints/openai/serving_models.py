"""GET /v1/models (and /v1/models/{id}), the served-model-name check every endpoint uses, and the
`system_fingerprint` every completion carries."""
from __future__ import annotations

import hashlib
import uuid
from typing import Any

from tokenmill.entrypoints.openai.protocol import ModelCard, ModelList, ModelPermission


class OpenAIServingModels:
    """The names this server answers to. Responses carry the first; requests may name any (or none), or a LoRA
    adapter's name (`lora_requests`: --lora-modules and runtime-loaded ones), which runs the request under it."""

    def __init__(self, engine_config: Any) -> None:
        mc = engine_config.model_config
        names = mc.served_model_name or [mc.model]
        if isinstance(names, str):
            names = [names]
        self.served_model_names: list[str] = [str(n) for n in names]
        self.root: str = str(mc.model) if getattr(mc, "model", None) else self.served_model_names[0]
        self.max_model_len: int = mc.max_model_len
        self.fingerprint: str = system_fingerprint(engine_config)
        self.lora_requests: dict[str, Any] = {}  # adapter name -> LoRARequest
        self._lora_parent: dict[str, str] = {}
        self._next_lora_id = 1

    def add_lora(self, name: str, path: str, base_model_name: str | None = None, check=None,
                 load_inplace: bool = False) -> Any:
        """Register adapter `name` (a fresh lora_int_id, or its own again with load_inplace) after `check` (the
        processor's check_lora) accepted it; ValueError when the name is taken (by a model or another adapter)."""
        from tokenmill.lora.request import LoRARequest
        old = self.lora_requests.get(name)
        if name in self.served_model_names or (old is not None and not load_inplace):
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        lora_id = old.lora_int_id if old is not None else self._next_lora_id
        req = LoRARequest(name, lora_id, path, base_model_name=base_model_name, load_inplace=load_inplace)
        if check is not None:
            check(req)
        if old is None:
            self._next_lora_id += 1
        self.lora_requests[name] = LoRARequest(name, lora_id, path, base_model_name=base_model_name)
        self._lora_parent[name] = base_model_name or self.model_name
        return req

    def remove_lora(self, name: str) -> bool:
        """Stop serving adapter `name` (requests already running under it finish); False if it is not served."""
        self._lora_parent.pop(name, None)
        return self.lora_requests.pop(name, None) is not None

    def response_name(self, name: str | None) -> str:
        """The `model` a response carries: the adapter's name for a request under one (as vLLM), else the first
        served name."""
        return name if name and name in self.lora_requests else self.model_name

    def lora_for(self, name: str | None) -> Any:
        """The LoRARequest a request's `model` names, or None (the base model)."""
        return self.lora_requests.get(name) if name else None

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def is_served(self, name: str | None) -> bool:
        return not name or name in self.served_model_names or name in self.lora_requests

    def show_available_models(self) -> ModelList:
        cards = [ModelCard(id=name, root=self.root, max_model_len=self.max_model_len,
                           permission=[ModelPermission(id=f"modelperm-{uuid.uuid4().hex}")])
                 for name in self.served_model_names]
        cards += [ModelCard(id=name, root=lora.lora_path, parent=self._lora_parent[name],
                            max_model_len=self.max_model_len,
                            permission=[ModelPermission(id=f"modelperm-{uuid.uuid4().hex}")])
                  for name, lora in self.lora_requests.items()]
        return ModelList(data=cards)

    def find(self, name: str) -> ModelCard | None:
        """The card of served name `name`, or None."""
        return next((card for card in self.show_available_models().data if card.id == name), None)


def system_fingerprint(engine_config: Any) -> str:
    """`tokenmill-<version>-<hash>`: OpenAI's (and recent vLLM's) system_fingerprint, which changes when what
    decides the outputs changes (the model, dtype, quantization, context length, parallelism), so clients that log
    it can tell two deployments apart. Computed once at start-up."""
    import tokenmill
    mc = engine_config.model_config
    pc = getattr(engine_config, "parallel_config", None)
    decisive = [getattr(mc, name, None) for name in ("model", "dtype", "quantization", "max_model_len", "revision")]
    decisive += [getattr(pc, name, None) for name in ("tensor_parallel_size", "data_parallel_size")]
    digest = hashlib.sha256(repr(decisive).encode()).hexdigest()[:8]
    return f"tokenmill-{tokenmill.__version__}-{digest}"
