"""vLLM's `LoRARequest`, importable from the same module path (`vllm.lora.request` -> `tokenmill.lora.request`)."""
from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """One adapter a request runs under.

    lora_int_id identifies the adapter in the engine (>= 1, unique per adapter: two requests with the same id share
    its loaded weights and prefix-cache entries); lora_path is the PEFT save directory (adapter_config.json plus
    adapter_model.safetensors or .bin). base_model_name, when given, must name the served base model. load_inplace:
    re-read the adapter from disk even when one with this id is already loaded.
    """
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}.")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}.")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must name the adapter's directory.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def cache_key(self) -> str:
        """What prefix-cache keys of this adapter's requests are salted with (see core/block_hash.py)."""
        return f"{self.lora_int_id}:{self.lora_name}:{self.lora_path}"
