"""Reasoning parsers (deepseek_r1, qwen3): whole-output results, and streaming in every chunking equals them."""
from __future__ import annotations

import random

import pytest

from tokenmill.parsers.reasoning import reasoning_parsers
from tokenmill.parsers.reasoning.think_tags import DeepSeekR1ReasoningParser, Qwen3ReasoningParser


def splits(text: str):
    """Every fixed chunk size 1..len, plus a few random splits."""
    for size in range(1, max(len(text), 1) + 1):
        yield [text[i:i + size] for i in range(0, len(text), size)]
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def stream(parser, chunks, **kw):
    s = parser.new_stream(**kw)
    reasoning, content = [], []
    for chunk in chunks:
        d = s.feed(chunk)
        reasoning.append(d.reasoning)
        content.append(d.content)
    d = s.finish()
    reasoning.append(d.reasoning)
    content.append(d.content)
    return "".join(reasoning) or None, "".join(content) or None, s.reasoning_ended


R1, QWEN3 = DeepSeekR1ReasoningParser(None), Qwen3ReasoningParser(None)

CASES = [
    # DeepSeek-R1: prompt ends with "<think>\n", so the output usually has no opening tag.
    ("r1-no-open-tag", R1, "Okay, the user asks 2+2. That is 4.\n</think>\n\nThe answer is **4**.", {},
     ("Okay, the user asks 2+2. That is 4.\n", "The answer is **4**.")),
    ("r1-with-open-tag", R1, "<think>\nLet me think: 3*7=21.\n</think>\n\n21", {},
     ("\nLet me think: 3*7=21.\n", "21")),
    ("r1-chinese", R1, "嗯，用户问的是天气。我应该先确认城市。\n</think>\n\n请问您想查询哪个城市的天气？", {},
     ("嗯，用户问的是天气。我应该先确认城市。\n", "请问您想查询哪个城市的天气？")),
    ("r1-truncated", R1, "Hmm, this needs a long derivation. First, consider the integral of x^2 from 0 to", {},
     ("Hmm, this needs a long derivation. First, consider the integral of x^2 from 0 to", None)),
    ("r1-truncated-partial-end-tag", R1, "So the result is 5.\n</thi", {}, ("So the result is 5.\n</thi", None)),
    ("r1-empty-reasoning", R1, "</think>\n\nHello!", {}, (None, "Hello!")),
    ("r1-content-indent-kept", R1, "code time</think>\n    return x", {}, ("code time", "    return x")),
    ("r1-later-tags-are-content", R1, "a</think>b<think>c</think>d", {}, ("a", "b<think>c</think>d")),
    ("r1-disabled", R1, "\nJust an answer.", {"enabled": False}, (None, "Just an answer.")),
    ("r1-angle-brackets", R1, "Compare a<b and b>c, see <thinking> vs </th>.</think>x<y", {},
     ("Compare a<b and b>c, see <thinking> vs </th>.", "x<y")),
    # Qwen3: the output opens the block itself.
    ("qwen3-thinking", QWEN3, "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello! How can I help?",
     {}, ("\nThe user greets me. I should greet back.\n", "Hello! How can I help?")),
    ("qwen3-empty-think", QWEN3, "<think>\n\n</think>\n\nParis is the capital of France.", {},
     ("\n\n", "Paris is the capital of France.")),
    ("qwen3-think-no-newlines", QWEN3, "<think></think>Hi", {}, (None, "Hi")),
    ("qwen3-no-tags", QWEN3, "Paris is the capital of France.", {}, (None, "Paris is the capital of France.")),
    ("qwen3-disabled", QWEN3, "Sure, here is the list:\n1. a\n2. b", {"enabled": False},
     (None, "Sure, here is the list:\n1. a\n2. b")),
    ("qwen3-disabled-literal-tags", QWEN3, "<think>x</think>y", {"enabled": False}, (None, "<think>x</think>y")),
    ("qwen3-truncated", QWEN3, "<think>\n用户想要一首诗。让我想想押韵", {}, ("\n用户想要一首诗。让我想想押韵", None)),
    ("qwen3-leading-newlines", QWEN3, "\n\n<think>r</think>c", {}, ("r", "c")),
    ("qwen3-tag-not-at-start-is-content", QWEN3, "Hello <think>x</think> y", {},
     (None, "Hello <think>x</think> y")),
    ("qwen3-partial-open-tag-only", QWEN3, "<thin", {}, (None, "<thin")),
    ("qwen3-stray-end-tag-is-content", QWEN3, "abc</think>def", {}, (None, "abc</think>def")),
    ("qwen3-prompt-opened", QWEN3, "The user wants code.\n</think>\n\n```py\nprint(1)\n```",
     {"prompt_opens_reasoning": True},
     ("The user wants code.\n", "```py\nprint(1)\n```")),
    ("qwen3-prompt-opened-repeated-tag", QWEN3, "<think>r</think>c", {"prompt_opens_reasoning": True}, ("r", "c")),
    ("qwen3-repeated-open-tag-dropped", QWEN3, "<think>a<think>b</think>c", {}, ("ab", "c")),
    ("empty", QWEN3, "", {}, (None, None)),
    ("r1-empty", R1, "", {}, (None, None)),
    ("qwen3-only-newlines-after", QWEN3, "<think>r</think>\n\n", {}, ("r", None)),
    # Qwen3.5 calls a tool from inside an unclosed block: the call is content (the tool parser's), not reasoning.
    ("qwen3.5-call-inside-thinking", QWEN3,
     "I need the weather.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n北京\n</parameter>\n</function>\n"
     "</tool_call>", {"prompt_opens_reasoning": True},
     ("I need the weather.\n", "<tool_call>\n<function=get_weather>\n<parameter=city>\n北京\n</parameter>\n"
      "</function>\n</tool_call>")),
    ("qwen3-call-inside-own-block", QWEN3, "<think>look it up<tool_call> <function name=\"f\">", {},
     ("look it up", "<tool_call> <function name=\"f\">")),
    ("qwen3-tool-call-mentioned", QWEN3, "<think>the <tool_call> tag wraps a call</think>ok", {},
     ("the <tool_call> tag wraps a call", "ok")),
    ("qwen3-json-call-stays-reasoning", QWEN3, "<think>x<tool_call>\n{\"name\": \"f\"}", {},
     ("x<tool_call>\n{\"name\": \"f\"}", None)),
    ("qwen3-truncated-before-function", QWEN3, "<think>x<tool_call>\n<func", {}, ("x<tool_call>\n<func", None)),
    ("qwen3-call-after-end-is-content", QWEN3, "<think>r</think><tool_call><function=f>", {},
     ("r", "<tool_call><function=f>")),
    ("r1-call-inside-thinking-stays-reasoning", R1, "r<tool_call>\n<function=f>", {},
     ("r<tool_call>\n<function=f>", None)),
]


