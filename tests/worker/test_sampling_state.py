"""SamplingState: per-row storage and per-step metadata, end to end with the Sampler (CPU)."""
from collections import Counter

import numpy as np
import torch

from tokenmill.layers.sampler import Sampler
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.sampling_state import SamplingState

M, V, L = 16, 40, 32
EOS = 39


def params(bad=None, **kw):
    p = SamplingParams(**kw)
    p.update_from_tokenizer(EOS, bad)
    return p


class Batch:
    """The runner-side arrays make_metadata reads: token_ids / num_prompt_tokens / num_tokens."""

    def __init__(self):
        self.token_ids = np.zeros((M, L), np.int32)
        self.num_prompt = np.zeros(M, np.int32)
        self.num_tokens = np.zeros(M, np.int32)

    def set(self, row, prompt, outputs=()):
        toks = list(prompt) + list(outputs)
        self.token_ids[row, :len(toks)] = toks
        self.num_prompt[row], self.num_tokens[row] = len(prompt), len(toks)

    def md(self, state, rows):
        return state.make_metadata(np.array(rows), self.token_ids, self.num_prompt, self.num_tokens)


def test_all_greedy_metadata_is_empty():
    st, b = SamplingState(M, V, torch.device("cpu")), Batch()
    for r in (0, 3):
        st.add_request(r, params(temperature=0))
        b.set(r, [1, 2, 3])
    md = b.md(st, [3, 0])
    assert md.all_greedy and not md.needs_processing and md.max_num_logprobs is None
    assert all(getattr(md, f) is None for f in ("temperature", "seeds", "top_k", "top_p", "min_p", "greedy_mask"))


def test_seeds_positions_and_flags():
    st, b = SamplingState(M, V, torch.device("cpu"), global_seed=1), Batch()
    st.add_request(2, params(temperature=0.5, seed=7, top_k=5, logprobs=3))
    st.add_request(5, params(temperature=0, logprobs=1))
    st.add_request(9, params(top_p=0.5, min_p=0.1))
    b.set(2, [1, 2], [3, 4, 5])
    b.set(5, [1], [])
    b.set(9, [1, 2, 3], [6])
    md = b.md(st, [9, 2, 5])
    assert not md.all_greedy and not md.all_random
    assert md.greedy_mask.tolist() == [False, False, True]
    assert md.positions.tolist() == [1, 3, 0] and md.seeds[1] == 7
    assert md.temperature.tolist() == [1.0, 0.5, 1.0]
    assert md.top_k.tolist() == [0, 5, 0] and md.max_top_k == 5
    assert md.top_p.tolist() == [0.5, 1.0, 1.0] and md.min_p[0] == np.float32(0.1)
    assert md.max_num_logprobs == 3 and md.no_penalties
    st.add_request(6, params(logprobs=-1))
    assert b.md(st, [2, 6]).max_num_logprobs == -1
    # Unseeded requests draw seeds from the state's own RNG: reproducible given the global seed.
    st2 = SamplingState(M, V, torch.device("cpu"), global_seed=1)
    st2.add_request(0, params(temperature=0.5, seed=7, top_k=5, logprobs=3))
    st2.add_request(1, params(temperature=0))
    st2.add_request(4, params(top_p=0.5, min_p=0.1))
    assert st2._seed[4] == st._seed[9] and st._seed[9] != SamplingState(M, V, "cpu", 2)._rng.getrandbits(64)
    st.remove_request(2)
    assert b.md(st, [2, 9]).top_k is None  # removed row is back to neutral


