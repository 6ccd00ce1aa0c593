"""The draft model of `--speculative-config '{"model": ..., "num_speculative_tokens": k}'`: its ModelConfig, checked
against the target's so a draft that cannot serve is refused at start-up, naming the key."""
from __future__ import annotations

from tokenmill.config.model import ModelConfig
from tokenmill.config.utils import not_supported_yet
from tokenmill.logger import init_logger

logger = init_logger(__name__)
FLAG = "--speculative-config"


def draft_model_config(spec, target: ModelConfig, tensor_parallel_size: int) -> ModelConfig:
    """The draft's ModelConfig: the target's dtype, seed and remote-code setting; its own quantization and
    revisions; a context of min(spec max_model_len, the draft's own limit, the target's max_model_len) (requests
    that grow past it decode on without drafts)."""
    tp = spec.draft_tensor_parallel_size
    if tp is not None and tp != tensor_parallel_size:
        raise not_supported_yet("speculative_config", {"draft_tensor_parallel_size": tp},
                                f"The draft model runs with the target's tensor_parallel_size "
                                f"({tensor_parallel_size}); leave `draft_tensor_parallel_size` unset or give that.")
    try:
        probe = ModelConfig(model=spec.model, dtype=target.dtype, seed=target.seed,
                            trust_remote_code=target.trust_remote_code, quantization=spec.quantization,
                            revision=spec.revision, code_revision=spec.code_revision, skip_tokenizer_init=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{FLAG}: the draft `model` {spec.model!r} cannot be used: {e}") from None
    limit = min(probe.max_model_len, target.max_model_len)
    if spec.max_model_len is not None:
        if spec.max_model_len > probe.max_model_len:
            raise ValueError(f"{FLAG}: `max_model_len` ({spec.max_model_len}) is larger than the draft model's "
                             f"context length ({probe.max_model_len}).")
        limit = min(limit, spec.max_model_len)
    probe.max_model_len = limit
    _check_architecture(probe)
    _check_vocabulary(probe, target)
    if limit < target.max_model_len:
        logger.info("Draft model %s: context %d tokens (the target's is %d); longer requests decode without drafts.",
                    spec.model, limit, target.max_model_len)
    return probe


def _check_architecture(draft: ModelConfig) -> None:
    text = draft.get_text_config()
    if "linear_attention" in (getattr(text, "layer_types", None) or []):
        raise not_supported_yet("speculative_config", {"model": draft.model},
                                f"The draft {draft.architecture} has recurrent (linear_attention) layers, whose "
                                "state a rejected draft would need rolled back.")
    if draft.sliding_window or "sliding_attention" in (getattr(text, "layer_types", None) or []):
        raise not_supported_yet("speculative_config", {"model": draft.model},
                                f"The draft {draft.architecture} uses sliding-window attention; a draft model runs "
                                "in the target's block tables, which it needs with full attention.")


def _check_vocabulary(draft: ModelConfig, target: ModelConfig) -> None:
    """Token ids must mean the same text in both: the tokenizers' vocabularies are compared when both load
    (checkpoints pad vocab_size differently, e.g. 151936 and 152064 in one Qwen family); without a tokenizer the
    config vocab sizes must be equal."""
    from tokenmill.transformers_utils.tokenizer import get_tokenizer
    try:
        theirs = get_tokenizer(draft.resolved, trust_remote_code=draft.trust_remote_code).get_vocab()
        ours = get_tokenizer(target.resolved, tokenizer=target.tokenizer, tokenizer_mode=target.tokenizer_mode,
                             trust_remote_code=target.trust_remote_code).get_vocab()
    except (OSError, ValueError, TypeError) as e:
        logger.info("Draft model: no tokenizer to compare (%s); comparing vocab sizes.", type(e).__name__)
        theirs = ours = None
    if theirs is not None:
        if theirs != ours:
            differ = sorted(set(theirs.items()) ^ set(ours.items()))[:3]
            raise ValueError(f"{FLAG}: the draft `model` {draft.model!r} has a different tokenizer from the target "
                             f"{target.model!r} ({len(theirs)} against {len(ours)} tokens; e.g. {differ}); a draft "
                             "must share the target's vocabulary.")
    elif draft.vocab_size != target.vocab_size:
        raise ValueError(f"{FLAG}: the draft `model` {draft.model!r} has vocab_size {draft.vocab_size}, the target "
                         f"{target.vocab_size}; a draft must share the target's vocabulary.")
