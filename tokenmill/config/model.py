"""Model configuration: which model, its dtype and context length. Resolving it reads the model's config."""
from __future__ import annotations

from dataclasses import InitVar, dataclass
from typing import Any

import torch

from tokenmill.config.utils import check_choices, check_range, config_field, not_supported_yet
from tokenmill.logger import init_logger

logger = init_logger(__name__)

DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
# --quantization values with a linear method (tokenmill/layers/quantization's registry; vLLM's aliases included).
QUANTIZATION_METHODS = ("gguf", "fp8", "compressed-tensors", "compressed_tensors", "awq", "awq_marlin", "gptq",
                        "gptq_marlin", "bitsandbytes")
_DTYPE_MAP = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16,
              "float": torch.float32, "float32": torch.float32}


def parse_human_int(value: Any, name: str) -> int | None:
    """'32k' -> 32000, '1K' -> 1024 (vLLM: lower-case = powers of ten, upper-case = powers of two); 'auto'/-1 -> None."""
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        return None if value == -1 else value
    s = str(value).strip()
    if s.lower() == "auto" or s == "-1":
        return None
    mult = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
    try:
        if s and s[-1] in mult:
            return int(float(s[:-1]) * mult[s[-1]])
        return int(s)
    except ValueError:
        raise ValueError(f"Invalid value {value!r} for `{name}`: expected an integer such as 4096, 32k or 1K, "
                         "or auto / -1.") from None