@pytest.mark.parametrize("name,parser,text,kw,expected", CASES, ids=[c[0] for c in CASES])
def test_extract_and_stream(name, parser, text, kw, expected):
    assert parser.extract(text, **kw) == expected
    for chunks in splits(text):
        reasoning, content, _ = stream(parser, chunks, **kw)
        assert (reasoning, content) == expected, chunks


def test_holds_back_only_partial_tags():
    s = R1.new_stream()
    assert s.feed("Think").reasoning == "Think"
    assert s.feed("ing </thi").reasoning == "ing "  # only the partial tag is held
    assert not s.reasoning_ended
    d = s.feed("nk>\n\nAns")
    assert (d.reasoning, d.content) == ("", "Ans") and s.reasoning_ended
    assert s.feed("wer <").content == "wer <"  # no holding back in content
    assert s.finish().content == ""

    s = QWEN3.new_stream()
    assert s.feed("<th").content == "" and not s.reasoning_ended
    assert s.feed("ink>x<").reasoning == "x"
    assert s.feed("b").reasoning == "<b"

    s = QWEN3.new_stream(prompt_opens_reasoning=True)
    assert s.feed("r<tool").reasoning == "r"                  # a partial <tool_call> is held
    assert s.feed("_call>\n").reasoning == ""                 # so is the tag until what follows shows a call
    d = s.feed("<function=f>")
    assert (d.reasoning, d.content) == ("", "<tool_call>\n<function=f>") and s.reasoning_ended

    s = QWEN3.new_stream()
    assert s.feed("Hi").content == "Hi" and s.reasoning_ended


