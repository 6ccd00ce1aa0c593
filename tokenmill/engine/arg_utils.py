"""vLLM's import path for the engine-argument classes (`vllm.engine.arg_utils`); they live in tokenmill.config."""
from tokenmill.config.engine_args import AsyncEngineArgs, EngineArgs

__all__ = ["EngineArgs", "AsyncEngineArgs"]