@dataclass
class ModelConfig:
    """The model to run. `__post_init__` resolves it locally (never downloads) and reads its HF config."""
    model: str | None = config_field(None, help="Model directory, .gguf file or locally cached HF repo id; "
                                                "empty = the embedded SmolLM2-135M-Instruct.")
    tokenizer: str | None = config_field(None, help="Tokenizer directory or id (default: the model's).")
    tokenizer_mode: str = config_field("auto", help="auto/hf: fast tokenizer; slow: the Python one.",
                                       choices=("auto", "hf", "slow", "mistral", "deepseek_v32",
                                                "deepseek_v4"))
    trust_remote_code: bool = config_field(False, help="Allow custom code from the model repository.")
    dtype: str = config_field("auto", help="Weights and activations dtype. auto: the checkpoint's dtype on GPU "
                                           "(fp32 checkpoints run in bf16); float32 on CPU, where a GGUF file's "
                                           "4-bit blocks stay quantized unless --dtype float32 is given (then it "
                                           "loads dense).", choices=DTYPES)
    seed: int = config_field(0, help="Global random seed (unseeded requests draw their seeds from it).")
    revision: str | None = config_field(None, help="Model revision in the local HF cache.")
    code_revision: str | None = config_field(
        None, help="Revision of remote configuration code that the model's config.json takes from another Hub "
                   "repository (auto_map 'org/repo--module.Class'), looked up in the local HF cache. Read only with "
                   "--trust-remote-code, as in vLLM: without it no remote code runs, and this has no effect.")
    tokenizer_revision: str | None = config_field(None, help="Tokenizer revision in the local HF cache.")
    hf_config_path: str | None = config_field(None, help="Read the HF config from here instead of the model.")
    max_model_len: int | None = config_field(None, help="Context length (prompt + output); default: the "
                                                        "model's. Accepts 32k, 1K, auto.")
    quantization: str | None = config_field(
        None, help="Weight quantization method; default: the checkpoint's quantization_config. fp8 (FP8 "
                   "checkpoints, or a dense one quantized at load), compressed-tensors, awq, gptq, bitsandbytes "
                   "(NF4 of a dense checkpoint at load); vLLM's aliases "
                   "(compressed_tensors, awq_marlin, gptq_marlin) accepted; GGUF files are dequantized at load. "
                   "Naming another method than the checkpoint's is an error.")
    enforce_eager: bool = config_field(False, help="Never use CUDA graphs.")
    max_logprobs: int = config_field(20, help="Most logprobs a request may ask for (-1 = no limit).")
    logprobs_mode: str = config_field("raw_logprobs", help="What logprobs report.",
                                      choices=("raw_logprobs", "raw_logits", "processed_logprobs",
                                               "processed_logits"))
    disable_sliding_window: bool = config_field(
        False, help="Run a sliding-window model with full attention, its context capped at the window size (as in "
                    "vLLM); without it, such a model runs only with max_model_len up to the window.")
    skip_tokenizer_init: bool = config_field(False, help="Load no tokenizer; prompts must be token ids.")
    served_model_name: str | list[str] | None = config_field(None, help="Name(s) the API serves the model as.")
    hf_overrides: dict = config_field(help="Values merged into the HF config (offline LLM: also a function that "
                                           "takes the HF config and returns it, as in vLLM).", default_factory=dict)
    generation_config: str = config_field("auto", help="auto: the model's generation_config.json; vllm: none; "
                                                       "or a folder holding one.")
    override_generation_config: dict = config_field(help="Generation defaults to override.", default_factory=dict)
    disable_cascade_attn: bool = config_field(
        True, help="Accepted with either value and no effect: cascade attention (a shared-prefix split that vLLM's "
                   "FlashAttention backend may choose) is not a feature of tokenmill's attention backends, as vLLM's "
                   "other backends ignore this flag too.")
    enable_prompt_embeds: bool = config_field(False, help="Accept prompt embeddings (not supported yet).")
    enable_sleep_mode: bool = config_field(
        False, help="Let the engine sleep and release device memory (LLM.sleep / wake_up; worker/sleep.py).")
    # vLLM's MultiModalConfig options. vLLM reads them only for a multimodal model; every model tokenmill runs is
    # text-only (models/registry.py), so their values are checked and change nothing, as in vLLM for such a model.
    mm_processor_cache_type: str = config_field(
        "lru", help="Cache of processed multimodal inputs (lru: per process; shm: shared memory). No effect on the "
                    "text-only models tokenmill runs, as in vLLM for a text-only model.", choices=("lru", "shm"))
    mm_encoder_tp_mode: str = config_field(
        "weights", help="How a multimodal encoder uses tensor parallelism (weights: sharded; data: replicated, "
                        "batch split). No effect on the text-only models tokenmill runs, as in vLLM for a "
                        "text-only model.", choices=("weights", "data"))
    # LoadConfig.download_dir, handed over by create_engine_config: where to look for cached hub models.
    download_dir: InitVar[str | None] = None

    def __post_init__(self, download_dir: str | None = None) -> None:
        if isinstance(self.dtype, torch.dtype):  # vLLM's LLM(dtype=torch.bfloat16): its name, as vLLM takes it
            name = str(self.dtype).removeprefix("torch.")
            if name not in DTYPES:
                raise ValueError(f"Invalid value {self.dtype} for `dtype`; allowed values: "
                                 f"{', '.join(DTYPES)} (or torch.float16, torch.bfloat16, torch.float32).")
            self.dtype = name
        check_choices(self)
        if self.seed is None:
            # vLLM V1 has no unseeded engine (every worker must sample alike): seed=None means its default, 0.
            logger.info("seed=None: the engine's global seed is 0, as in vLLM (give an integer to change it).")
            self.seed = 0
        elif isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"Invalid value {self.seed!r} for `seed`: must be an integer.")
        self.max_model_len = parse_human_int(self.max_model_len, "max_model_len")
        check_range("max_model_len", self.max_model_len, 1)
        if self.max_logprobs < -1:
            raise ValueError(f"Invalid value {self.max_logprobs} for `max_logprobs`: must be -1 or >= 0.")
        if self.tokenizer_mode in ("mistral", "deepseek_v32", "deepseek_v4"):
            raise not_supported_yet("tokenizer_mode", self.tokenizer_mode, "Use auto, hf or slow.")
        if self.quantization is not None and self.quantization.lower() not in QUANTIZATION_METHODS:
            raise not_supported_yet("quantization", self.quantization,
                                    f"Supported: {', '.join(QUANTIZATION_METHODS)}.")
        if self.enable_prompt_embeds:
            raise not_supported_yet("enable_prompt_embeds", True)
        self._resolve(download_dir)

    def _resolve(self, download_dir: str | None) -> None:
        if self.tokenizer is None and self.tokenizer_revision is not None:
            # As in vLLM, the tokenizer defaults to the model's repo, whose files at tokenizer_revision it then uses.
            self.tokenizer = self.model
        from tokenmill.transformers_utils.config import get_hf_config, get_max_model_len
        from tokenmill.transformers_utils.resolve import resolve_model
        self.resolved = resolve_model(self.model, self.revision, download_dir=download_dir)
        self.hf_config = get_hf_config(self.resolved, trust_remote_code=self.trust_remote_code,
                                       revision=self.revision, hf_overrides=self.hf_overrides,
                                       hf_config_path=self.hf_config_path, code_revision=self.code_revision)
        if callable(self.hf_overrides):
            # Applied: hf_config carries its result. Keep no function in the config, which worker processes get
            # pickled (a lambda does not pickle).
            self.hf_overrides = {}
        archs = getattr(self.hf_config, "architectures", None) or []
        if archs:
            self.architecture = archs[0]
        else:  # GGUF-derived configs name only a model_type
            # Upward import (config -> models), allowed in tests/test_import_layers.py: the registry is the one table
            # of families, a name table that imports no model code, so a new family stays one registry line.
            from tokenmill.models.registry import architecture_for_model_type
            self.architecture = architecture_for_model_type(getattr(self.hf_config, "model_type", None))
        derived, source = get_max_model_len(self.hf_config), "from its config"
        window = self.sliding_window
        if self.disable_sliding_window and window and window < derived:
            # vLLM: without its sliding window a model attends in full, over at most the window's length.
            derived, source = window, "its sliding window, with disable_sliding_window"
        if self.max_model_len is None:
            self.max_model_len = derived
        elif self.max_model_len > derived:
            raise ValueError(f"max_model_len ({self.max_model_len}) is larger than the model's maximum context "
                             f"length ({derived}, {source}). Lower max_model_len.")
        if self.served_model_name is None:
            self.served_model_name = [self.model if self.model else "SmolLM2-135M-Instruct"]
        elif isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]

    @property
    def sliding_window(self) -> int | None:
        """The model's attention window, None for full attention (transformers_utils.config.config_sliding_window:
        a window the architecture's HF code does not apply counts as none)."""
        from tokenmill.transformers_utils.config import config_sliding_window
        return config_sliding_window(self.hf_config)

    @property
    def is_gguf(self) -> bool:
        return self.resolved.gguf_file is not None

    def get_torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPE_MAP[self.dtype]
        if device.type == "cpu":
            return torch.float32
        cfg = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        if isinstance(cfg, str):
            cfg = getattr(torch, cfg, None)
        if cfg in (torch.float16, torch.bfloat16):
            return cfg
        return torch.bfloat16

    @property
    def vocab_size(self) -> int:
        return self.get_text_config().vocab_size  # multimodal configs (Gemma 3) keep it on the text config

    def __getstate__(self) -> dict[str, Any]:
        # Pickled for the engine-core and worker processes, which only read the HF config: a snapshot of it there
        # keeps transformers (seconds of imports) off their start-up (transformers_utils/config_snapshot.py).
        state = self.__dict__.copy()
        if state.get("hf_config") is not None:
            from tokenmill.transformers_utils.config_snapshot import snapshot
            state["hf_config"] = snapshot(state["hf_config"])
        return state

    def get_text_config(self) -> Any:
        get = getattr(self.hf_config, "get_text_config", None)
        return get() if get else self.hf_config

    # vLLM's ModelConfig accessors, which scripts call (llm.llm_engine.model_config.get_vocab_size()).
    @property
    def hf_text_config(self) -> Any:
        return self.get_text_config()

    def get_vocab_size(self) -> int:
        return self.vocab_size

    def get_hidden_size(self) -> int:
        return self.get_text_config().hidden_size