def test_penalty_inputs_are_counts_and_prompt_mask():
    st, b = SamplingState(M, V, torch.device("cpu")), Batch()
    st.add_request(0, params(frequency_penalty=0.5))
    st.add_request(1, params(repetition_penalty=1.3))
    st.add_request(2, params())  # no penalty: its tokens must not be counted
    b.set(0, [1, 2, 2], [3, 3, 3, 4])
    b.set(1, [5, 6], [6, 7, 6])
    b.set(2, [8], [8, 9])
    md = b.md(st, [0, 1, 2])
    exp = torch.zeros(3, V)
    for i, outs in enumerate([[3, 3, 3, 4], [6, 7, 6], []]):
        for t, c in Counter(outs).items():
            exp[i, t] = c
    assert torch.equal(md.output_token_counts, exp)
    assert md.prompt_token_mask[1].nonzero().flatten().tolist() == [5, 6]
    assert not md.prompt_token_mask[[0, 2]].any()
    assert md.presence_penalties is None and md.frequency_penalties.tolist() == [0.5, 0, 0]
    # End to end: the penalized logits match a hand computation.
    x = torch.randn(3, V)
    ref = x.clone()
    ref[0] -= 0.5 * exp[0]
    for t in (5, 6, 7):
        ref[1, t] = ref[1, t] / 1.3 if ref[1, t] > 0 else ref[1, t] * 1.3
    y = x.clone()
    Sampler._process(y, md)
    assert torch.allclose(y, ref)


def test_bias_allowed_bad_words_min_tokens():
    st, b = SamplingState(M, V, torch.device("cpu")), Batch()
    st.add_request(4, params(temperature=0, logit_bias={7: 100.0, 99: 1.0}))
    st.add_request(6, params(temperature=0, allowed_token_ids=[3, 11]))
    st.add_request(8, params(temperature=0, bad=[[12], [20, 21, 22], [30, 31]]))
    st.add_request(10, params(temperature=0, min_tokens=3, stop_token_ids=[5]))
    b.set(4, [1])
    b.set(6, [1])
    b.set(8, [20, 21], [0, 20, 21])  # outputs end with (20, 21): bans 22; 30 is not a suffix
    b.set(10, [1], [2, 2])
    x = torch.zeros(4, V)
    x[:, 5], x[:, EOS], x[:, 12], x[:, 22], x[:, 31] = 9.0, 10.0, 11.0, 12.0, 8.0
    out = Sampler()(x.clone(), b.md(st, [4, 6, 8, 10])).sampled_token_ids.tolist()
    assert out[0] == 7  # bias (the out-of-vocab id 99 is ignored)
    assert out[1] in (3, 11)
    assert out[2] == EOS  # 22 (multi-token word) and 12 (single) banned; EOS fine (no min_tokens)
    assert out[3] == 22  # min_tokens: EOS and 5 masked while 2 < 3 outputs
    # The bad-word prefix must match the outputs, not the prompt.
    b.set(8, [20, 21], [])
    md = b.md(st, [8])
    assert md.bad_words_index[1].tolist() == [12]
    # min_tokens lifts once reached.
    b.set(10, [1], [2, 2, 2])
    assert b.md(st, [10]).min_tokens_index is None
    y = torch.zeros(1, V)
    y[0, EOS] = 1.0
    assert Sampler()(y, b.md(st, [10])).sampled_token_ids.item() == EOS
    assert b.md(st, [4, 6]).bad_words_index is None


def test_seeded_request_reproducible_in_any_batch():
    """A seeded request gives the same tokens alone or in a batch of 8 (other random rows, shuffled), per step."""
    torch.manual_seed(0)
    table = torch.randn(L, V) * 2  # logits depend only on the output position, the same for every batch

    def run(order, with_others):
        st, b = SamplingState(M, V, torch.device("cpu"), global_seed=123), Batch()
        st.add_request(order[0], params(temperature=0.8, top_p=0.9, seed=1234, frequency_penalty=0.3))
        rows = [order[0]]
        b.set(order[0], [1, 2, 3])
        if with_others:
            for j, r in enumerate(order[1:]):
                st.add_request(r, params(temperature=0.5 + 0.1 * j, top_k=j + 1, presence_penalty=0.1 * j))
                b.set(r, [4] * (j + 1))
                rows.append(r)
        rng = np.random.default_rng(order[0])
        toks = []
        for _ in range(10):
            perm = rng.permutation(len(rows))
            batch_rows = [rows[i] for i in perm]
            n_out = b.num_tokens[batch_rows] - b.num_prompt[batch_rows]
            out = Sampler()(table[n_out].clone(), b.md(st, batch_rows)).sampled_token_ids
            for r, t in zip(batch_rows, out.tolist()):
                b.token_ids[r, b.num_tokens[r]] = t
                b.num_tokens[r] += 1
            toks.append(out[batch_rows.index(order[0])].item())
        return toks

    alone = run([0], False)
    assert run([5, 1, 2, 3, 4, 6, 7, 8], True) == alone
    assert run([11, 15, 0, 3, 2, 9, 8, 7], True) == alone
    assert len(set(alone)) > 1


