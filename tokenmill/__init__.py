"""tokenmill: a high-throughput LLM inference and serving engine with vLLM's interfaces."""
from tokenmill.inputs import PromptType, TextPrompt, TokensPrompt
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the engine; import it lazily so `import tokenmill` stays cheap.
    if name == "LLM":
        from tokenmill.entrypoints.llm import LLM
        return LLM
    if name == "LLMEngine":
        from tokenmill.engine.llm_engine import LLMEngine
        return LLMEngine
    if name in ("AsyncLLM", "AsyncLLMEngine"):  # vLLM's AsyncLLMEngine is its AsyncLLM
        from tokenmill.engine.async_llm import AsyncLLM
        return AsyncLLM
    if name in ("EngineArgs", "AsyncEngineArgs"):
        from tokenmill.config import engine_args
        return getattr(engine_args, name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")


__all__ = ["LLM", "LLMEngine", "AsyncLLM", "AsyncLLMEngine", "EngineArgs", "AsyncEngineArgs", "SamplingParams",
           "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind", "PromptType", "TextPrompt",
           "TokensPrompt", "__version__"]
