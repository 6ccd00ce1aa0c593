"""Load the HF tokenizer of a resolved model from local files (or from the GGUF file itself).

Converting a GGUF vocabulary into an HF tokenizer costs 2.5-5 s (SmolLM2's 49k tokens and merges, decoded in Python),
so the converted tokenizer is saved once with `save_pretrained` under TOKENMILL_CACHE_DIR and reloaded from there
(~0.1 s). Nothing is cached in memory: every call returns a fresh tokenizer.
"""
from __future__ import annotations

from tokenmill.logger import init_logger
from tokenmill.transformers_utils.resolve import ResolvedModel, cached_from_gguf, resolve_model

logger = init_logger(__name__)

TOKENIZER_MODES = ("auto", "hf", "slow", "mistral")
_SUPPORTED_MODES = ("auto", "hf", "slow")

# GGUF metadata key -> tokenizer special-token attribute.
_GGUF_SPECIAL_TOKENS = {
    "tokenizer.ggml.bos_token_id": "bos_token",
    "tokenizer.ggml.eos_token_id": "eos_token",
    "tokenizer.ggml.unknown_token_id": "unk_token",
    "tokenizer.ggml.padding_token_id": "pad_token",
}


def _check_mode(tokenizer_mode: str) -> None:
    if tokenizer_mode == "mistral":
        raise ValueError(
            "tokenizer_mode='mistral' (mistral_common tokenizers) is not supported yet. Supported modes: "
            f"{', '.join(_SUPPORTED_MODES)}."
        )
    if tokenizer_mode not in _SUPPORTED_MODES:
        raise ValueError(
            f"Unknown tokenizer_mode {tokenizer_mode!r}. Allowed values: {', '.join(TOKENIZER_MODES)} "
            "('mistral' is not supported yet)."
        )


def _gguf_special_tokens(gguf_path: str, tok) -> dict[str, str]:
    """The special tokens the GGUF metadata names, as {attribute: token text} (texts looked up in `tok`, whose
    vocabulary is the GGUF's token list)."""
    from tokenmill.transformers_utils.gguf import read_gguf_metadata

    metadata = read_gguf_metadata(gguf_path, frozenset(_GGUF_SPECIAL_TOKENS))
    out = {}
    for key, attr in _GGUF_SPECIAL_TOKENS.items():
        token_id = metadata.get(key)
        if isinstance(token_id, int) and 0 <= token_id < len(tok):
            text = tok.convert_ids_to_tokens(token_id)
            if isinstance(text, str):
                out[attr] = text
    return out


def _build_gguf_tokenizer(resolved: ResolvedModel, use_fast: bool, directory: str) -> None:
    """Convert the GGUF's tokenizer with transformers, fix its special tokens from the GGUF metadata, save it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        resolved.path, gguf_file=resolved.gguf_file, use_fast=use_fast, local_files_only=True
    )
    # transformers' converter does not always honour the GGUF's special-token ids (5.17 makes SmolLM2's
    # <|im_start|> its EOS; the GGUF says <|im_end|>). The GGUF metadata is the authority.
    for attr, text in _gguf_special_tokens(resolved.gguf_path, tok).items():
        if getattr(tok, attr, None) != text:
            logger.debug("GGUF tokenizer: setting %s to %r (transformers gave %r)", attr, text, getattr(tok, attr))
            setattr(tok, attr, text)
    tok.save_pretrained(directory)


def get_tokenizer(
    resolved: ResolvedModel,
    tokenizer: str | None = None,
    tokenizer_mode: str = "auto",
    trust_remote_code: bool = False,
    revision: str | None = None,
):
    """A transformers tokenizer for `resolved` (or for `tokenizer`, a local path or cached repo id, when given).

    tokenizer_mode: "auto"/"hf" -> the fast tokenizer; "slow" -> use_fast=False (transformers 5 loads the fast
    tokenizer regardless for most models); "mistral" -> not supported yet (ValueError). For GGUF models the
    vocabulary, special tokens and chat template come from the GGUF file. Local files only, never the network.
    """
    from transformers import AutoTokenizer

    _check_mode(tokenizer_mode)
    use_fast = tokenizer_mode != "slow"
    source = resolve_model(tokenizer, revision, for_tokenizer=True) if tokenizer is not None else resolved

    if source.gguf_file is not None:
        kind = "tokenizer" if use_fast else "tokenizer-slow"
        tok = cached_from_gguf(
            source.gguf_path,
            kind,
            lambda d: _build_gguf_tokenizer(source, use_fast, d),
            lambda d: AutoTokenizer.from_pretrained(d, use_fast=use_fast, local_files_only=True),
        )
    else:
        # `source.path` is already the local snapshot of `revision`, so no revision is passed on.
        tok = AutoTokenizer.from_pretrained(
            source.path, use_fast=use_fast, trust_remote_code=trust_remote_code, local_files_only=True
        )
    if not use_fast and getattr(tok, "is_fast", False):
        logger.info("tokenizer_mode='slow': transformers has no slow tokenizer for %s; using the fast one.",
                    source.name)
    if use_fast and not getattr(tok, "is_fast", True):
        logger.warning("Using a slow (pure Python) tokenizer for %s; detokenization will be slower.", source.name)
    return tok


def load_tokenizer(model_config):
    """The tokenizer a config.ModelConfig names (its resolved model, tokenizer, tokenizer_mode, revisions), or None
    when skip_tokenizer_init is set. The engine's front end and the structured-output manager both load it so."""
    mc = model_config
    if mc.skip_tokenizer_init:
        return None
    tok = get_tokenizer(mc.resolved, tokenizer=mc.tokenizer, tokenizer_mode=mc.tokenizer_mode,
                        trust_remote_code=mc.trust_remote_code, revision=mc.tokenizer_revision or mc.revision)
    # A generative model's prompt truncated (tokenization_kwargs truncation / max_length) keeps its end, as vLLM
    # loads its tokenizer for the generate runner.
    tok.truncation_side = "left"
    return tok
