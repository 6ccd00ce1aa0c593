"""tokenmill: a high-throughput LLM inference and serving engine with vLLM's interfaces."""
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
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")


__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestOutputKind", "__version__"]
