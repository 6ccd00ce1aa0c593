"""vLLM-script conformance of the offline LLM: forms vLLM accepts that tokenmill once refused or mishandled
(torch dtypes, a callable hf_overrides, content-format auto-detection, chat_template_kwargs overriding the chat
arguments, BeamSearchSequence's fields)."""
from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.entrypoints.chat_utils import detect_content_format, render_chat
from tokenmill.sampling_params import BeamSearchParams

GREEDY = SamplingParams(temperature=0, max_tokens=2)
MSG = [{"role": "user", "content": "hi"}]
# A template that expects OpenAI-style content parts: it loops over each message's content.
PARTS_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{% for part in m['content'] %}{{ part.text }}|{% endfor %}"
                  "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(tiny_model_factory("llama"), max_model_len=128, num_gpu_blocks_override=64)


def test_dtype_may_be_a_torch_dtype(tiny_model_factory):
    """vLLM scripts pass LLM(dtype=torch.bfloat16); it means the same as the name."""
    llm = LLM(tiny_model_factory("llama"), dtype=torch.float32, max_model_len=64, num_gpu_blocks_override=16)
    assert llm.model_config.dtype == "float32"
    assert len(llm.generate("hi", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match=r"Invalid value torch.float64 for `dtype`"):
        LLM(tiny_model_factory("llama"), dtype=torch.float64, max_model_len=64, num_gpu_blocks_override=16)


def test_hf_overrides_may_be_a_function_of_the_config(tiny_model_factory):
    """vLLM's offline hf_overrides is a dict or a function that takes the HF config and returns it."""
    import pickle

    def shorter(config):
        config.max_position_embeddings = 96
        return config
    llm = LLM(tiny_model_factory("llama"), hf_overrides=shorter, num_gpu_blocks_override=16)
    assert llm.model_config.max_model_len == 96
    pickle.dumps(llm.llm_engine.vllm_config)  # worker processes get the config pickled: no function left in it
    with pytest.raises(TypeError, match="must return the \\(updated\\) HF config, got NoneType"):
        LLM(tiny_model_factory("llama"), hf_overrides=lambda config: None, num_gpu_blocks_override=16)


@pytest.mark.parametrize("template,expected", [
    (PARTS_TEMPLATE, "openai"),
    ("{% for m in messages %}{% set c = m.content %}{% for p in c %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
    ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% endif %}{% endfor %}", "string"),
])
def test_content_format_auto_detection(template, expected):
    assert detect_content_format(template) == expected


def test_auto_content_format_gives_a_parts_template_parts(llm):
    """With content format auto (the default), a template that loops over content parts gets a list of parts even
    for plain-string content (vLLM's detection); before, it looped over the string's characters."""
    out = llm.chat([{"role": "user", "content": "hello"},
                    {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                    {"role": "user", "content": "bye"}],
                   GREEDY, use_tqdm=False, chat_template=PARTS_TEMPLATE)[0]
    assert out.prompt == "<user>hello|<assistant>a|b|<user>bye|<assistant>"
    # The SmolLM2 template takes strings: auto keeps giving it the joined text.
    out = llm.chat([{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}],
                   GREEDY, use_tqdm=False)[0]
    assert "<|im_start|>user\nx\ny<|im_end|>" in out.prompt


def test_chat_template_kwargs_may_set_the_chat_arguments(llm):
    """vLLM merges chat_template_kwargs over add_generation_prompt / continue_final_message / tools."""
    tok = llm.get_tokenizer()
    conv = MSG + [{"role": "assistant", "content": "Sure, "}]
    continued = llm.chat(conv, GREEDY, use_tqdm=False,
                         chat_template_kwargs={"add_generation_prompt": False, "continue_final_message": True})[0]
    assert continued.prompt.endswith("<|im_start|>assistant\nSure, ")
    no_prompt = llm.chat(MSG, GREEDY, use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False})[0]
    assert no_prompt.prompt == render_chat(tok, MSG, add_generation_prompt=False)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    text = render_chat(tok, MSG, chat_template="{{ tools | tojson }}", chat_template_kwargs={"tools": tools})
    assert '"name": "f"' in text
    with pytest.raises(ValueError, match="add_generation_prompt and continue_final_message cannot both be true"):
        llm.chat(conv, GREEDY, use_tqdm=False, chat_template_kwargs={"continue_final_message": True})
    with pytest.raises(ValueError, match="chat_template_kwargs may not set 'tokenize'"):
        llm.chat(MSG, GREEDY, use_tqdm=False, chat_template_kwargs={"tokenize": True})


def test_beam_search_sequences_have_vllms_fields(llm):
    [out] = llm.beam_search([{"prompt": "hello"}], BeamSearchParams(beam_width=2, max_tokens=2))
    seq = out.sequences[0]
    assert seq.stop_reason is None and seq.lora_request is None
    assert seq.finish_reason in ("stop", "length") and isinstance(seq.text, str)
