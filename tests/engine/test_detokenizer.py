"""IncrementalDetokenizer against the real SmolLM2 byte-level BPE tokenizer: final text == tokenizer.decode."""
from __future__ import annotations

import random
import time

import pytest

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.sampling_params import SamplingParams

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "Emoji: 🎉👍🏽 👨‍👩‍👧‍👦 ok 🇯🇵 done",
    "Mixed: naïve café — Ünïcödé ✓ 日本語のテキスト and code `x = y + 1`\n\tdone.",
]




def feed(tok, ids, params, prompt=None, rng=None, final=True):
    """Feeds ids in random-size chunks; returns (detokenizer, streamed deltas, cumulative snapshots, stop)."""
    d = IncrementalDetokenizer(tok, prompt if prompt is not None else tok.encode("Hi there."), params)
    deltas, snaps, stop = [], [], None
    i = 0
    rng = rng or random.Random(0)
    while i < len(ids) and stop is None:
        step = ids[i:i + rng.randint(1, 3)]
        i += len(step)
        last = i >= len(ids)
        stop = d.update(step, final=final and last)
        done = stop is not None or (final and last)
        deltas.append(d.get_next_output_text(done, delta=True))
        snaps.append(d.get_next_output_text(done, delta=False))
    return d, deltas, snaps, stop


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_text_round_trip_never_shows_replacement_char(tokenizer, text, skip):
    ids = tokenizer.encode(text)
    d, deltas, snaps, _ = feed(tokenizer, ids, SamplingParams(skip_special_tokens=skip))
    assert d.output_text == tokenizer.decode(ids, skip_special_tokens=skip) == text
    assert "".join(deltas) == text
    assert all("\ufffd" not in s for s in deltas + snaps)
    # One token at a time too: every intermediate text is a prefix of the final one.
    d2 = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
    for t in ids:
        d2.update([t])
        assert "\ufffd" not in d2.output_text and text.startswith(d2.output_text)
    assert d2.output_text == text  # nothing was held back at the end of valid text


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_sequences_match_decode(tokenizer, skip):
    rng = random.Random(1234)
    vocab = len(tokenizer)
    for trial in range(60):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        if trial % 3 == 0:  # sprinkle special tokens in
            ids[rng.randrange(len(ids))] = rng.randrange(17)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=bool(trial % 2))
        d, deltas, _, _ = feed(tokenizer, ids, params, prompt=prompt, rng=rng)
        expected = tokenizer.decode(ids, skip_special_tokens=skip)
        assert d.output_text == expected, (ids, prompt)
        assert "".join(deltas) == expected
        assert d.token_ids == ids


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nSure! 好的<|im_end|><|endoftext|>")
    assert 1 in ids and 2 in ids
    kept, _, _, _ = feed(tokenizer, ids, SamplingParams(skip_special_tokens=False))
    skipped, _, _, _ = feed(tokenizer, ids, SamplingParams(skip_special_tokens=True))
    nospace, _, _, _ = feed(tokenizer, ids, SamplingParams(skip_special_tokens=False,
                                                           spaces_between_special_tokens=False))
    assert kept.output_text == "<|im_start|>assistant\nSure! 好的<|im_end|><|endoftext|>"
    assert skipped.output_text == "assistant\nSure! 好的" == tokenizer.decode(ids, skip_special_tokens=True)
    assert nospace.output_text == kept.output_text  # byte-level BPE puts no spaces between tokens anyway


def test_incomplete_character_flushed_only_at_the_end(tokenizer):
    ids = tokenizer.encode("你好")[:1]  # the first byte(s) of 你
    d = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    d.update(ids)
    assert d.output_text == ""  # held back: might still be completed
    d.update([], final=True)
    assert d.output_text == tokenizer.decode(ids) and "\ufffd" in d.output_text


def test_stop_token_terminated_last_token_not_detokenized(tokenizer):
    ids = tokenizer.encode("Hello world")
    for include in (False, True):
        d = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop_token_ids=[ids[-1]],
                                                                 include_stop_str_in_output=include))
        d.update(ids, stop_terminated=True, final=True)
        assert d.token_ids == ids
        assert d.output_text == ("Hello world" if include else tokenizer.decode(ids[:-1]))


def test_detokenize_off_or_no_tokenizer_tracks_ids_only(tokenizer):
    for d in (IncrementalDetokenizer(tokenizer, [1, 2], SamplingParams(detokenize=False)),
              IncrementalDetokenizer(None, [1, 2], SamplingParams())):
        assert d.update([5, 6, 7]) is None
        assert d.token_ids == [5, 6, 7] and d.output_text == "" and d.get_next_output_text(True, True) == ""
    with pytest.raises(ValueError):
        IncrementalDetokenizer(None, [], SamplingParams(stop=["x"]))


