import pytest


@pytest.fixture(scope="session")
def tokenizer(smollm2_tokenizer):
    """A real byte-level BPE tokenizer (SmolLM2's), shared with the rest of the suite."""
    return smollm2_tokenizer
