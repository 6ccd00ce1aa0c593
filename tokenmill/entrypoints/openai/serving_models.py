"""GET /v1/models (and /v1/models/{id}), the served-model-name check every endpoint uses, and the
`system_fingerprint` every completion carries."""
from __future__ import annotations

import hashlib
import uuid
from typing import Any

from tokenmill.entrypoints.openai.protocol import ModelCard, ModelList, ModelPermission


class OpenAIServingModels:
    """The names this server answers to. Responses carry the first; requests may name any (or none)."""

    def __init__(self, engine_config: Any) -> None:
        mc = engine_config.model_config
        names = mc.served_model_name or [mc.model]
        if isinstance(names, str):
            names = [names]
        self.served_model_names: list[str] = [str(n) for n in names]
        self.root: str = str(mc.model) if getattr(mc, "model", None) else self.served_model_names[0]
        self.max_model_len: int = mc.max_model_len
        self.fingerprint: str = system_fingerprint(engine_config)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def is_served(self, name: str | None) -> bool:
        return not name or name in self.served_model_names

    def show_available_models(self) -> ModelList:
        cards = [ModelCard(id=name, root=self.root, max_model_len=self.max_model_len,
                           permission=[ModelPermission(id=f"modelperm-{uuid.uuid4().hex}")])
                 for name in self.served_model_names]
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
