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
    """A tail that is not one character's first bytes (two lead bytes, a stray continuation byte pair) keeps the
    old behaviour: the output is decoded on its own."""
    lead = tokenizer.encode("你")[0]  # the first two bytes of 你 (a lead byte and a continuation byte)
    out = tokenizer.encode("好!")
    for prompt in ([lead, lead], tokenizer.encode("ok") + [lead, lead]):
        assert tokenizer.decode(prompt).endswith("\ufffd\ufffd")
        d = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
        d.update(out, final=True)
        assert d.output_text == tokenizer.decode(out) == "好!"


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
