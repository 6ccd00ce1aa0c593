"""TokenBytes: a token's own UTF-8 bytes, so the pieces of a character split across tokens concatenate to it."""
from __future__ import annotations

import pytest

from tokenmill.engine.logprobs import TokenBytes, TokenTextCache

TEXTS = ["你好，世界！", "Emoji 🎉👍🏽 👨‍👩‍👧 ok", "naïve café 日本語"]


def rebuilt(tok, ids):
    text, token_bytes = TokenTextCache(tok), TokenBytes(tok)
    return bytes(b for tid in ids for b in token_bytes(tid, text(tid))).decode("utf-8")


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_bpe_pieces_concatenate_to_the_text(tokenizer, text):
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids) or text.isascii()
    assert rebuilt(tokenizer, ids) == text


def test_byte_fallback_tokens_are_their_byte():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, normalizers
    vocab = {"<unk>": 0}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁Hello", "▁", "好"]:
        vocab[piece] = len(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    text = " Hello 你好 🎉"
    ids = tok.encode(text).ids
    assert vocab["<0xE4>"] in ids
    assert rebuilt(tok, ids) == text


def test_a_whole_token_is_its_text_and_unknown_ids_fall_back(tokenizer):
    tb = TokenBytes(tokenizer)
    assert tb(28120, "Hello") == list(b"Hello")
    assert tb(10 ** 9, "\ufffd") == list("\ufffd".encode())  # not in the vocabulary: the text's bytes
