"""Suffix decoding: the trie's drafts, the global trie over earlier requests' outputs, and the same exactness as
ngram (greedy identity with accepted drafts, seeded sampling equal to the plain engine)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.spec_decode.conftest import cycle_prompt, make_llm
from tests.spec_decode.test_greedy_exact import PROMPTS, generate, ids, spec_counts
from tokenmill.config.speculative import SpeculativeConfig
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode import SuffixProposer
from tokenmill.spec_decode.suffix import SuffixTrie

SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}


def test_trie_drafts_the_most_frequent_continuation_of_the_longest_match():
    t = SuffixTrie(8)
    t.extend("a", [1, 2, 3, 4, 9, 1, 2, 3, 5, 1, 2, 3, 5, 7])
    # Context ...1 2 3: followed by 4 once and 5 twice: 5, then 1 (after "3 5") / 7 (after "2 3 5 "), ...
    draft, score = t.draft([8, 1, 2, 3], k=4, factor=4.0, min_prob=0.0)
    assert draft[:1] == [5] and 0 < score <= len(draft)
    assert t.draft([1, 2, 3], k=4, factor=4.0, min_prob=0.9)[0] == []     # p(5 | 1 2 3) = 2/3 < 0.9
    assert t.draft([6], k=4, factor=4.0, min_prob=0.0) == ([], 0.0)       # never seen
    assert len(t.draft([2, 3], k=4, factor=1.0, min_prob=0.0)[0]) <= 2    # factor x match length


def test_trie_remove_takes_a_sequence_out():
    t = SuffixTrie(4)
    t.extend(0, [1, 2, 3, 1, 2])
    t.end(0)
    t.extend(1, [5, 6])
    t.end(1)
    t.remove([1, 2, 3, 1, 2])
    assert sorted(t.root.children) == [5, 6] and t.root.children[5].children[6].count == 1


def test_global_trie_keeps_the_latest_requests():
    cfg = SpeculativeConfig("suffix", 4, suffix_decoding_max_cached_requests=1, suffix_decoding_min_token_prob=0.0,
                            suffix_decoding_max_spec_factor=4.0)
    p = SuffixProposer(cfg)
    # The runner's calls: first with the prompt plus the first sampled token, then with every token so far.
    p.propose("a", np.array([100, 1]), 4)                # prompt 100, first output 1
    p.propose("a", np.array([100, 1, 2, 3, 4, 5, 6]), 4)
    p.remove("a")
    assert p.propose("b", np.array([200, 2]), 3) == [3, 4, 5]       # from a's outputs
    p.propose("c", np.array([300, 7]), 3)
    p.remove("c")                                                    # evicts a's outputs
    assert p.propose("d", np.array([400, 2]), 3) == []


@pytest.fixture(scope="module")
def engines(cycle_model):
    return make_llm(cycle_model), make_llm(cycle_model, SUFFIX)


def test_greedy_identical_with_accepted_drafts(engines):
    plain, suffix = engines
    params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[13])
    assert ids(generate(suffix, params)) == ids(generate(plain, params))
    drafts, accepted = spec_counts(suffix)
    assert drafts > 0 and 0.3 * drafts < accepted < drafts, (drafts, accepted)


def test_seeded_sampling_equal_to_the_plain_engine(engines):
    plain, suffix = engines
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=i) for i in range(len(PROMPTS))]
    assert ids(generate(suffix, params)) == ids(generate(plain, params))


def test_drafts_from_earlier_requests_outputs(cycle_model):
    """A one-token prompt has nothing of its own to match until its output repeats; the earlier request's cycle in
    the global trie matches from the first step, so more drafts are accepted with the global trie than without."""
    # The second request stops after about one cycle (7 tokens), before its own trie can draft much.
    first, params = SamplingParams(temperature=0, max_tokens=30), SamplingParams(temperature=0, max_tokens=10)
    want = ids(generate(make_llm(cycle_model), params, [[703]]))
    gained = {}
    for cached in (0, 16):
        llm = make_llm(cycle_model, {**SUFFIX, "suffix_decoding_max_cached_requests": cached,
                                     "suffix_decoding_max_spec_factor": 4.0})
        generate(llm, first, [cycle_prompt(700, 10)])
        _, before = spec_counts(llm)
        assert ids(generate(llm, params, [[703]])) == want
        gained[cached] = spec_counts(llm)[1] - before
    assert gained[16] >= gained[0] + 4, gained