# ----- stop strings -----
def _expected(text, stops, include):
    """The stop string that completes first (earliest end, then earliest start) ends the text."""
    hits = [(text.find(s) + len(s), text.find(s), i, s) for i, s in enumerate(stops) if text.find(s) != -1]
    if not hits:
        return text, None
    _, pos, _, s = min(hits)
    return text[:pos + (len(s) if include else 0)], s


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("text,stops", [
    ("Hello world, how are you today?", ["how are"]),          # spans tokens
    ("Hello world, how are you today?", ["Hel"]),              # at the very start
    ("Hello world, how are you today?", ["wor"]),              # mid-token: the rest of " world" is dropped
    ("Hello world, how are you today?", ["today", "world", "zzz"]),  # several: the first completed wins
    ("Hello world, how are you today?", ["world, how are", "how"]),   # "how" completes first, though it starts later
    ("你好，世界！今天天气很好", ["世界"]),
    ("Party 🎉👍 time", ["👍"]),
    ("no stop here at all", ["xyz", "qq"]),
])
def test_stop_strings(tokenizer, text, stops, include):
    ids = tokenizer.encode(text)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    for seed in range(4):
        d, deltas, snaps, stop = feed(tokenizer, ids, params, rng=random.Random(seed))
        want, want_stop = _expected(text, stops, include)
        assert (d.output_text, stop) == (want, want_stop)
        assert "".join(deltas) == want == snaps[-1]
        # A streaming client never sees text that is later taken back (e.g. the start of a stop string).
        assert all(want.startswith(s) for s in snaps)
        if stop is not None:
            assert len(d.token_ids) <= len(ids)  # ids are kept as generated up to the stopping step


def test_streaming_holds_back_a_possible_stop_string(tokenizer):
    d = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP"]))
    d.update(tokenizer.encode("abc ST"))
    assert d.output_text == "abc ST"
    assert d.get_next_output_text(False, delta=False) == "abc"  # the last 3 characters could begin "STOP"
    assert d.get_next_output_text(False, delta=True) == "abc"
    assert d.update(tokenizer.encode("OP and more")) == "STOP"
    assert d.output_text == "abc " and d.get_next_output_text(True, delta=True) == " "


def test_random_stop_strings_property(tokenizer):
    rng = random.Random(7)
    for _ in range(100):
        text = rng.choice(TEXTS)
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(text))
            stops.append(text[a:a + rng.randint(1, 6)])
        include = rng.random() < 0.5
        ids = tokenizer.encode(text)
        d, deltas, snaps, stop = feed(tokenizer, ids, SamplingParams(stop=stops, include_stop_str_in_output=include),
                                      rng=rng)
        want, want_stop = _expected(text, stops, include)
        assert d.output_text == want and "".join(deltas) == want
        assert all(want.startswith(s) for s in snaps)
        assert (stop is None) == (want_stop is None)


def test_min_tokens_suppresses_early_stop_strings(tokenizer):
    ids = tokenizer.encode("stop here then stop again")
    d = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["stop"], min_tokens=2))
    stop = None
    for t in ids:
        stop = d.update([t])
        if stop:
            break
    assert stop == "stop" and d.output_text == "stop here then "


def test_work_per_token_stays_bounded(tokenizer):
    ids = tokenizer.encode(" ".join(TEXTS) * 40)
    d = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["never-appears"]))
    t0 = time.perf_counter()
    for t in ids:
        d.update([t])
        d.get_next_output_text(False, delta=True)
    elapsed = time.perf_counter() - t0
    assert len(d._window._ids) < 100 and len(d._chunks) < 600  # the window and the chunk list do not grow
    assert d.output_text == tokenizer.decode(ids)
    assert elapsed / len(ids) < 200e-6, elapsed / len(ids)


class _SlowTokenizer:
    """Only `decode`, like a tokenizer without a Rust backend: exercises the generic path."""

    def __init__(self, tok):
        self._tok = tok

    def decode(self, ids, skip_special_tokens=False, spaces_between_special_tokens=True,
               clean_up_tokenization_spaces=False):
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("skip", [True, False])
def test_tokenizer_without_rust_backend(tokenizer, skip):
    slow = _SlowTokenizer(tokenizer)
    rng = random.Random(99)
    for text in TEXTS:
        ids = tokenizer.encode(text) + [2, rng.randrange(len(tokenizer))]
        d, deltas, _, _ = feed(slow, ids, SamplingParams(skip_special_tokens=skip), prompt=[], rng=rng)
        assert d.output_text == "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_prompt_context_keeps_sentencepiece_leading_space():
    """Deliberate difference from decode(output_ids), shared with vLLM: the prompt's last tokens seed the decoder,
    so a sentencepiece-style first output token keeps the space it has inside prompt + output."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers
    tok = tokenizers.Tokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "!": 2, "<unk>": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    d = IncrementalDetokenizer(tok, [0], SamplingParams())
    d.update([1, 2])
    assert d.output_text == " world!"
    assert tok.decode([1, 2]) == "world!" and tok.decode([0, 1, 2]) == "Hello world!"
    bare = IncrementalDetokenizer(tok, [], SamplingParams())
    bare.update([1, 2])
    assert bare.output_text == "world!"