def test_reasoning_ended():
    assert R1.new_stream(enabled=False).reasoning_ended
    assert QWEN3.new_stream(enabled=False).reasoning_ended
    assert not R1.new_stream().reasoning_ended
    assert not QWEN3.new_stream().reasoning_ended  # undecided until the first text
    assert stream(R1, ["a</think>"])[2]
    assert not stream(R1, ["a"])[2]  # truncated thinking never ended
    assert stream(QWEN3, ["no thinking"])[2]


def test_prompt_opens_reasoning():
    r1_prompt = "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>\n"
    assert R1.prompt_opens_reasoning(r1_prompt)
    q_on = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    q_off = q_on + "<think>\n\n</think>\n\n"
    q_open = q_on + "<think>\n"
    history = "<|im_start|>assistant\n<think>\nold\n</think>\n\nold answer<|im_end|>\n" + q_on
    for p in (R1, QWEN3):
        assert not p.prompt_opens_reasoning(q_on)
        assert not p.prompt_opens_reasoning(q_off)
        assert p.prompt_opens_reasoning(q_open)
        assert not p.prompt_opens_reasoning(history)
        assert not p.prompt_opens_reasoning("")


def test_random_texts_stream_equals_extract():
    rng = random.Random(0)
    alphabet = ["<think>", "</think>", "<", "</", "<th", "</thi", ">", "\n", "a", "思", " ", "k>", "<tool_call>",
                "<function=", "<func", "<tool_", "tion "]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        for parser in (R1, QWEN3):
            for kw in ({}, {"prompt_opens_reasoning": True}, {"enabled": False}):
                expected = parser.extract(text, **kw)
                for chunks in list(splits(text))[:6] + [list(text)]:
                    assert stream(parser, chunks, **kw)[:2] == expected, (text, chunks, kw)


def test_registry_names():
    assert reasoning_parsers.get("qwen3") is Qwen3ReasoningParser
    assert reasoning_parsers.get("deepseek_r1") is DeepSeekR1ReasoningParser
    with pytest.raises(ValueError, match="available: .*deepseek_r1.*qwen3"):
        reasoning_parsers.get("nope")


# ---- the tokenizer must have the parser's tags (checked when the server builds the parser) ---------------------

@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_parser_refuses_a_tokenizer_without_think_tokens(name, smollm2_tokenizer):
    with pytest.raises(ValueError, match=rf"--reasoning-parser {name}: the tokenizer has no '<think>' or "
                                         r"'</think>' token"):
        reasoning_parsers.get(name)(smollm2_tokenizer)


def test_parser_names_only_the_missing_token(smollm2_tokenizer):
    import copy
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_tokens(["</think>"])
    with pytest.raises(ValueError, match="has no '<think>' token") as e:
        DeepSeekR1ReasoningParser(tok)
    assert "'</think>'" not in str(e.value)


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_parser_accepts_a_tokenizer_with_think_tokens(name, think_tokenizer):
    parser = reasoning_parsers.get(name)(think_tokenizer)
    assert parser.end_token_id() == think_tokenizer.convert_tokens_to_ids("</think>")
    assert parser.extract("a</think>b", prompt_opens_reasoning=True) == ("a", "b")


def test_server_start_up_refuses_the_embedded_model_with_deepseek_r1(smollm2_tokenizer):
    """What `tokenmill serve --reasoning-parser deepseek_r1` builds at start-up for the embedded SmolLM2."""
    from tokenmill.config.frontend import FrontendConfig
    from tokenmill.entrypoints.openai.chat_parsing import ChatParsing
    with pytest.raises(ValueError, match="deepseek_r1.*no '<think>' or '</think>' token"):
        ChatParsing(smollm2_tokenizer, FrontendConfig(reasoning_parser="deepseek_r1"))
    assert ChatParsing(smollm2_tokenizer, FrontendConfig()).reasoning is None
