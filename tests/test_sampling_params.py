"""SamplingParams validation: every bad value is a ValueError naming the field."""
import math

import pytest

from tokenmill import SamplingParams


@pytest.mark.parametrize("kw,field", [
    (dict(temperature="a"), "temperature"), (dict(top_p=None), "top_p"), (dict(presence_penalty=None),
                                                                         "presence_penalty"),
    (dict(temperature=math.inf), "temperature"), (dict(stop=5), "stop"), (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(logit_bias={1: math.nan}), "logit_bias"), (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0), "top_p"), (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(logprobs=-2), "logprobs"),
    (dict(top_k=-3), "top_k"), (dict(repetition_penalty=0), "repetition_penalty"),
])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_normalisation():
    assert SamplingParams(bad_words="hello").bad_words == ["hello"]
    assert SamplingParams(stop="x").stop == ["x"]
    p = SamplingParams(temperature=0, top_p=0.5, top_k=5)
    assert (p.top_p, p.top_k) == (1.0, 0)  # greedy ignores the filters