def test_plain_race_inputs_only_for_plain_rows():
    """The in-graph draw takes a batch only when every row is plain temperature sampling; its inputs are the
    metadata's seeds, positions and temperatures."""
    st, b = SamplingState(M, V, torch.device("cpu"), global_seed=3), Batch()
    st.add_request(0, params(temperature=0.7, seed=11))
    st.add_request(1, params())                       # temperature 1, unseeded
    b.set(0, [1, 2], [3, 4])
    b.set(1, [5], [])
    got = st.plain_race_inputs(np.array([1, 0]), b.num_prompt, b.num_tokens)
    md = b.md(st, [1, 0])
    assert got is not None and md.all_random and not md.needs_processing
    assert got[0].tolist() == md.seeds.tolist() and got[1].tolist() == md.positions.tolist() == [0, 2]
    assert got[2].tolist() == [1.0, np.float32(0.7)]
    for i, kw in enumerate([dict(temperature=0), dict(top_k=3), dict(top_p=0.9), dict(min_p=0.1),
                            dict(frequency_penalty=0.1), dict(presence_penalty=0.1), dict(repetition_penalty=1.1),
                            dict(logprobs=0), dict(logit_bias={3: 1.0}), dict(allowed_token_ids=[1, 2]),
                            dict(bad=[[4]]), dict(min_tokens=2, stop_token_ids=[9])]):
        st.add_request(2, params(**kw))
        b.set(2, [1], [])
        assert st.plain_race_inputs(np.array([0, 2]), b.num_prompt, b.num_tokens) is None, kw
    st.remove_request(2)
    assert st.plain_race_inputs(np.array([2]), b.num_prompt, b.num_tokens) is None
    assert st.plain_race_inputs(np.array([0, 1]), b.num_prompt, b.num_tokens) is not None


def test_packed_upload_rows_are_16_byte_aligned_at_every_batch_size():
    """Triton specializes on 16-byte pointer alignment: with the seeds / positions / temperature rows aligned or
    not by the batch's parity, the sampling kernel would compile a second variant mid-serving."""
    packed, plain = (SamplingState(M, V, torch.device("cpu"), packed_upload=flag) for flag in (True, False))
    b = Batch()
    for r in range(M):
        for st in (packed, plain):
            st.add_request(r, params(temperature=0.5 + r / 100, top_p=0.9, top_k=3, presence_penalty=0.1))
        b.set(r, [1, 2, 3], [4] * (r % 5))
    for n in range(1, 8):
        rows = list(range(n, 0, -1))
        mp, mq = b.md(packed, rows), b.md(plain, rows)
        for f in ("seeds", "positions", "top_k", "temperature", "top_p", "presence_penalties"):
            tp, tq = getattr(mp, f), getattr(mq, f)
            assert tp.data_ptr() % 16 == 0, (f, n)
            assert tp.is_contiguous() and tp.shape == (n,), (f, n)
            assert torch.equal(tp, tq), (f, n)


def test_packed_upload_holds_every_verified_position():
    """Speculative decoding samples each request at k + 1 positions: a step has up to max_rows rows, more than
    max_num_reqs, and the packed buffer holds them all."""
    k = 4
    st = SamplingState(2, V, torch.device("cpu"), packed_upload=True, max_rows=2 * (k + 1))
    b = Batch()
    for r in range(2):
        st.add_request(r, params(temperature=0.7, top_k=20, top_p=0.9, seed=5 + r))
        b.set(r, [1, 2, 3], [4])
    rows, offs = np.repeat([0, 1], k + 1), np.tile(np.arange(k + 1), 2)
    md = st.make_metadata(rows, b.token_ids, b.num_prompt, b.num_tokens, offs)
    assert md.seeds.shape == (2 * (k + 1),) and md.positions.tolist() == (1 + offs).tolist()
    assert md.top_k.tolist() == [20] * 10
