"""vLLM's pooling methods on the offline LLM say by name that tokenmill runs generative models only."""
from __future__ import annotations

import pytest

from tokenmill.entrypoints.llm import LLM


@pytest.mark.parametrize("name", ["encode", "embed", "classify", "score", "reward"])
def test_pooling_methods_are_refused_by_name(name):
    llm = LLM.__new__(LLM)  # the refusal needs no model
    args = ("query", ["doc"]) if name == "score" else (["some text"],)
    with pytest.raises(ValueError, match=rf"^LLM\.{name}\(\) needs an embedding, pooling or scoring model"):
        getattr(llm, name)(*args, use_tqdm=False)
