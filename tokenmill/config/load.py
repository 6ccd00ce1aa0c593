"""Weight-loading configuration."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config.utils import check_choices, config_field, not_supported_yet

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy", "pt", "npcache", "bitsandbytes", "sharded_state",
                "tensorizer", "mistral", "runai_streamer")
SUPPORTED_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass
class LoadConfig:
    """Where weights come from and how they are read."""
    load_format: str = config_field("auto", help="auto: GGUF for .gguf models, else safetensors; dummy: random "
                                                 "weights (benchmarks).", choices=LOAD_FORMATS)
    download_dir: str | None = config_field(None, help="Hugging Face cache directory to look in "
                                                       "(tokenmill never downloads).")
    model_loader_extra_config: dict = config_field(help="Extra options for the loader.", default_factory=dict)
    ignore_patterns: list[str] = config_field(help="File patterns to skip when loading.",
                                              default_factory=lambda: ["original/**/*"])
    use_tqdm_on_load: bool = config_field(True, help="Show a progress bar while loading weights.")
    safetensors_load_strategy: str | None = config_field(None, help="lazy (memory-mapped, the default) or eager.",
                                                         choices=("lazy", "eager", "prefetch"))
    pt_load_map_location: str = config_field("cpu", help="map_location for .pt checkpoints.")

    def __post_init__(self) -> None:
        check_choices(self)
        if self.model_loader_extra_config:
            raise not_supported_yet("model_loader_extra_config", self.model_loader_extra_config)
        if list(self.ignore_patterns) != ["original/**/*"]:
            raise not_supported_yet("ignore_patterns", self.ignore_patterns,
                                    "Only the default (skip original/**) is applied.")
        if self.safetensors_load_strategy not in (None, "lazy"):
            raise not_supported_yet("safetensors_load_strategy", self.safetensors_load_strategy,
                                    "Safetensors files are always memory-mapped (lazy).")
        if self.pt_load_map_location != "cpu":
            raise not_supported_yet("pt_load_map_location", self.pt_load_map_location, ".pt checkpoints are not read.")
        if self.load_format not in SUPPORTED_LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r} is not supported yet by tokenmill; supported: "
                             f"{', '.join(SUPPORTED_LOAD_FORMATS)}.")
