"""Multi-byte text across the prompt / output boundary: a prompt given as token ids that ends inside a character
(e.g. the continuation of an output that max_tokens cut mid-character), through the detokenizer and the
OutputProcessor in every output kind."""
from __future__ import annotations

import pytest

from tokenmill.core.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

TEXT = "Repeat: 你好，世界！😀 机器学习"


def split_inside_characters(tok, text):
    """(cut, ids) for every cut of `text`'s ids that leaves the prompt ids[:cut] ending inside a character."""
    ids = tok.encode(text)
    return ids, [c for c in range(1, len(ids)) if tok.decode(ids[:c]).endswith("\ufffd")]


def test_prompt_ending_mid_character_gives_the_output_the_whole_character(tokenizer):
    ids, cuts = split_inside_characters(tokenizer, TEXT)
    assert len(cuts) >= 5  # 你, 好, 世, 界, 😀 (two cuts), ...
    for cut in cuts:
        prompt, output = ids[:cut], ids[cut:]
        head = tokenizer.decode(prompt).rstrip("\ufffd")
        want = TEXT[len(head):]
        for step in (1, 2, len(output)):
            d = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
            deltas = []
            for i in range(0, len(output), step):
                d.update(output[i:i + step], final=i + step >= len(output))
                deltas.append(d.get_next_output_text(i + step >= len(output), delta=True))
            assert d.output_text == want, (cut, step)
            assert "".join(deltas) == want and all("\ufffd" not in s for s in deltas)


def test_prompt_token_with_text_before_the_cut_character(tokenizer):
    """A byte-level token can hold a space and a character's first byte ("ĠÐ"): the space is the prompt's, the
    character the output's."""
    space_lead = tokenizer.convert_tokens_to_ids("ĠÐ")
    assert tokenizer.decode([space_lead]) == " \ufffd"
    rest = next(t for t in range(len(tokenizer)) if tokenizer.decode([space_lead, t]) == " С")
    prompt, output = tokenizer.encode("Word:") + [space_lead], [rest] + tokenizer.encode("ок!")
    d = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas = []
    for t in output:
        d.update([t])
        deltas.append(d.get_next_output_text(False, delta=True))
    assert d.output_text == "".join(deltas) == "Сок!"


def test_prompt_ending_mid_character_stop_string_on_that_character(tokenizer):
    ids = tokenizer.encode("你好，世界")
    cut = next(c for c in range(1, len(ids)) if tokenizer.decode(ids[:c]) == "你\ufffd")
    for include, want in ((False, ""), (True, "好")):
        d = IncrementalDetokenizer(tokenizer, ids[:cut], SamplingParams(stop=["好"], include_stop_str_in_output=include))
        stop = None
        for t in ids[cut:]:
            stop = d.update([t])
            if stop:
                break
        assert (stop, d.output_text) == ("好", want)


def test_invalid_prompt_tail_is_not_joined_to_the_output(tokenizer):
    """A tail of more U+FFFDs than one character's first bytes can make (a run of lead bytes) keeps the output
    decoded on its own."""
    lead = tokenizer.encode("你")[0]  # the first two bytes of 你 (a lead byte and a continuation byte)
    out = tokenizer.encode("好!")
    for prompt in ([lead] * 4, tokenizer.encode("ok") + [lead] * 4):
        assert tokenizer.decode(prompt).endswith("\ufffd" * 4)
        d = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
        d.update(out, final=True)
        assert d.output_text == tokenizer.decode(out) == "好!"


def test_byte_fallback_prompt_ending_mid_character():
    """Sentencepiece-style byte fallback (Llama 2, Mistral): each <0xNN> piece of an incomplete character decodes
    to a U+FFFD of its own."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, normalizers
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "\u2581ok": 257, "\u2581": 258}
    tok = tokenizers.Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    text = " ok 你好 🎉 ok"
    ids = tok.encode(text).ids
    cuts = [c for c in range(1, len(ids)) if tok.decode(ids[:c]).endswith("\ufffd")]
    assert len(cuts) == 2 + 2 + 3  # inside 你, 好 and 🎉
    for cut in cuts:
        # Not decode(ids[:cut]): a byte run that is not valid UTF-8 as a whole decodes to U+FFFDs only.
        cut_bytes = sum(1 if tok.id_to_token(t).startswith("<0x") else len(tok.decode([t]).encode())
                        for t in ids[:cut])
        head = max((text[:i] for i in range(len(text) + 1) if len(text[:i].encode()) <= cut_bytes), key=len)
        d = IncrementalDetokenizer(tok, ids[:cut], SamplingParams())
        deltas = []
        for t in ids[cut:]:
            d.update([t])
            deltas.append(d.get_next_output_text(False, delta=True))
        assert d.output_text == "".join(deltas) == text[len(head):], cut


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE,
                                  RequestOutputKind.FINAL_ONLY])
def test_output_processor_continuation_of_a_cut_character(tokenizer, kind):
    ids, cuts = split_inside_characters(tokenizer, "答案：机器学习")
    cut = cuts[-1]
    prompt, output = ids[:cut], ids[cut:]
    want = "答案：机器学习"[len(tokenizer.decode(prompt).rstrip("\ufffd")):]
    op = OutputProcessor(tokenizer)
    for i in range(2):
        op.add_request(EngineCoreRequest(f"{i}_r", prompt, SamplingParams(n=1, output_kind=kind), 0.0), None, "r",
                       i, 2)
    texts = {0: [], 1: []}
    for k, t in enumerate(output):
        last = k == len(output) - 1
        res = op.process_outputs([EngineCoreOutput(f"{i}_r", [t], finish_reason=FinishReason.LENGTH if last else None)
                                  for i in range(2)])
        for out in res.request_outputs:
            for c in out.outputs:
                texts[c.index].append(c.text)
    for i in range(2):
        seen = texts[i]
        assert all("\ufffd" not in s for s in seen)
        assert ("".join(seen) if kind == RequestOutputKind.DELTA else seen[-1]) == want
