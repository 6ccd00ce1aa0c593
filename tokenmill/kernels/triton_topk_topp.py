"""Sort-free exact min-p -> top-k -> top-p sampling on the GPU: two Triton kernels, no host syncs.

What it computes. For a row of logits l, y = l / temperature (fp32, IEEE division as torch's `div_`). vLLM v1 applies
min-p to the temperature-scaled distribution first (an "argmax-invariant logits processor"), then top-k, then
top-p on the renormalized survivors. Every stage keeps an *upper set by value*, ties included:
  * min-p keeps y_i >= max(y) + log(min_p)                       (p_i >= min_p * p_max);
  * top-k keeps i when fewer than k survivors are strictly above y_i  (vLLM keeps every tie of the k-th value);
  * top-p keeps i when the survivors' probability mass strictly above y_i is < top_p (the first token of the
    ascending cumulative sum that vLLM keeps, and everything tied with or above it).
So the kept set is A = {i : key(y_i) >= tau} for one integer threshold tau per row, where key() is the
order-preserving int32 image of the fp32 value (-0 folded onto +0). The token is the exponential race over A,
argmax_{i in A} (y_i - log(-log u_i)) with the counter-based uniforms of kernels/sampling_rng.py (the same hash,
the same float steps as kernels/triton_sampling.race_argmax), i.e. exactly the token the torch path of
layers/sampler.py draws after masking the complement of A.

How, without a sort (a pass streams the row in BLOCK-sized chunks through registers):
  pass 0     spread over (row, chunk) programs (bandwidth-bound, like race_argmax): each chunk's max and race
             winner. The row program below reduces those to max(y) and x0, the race winner over the whole row.
  top-k      a bracket search on the integer key: `lo` (at least k survivors at or above it, so nothing below is
             kept; it starts at the k-th largest chunk max when k <= the number of chunks, since k chunks hold a
             value at or above that, which on flat rows leaves only a little more than k values above `lo`) and
             `hi` (fewer than k at or above it). One pass evaluates NP evenly spaced keys in [lo, hi] at
             once - the count and mass at or above each, the smallest element key at or above each and the largest
             below each - and shrinks the bracket to the sub-interval holding the boundary, snapped to the element
             keys in it. It ends when one distinct value is left (the k-th largest), so it needs at most
             ceil(32 / log2(NP - 1)) passes, and far fewer on real logits because the snapping follows the data.
             Each pass also keeps the race winner at or above each of its keys, so the last one hands on the
             race winner over the survivors P without a pass of its own.
  top-p      exact rejection with rising pivots: test the current candidate x (initially x0 when it survived
             min-p/top-k; else a first pass draws one from the survivors P) by one pass that sums the mass strictly
             above y_x and the mass of P (the normaliser); if the first is >= top_p * mass(P), x and
             everything at or below it are outside A, so the same pass also drew the race winner over the
             values above y_x as the next candidate. With one noise realisation the first candidate that lands in
             A is argmax_A of the race (each candidate is the race winner over a superset of A, and a winner over a
             superset that lies in A is A's winner), so this is the exact draw and it equals the torch path's token;
             no round index is needed. A candidate drawn from P is accepted with probability >= top_p (A holds at
             least that share of P's mass), and each rejection removes the mass at and below the pivot, so
             top_p 0.95 takes one test pass in ~19 of 20 rows. When the caller needs the exact threshold (processed
             logprobs / logits must see the truncated distribution), the top-p stage runs the bracket search on the mass
             instead and returns tau.
  draw       when x0 is not in A after a threshold stage, one more pass draws the race winner over A.
A row with temperature sampling alone never reaches this kernel (race_argmax is one pass); top_p 0.95 alone costs
pass 0 + one or two passes; min-p alone pass 0 + at most one; top-k costs the search passes on top, unless the
batch's largest k is at most TOPK_SELECT_MAX: then kernels/triton_topk_select draws every row with top-k from
torch.topk's sorted candidates, the same kept set and token without streaming the row (bar rare tie cases), and
the kernels here draw only the rows without top-k. Which rows those are is known on the device only, so they still
launch in full, and the programs of the other rows return at once.

After pass 0, one program per row: the loops are data-dependent per row, and a row is small enough (152k values) to
stream a few times per step. Top-p alone (no top-k search) spreads its first tests over (row, chunk) programs
instead: the split pass sums the masses x0's test needs, and _ROUNDS round kernels each decide the last candidate
and test the next one for the rows that rejected theirs, so the row program streams a row only after _ROUNDS
rejections (a batch of 256 rows at top_p 0.95 would otherwise almost always wait on some row's serial pass). CUDA-graph safe: no host control flow depends on the data, and the only scratch is the
[B, chunks] pass-0 results, allocated per call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import sampling_rng as rng
from tokenmill.kernels.pdl import launch_kwargs, pdl_wait
from tokenmill.kernels.triton_sampling_rows import (_KEY_NEG_INF, _better, _chunk, _draw, _key, _log, _pick,
                                                    _prefetch, _race, _row_key, _row_temp, _scale, _spread, _unkey)
from tokenmill.kernels.triton_topk_select import select_sample

# Pass 0 chunks as race_argmax's (2048 columns, 8 warps: 75 programs per 152k row). The row program streams 2048
# columns per iteration with 16 warps: its passes are bound by the latency of one load round trip per iteration,
# so fewer, wider iterations are faster; tools/bench_sampler.py sweeps both on a GPU.
_CHUNK = 2048
_BLOCK = 2048
_ROW_WARPS = 16
_NP = 8          # keys evaluated per search pass (the bracket ends included)
_ROUNDS = 3      # top-p rejection rounds after the split pass, spread over the chunks (three tests: x0, x1, x2)
_ROUNDS_MIN_ROWS = 4    # batches with fewer rows run no rounds
# Largest batch top_k that kernels/triton_topk_select draws from torch.topk's candidates (above it, the bracket
# search passes).
TOPK_SELECT_MAX = 256


@triton.jit
def _stats(row_ptr, V, temp, m, cand, row_key, draw_lo, SALT_COL: tl.constexpr, BLOCK: tl.constexpr,
           NP: tl.constexpr, HAS_TEMP: tl.constexpr, DRAW: tl.constexpr, WINNERS: tl.constexpr = False):
    """For each of the NP keys s in `cand`: the mass (sum of exp(y - m)) of the columns with key >= s; unless DRAW,
    also their count, the smallest such key and the largest key < s (the bracket search's needs) and (WINNERS) the
    race winner over key >= s; with DRAW, the race winner over key >= draw_lo instead (the rejection test's)."""
    cnt = tl.zeros([NP], dtype=tl.int32)
    mass = tl.zeros([NP], dtype=tl.float32)
    a_min = tl.full([NP], 2147483647, tl.int32)
    b_max = tl.full([NP], -2147483648, tl.int32)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32)
    win = tl.full([NP], float("-inf"), tl.float32)
    win_i = tl.zeros([NP], dtype=tl.int32)
    nxt = _prefetch(row_ptr, 0, V, BLOCK)
    for start in range(0, V, BLOCK):
        cur = nxt
        nxt = _prefetch(row_ptr, start + BLOCK, V, BLOCK)
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        y = _scale(cur, temp, HAS_TEMP)
        key = _key(y)
        e = tl.exp(y - m)
        ge = (key[:, None] >= cand[None, :]) & mask[:, None]
        mass += tl.sum(tl.where(ge, e[:, None], 0.0), axis=0)
        if not DRAW:
            lt = (key[:, None] < cand[None, :]) & mask[:, None]
            cnt += tl.sum(ge.to(tl.int32), axis=0)
            a_min = tl.minimum(a_min, tl.min(tl.where(ge, key[:, None], 2147483647), axis=0))
            b_max = tl.maximum(b_max, tl.max(tl.where(lt, key[:, None], -2147483648), axis=0))
            if WINNERS:
                gm = tl.where(ge, _race(y, cols, row_key, SALT_COL)[:, None], float("-inf"))
                cb = tl.max(gm, axis=0)
                ci = tl.min(tl.where(gm == cb[None, :], cols[:, None], V + 1), axis=0)
                take = cb > win
                win = tl.where(take, cb, win)
                win_i = tl.where(take, ci, win_i)
        else:
            g = tl.where(mask & (key >= draw_lo), _race(y, cols, row_key, SALT_COL), float("-inf"))
            best, best_i = _better(g, cols, best, best_i, V)
    return cnt, mass, a_min, b_max, best_i, win_i


@triton.jit
def _selected(k_ptr, b, SELECTED: tl.constexpr):
    """True when kernels/triton_topk_select drew row b already (SELECTED: it ran, and it draws the top-k rows); the
    full-row kernels then return at once (after the PDL wait, so every grid still waits on its predecessor)."""
    if SELECTED:
        return tl.load(k_ptr + b) > 0
    return False


@triton.jit
def _chunks_kernel(logits_ptr, stride_b, seeds_ptr, pos_ptr, temp_ptr, k_ptr, cmax_ptr, cbest_ptr, cidx_ptr, V,
                   n_chunks, SALT_SEED: tl.constexpr, SALT_POS: tl.constexpr, SALT_COL: tl.constexpr,
                   BLOCK: tl.constexpr, HAS_TEMP: tl.constexpr, SELECTED: tl.constexpr = False,
                   PDL: tl.constexpr = False):
    """Pass 0, spread over (row, chunk) programs: each chunk's max and its race winner (value, first index)."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1)
    if _selected(k_ptr, b, SELECTED):
        return
    temp = _row_temp(temp_ptr, b, HAS_TEMP)
    cols, mask, y = _chunk(logits_ptr + b.to(tl.int64) * stride_b, c * BLOCK, V, temp, BLOCK, HAS_TEMP)
    g = tl.where(mask, _race(y, cols, _row_key(seeds_ptr, pos_ptr, b, SALT_SEED, SALT_POS), SALT_COL),
                 float("-inf"))
    best = tl.max(g, axis=0)
    at = b * n_chunks + c
    tl.store(cmax_ptr + at, tl.max(y, axis=0))
    tl.store(cbest_ptr + at, best)
    tl.store(cidx_ptr + at, tl.min(tl.where(g == best, cols, V + 1), axis=0))


@triton.jit
def _pass0(cmax_ptr, cbest_ptr, cidx_ptr, b, n_chunks, V, CHUNKS_P2: tl.constexpr):
    """Pass 0's results for row b: the chunk maxima, the row max and x0, the race winner over the whole row
    (ties: the lowest index)."""
    ci = tl.arange(0, CHUNKS_P2)
    cm = ci < n_chunks
    cmax = tl.load(cmax_ptr + b * n_chunks + ci, mask=cm, other=float("-inf"))
    cbest = tl.load(cbest_ptr + b * n_chunks + ci, mask=cm, other=float("-inf"))
    best = tl.max(cbest, axis=0)
    x = tl.min(tl.where(cm & (cbest == best), tl.load(cidx_ptr + b * n_chunks + ci, mask=cm, other=0), V + 1),
               axis=0)
    return ci, cm, cmax, tl.max(cmax, axis=0), x


@triton.jit
def _value_key(row_ptr, x, temp, HAS_TEMP: tl.constexpr):
    return _key(_scale(tl.load(row_ptr + x), temp, HAS_TEMP))


@triton.jit(do_not_specialize=["draw"])
def _split_kernel(logits_ptr, stride_b, seeds_ptr, pos_ptr, temp_ptr, minp_ptr, k_ptr, cmax_ptr, cbest_ptr,
                  cidx_ptr, smass_ptr, sabove_ptr, swin_ptr, swidx_ptr, V, n_chunks, draw, KEY_NEG_INF: tl.constexpr,
                  SALT_SEED: tl.constexpr, SALT_POS: tl.constexpr, SALT_COL: tl.constexpr, BLOCK: tl.constexpr,
                  CHUNKS_P2: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_MINP: tl.constexpr,
                  SELECTED: tl.constexpr = False, PDL: tl.constexpr = False):
    """Without a top-k search, the row program's first pass spread over (row, chunk) programs: per chunk, the mass
    of the min-p survivors P, the mass strictly above x0, and (draw != 0) the race winner over the keys above x0 (x0 in
    P) or over P (x0 not in P) - the next candidate. Without draw the first round kernel draws it, for the rows
    that need it only (most rows accept x0, and the race is most of a pass's arithmetic)."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1)
    if _selected(k_ptr, b, SELECTED):
        return
    temp = _row_temp(temp_ptr, b, HAS_TEMP)
    row_ptr = logits_ptr + b.to(tl.int64) * stride_b
    _, _, _, m, x0 = _pass0(cmax_ptr, cbest_ptr, cidx_ptr, b, n_chunks, V, CHUNKS_P2)
    lo = tl.full([], KEY_NEG_INF, tl.int32)
    if HAS_MINP:
        lo = tl.maximum(lo, _key(m + _log(tl.load(minp_ptr + b).to(tl.float32))))
    kx = _value_key(row_ptr, x0, temp, HAS_TEMP)
    draw_lo = tl.where(kx >= lo, kx + 1, lo)
    cols, mask, y = _chunk(row_ptr, c * BLOCK, V, temp, BLOCK, HAS_TEMP)
    key = _key(y)
    e = tl.exp(y - m)
    at = b * n_chunks + c
    tl.store(smass_ptr + at, tl.sum(tl.where(mask & (key >= lo), e, 0.0), axis=0))
    tl.store(sabove_ptr + at, tl.sum(tl.where(mask & (key > kx), e, 0.0), axis=0))
    if draw != 0:   # a runtime flag: one compiled kernel whether round kernels follow or not
        g = tl.where(mask & (key >= draw_lo), _race(y, cols, _row_key(seeds_ptr, pos_ptr, b, SALT_SEED, SALT_POS),
                                                    SALT_COL), float("-inf"))
        best = tl.max(g, axis=0)
        tl.store(swin_ptr + at, best)
        tl.store(swidx_ptr + at, tl.min(tl.where(g == best, cols, V + 1), axis=0))


@triton.jit
def _round_kernel(logits_ptr, stride_b, seeds_ptr, pos_ptr, temp_ptr, p_ptr, minp_ptr, k_ptr, cmax_ptr, cbest_ptr,
                  cidx_ptr, smass_ptr, pabove_ptr, pwin_ptr, pwidx_ptr, pstate_ptr, above_ptr, win_ptr, widx_ptr,
                  state_ptr, out_ptr, V, n_chunks, KEY_NEG_INF: tl.constexpr, SALT_SEED: tl.constexpr,
                  SALT_POS: tl.constexpr, SALT_COL: tl.constexpr, BLOCK: tl.constexpr, CHUNKS_P2: tl.constexpr,
                  HAS_TEMP: tl.constexpr, HAS_MINP: tl.constexpr, FIRST: tl.constexpr, SELECTED: tl.constexpr = False,
                  PDL: tl.constexpr = False):
    """One rejection test of top-p, spread over (row, chunk) programs like the split pass. The previous round (the
    split pass when FIRST) tested candidate x; every program of row b decides from the per-chunk sums whether x is
    in A. If so the row is done: out[b] = x, state[b] = -1. If not, the next candidate (the race winner over the
    keys above x, from the previous round's per-chunk winners) is tested here: per chunk, the mass strictly above
    it and the race winner above it (the one after it); state[b] = the candidate.
    FIRST: the split pass drew no winners, so a rejected x0 is not followed by a test: this round draws the winner
    above x0 (state[b] = -2 - x0, "x rejected, the next candidate is in the winners"); rows without top-p get
    their winner over P here too. Later rounds pass rows without top-p and finished rows through unchanged, so the
    row program reads one uniform state after the last round."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1)
    if _selected(k_ptr, b, SELECTED):
        return
    at = b * n_chunks + c
    ci, cm, _, m, x0 = _pass0(cmax_ptr, cbest_ptr, cidx_ptr, b, n_chunks, V, CHUNKS_P2)
    if FIRST:
        x = x0
    else:
        x = tl.load(pstate_ptr + b)
    pp = tl.load(p_ptr + b).to(tl.float32)
    use_p = pp < 1.0
    skip = (m == float("-inf")) | (x == -1)
    if not FIRST:
        skip = skip | (use_p == 0)
    if skip:
        tl.store(above_ptr + at, tl.load(pabove_ptr + at))
        tl.store(win_ptr + at, tl.load(pwin_ptr + at))
        tl.store(widx_ptr + at, tl.load(pwidx_ptr + at))
        if c == 0:
            tl.store(state_ptr + b, x)
        return
    temp = _row_temp(temp_ptr, b, HAS_TEMP)
    row_ptr = logits_ptr + b.to(tl.int64) * stride_b
    lo = tl.full([], KEY_NEG_INF, tl.int32)
    if HAS_MINP:
        lo = tl.maximum(lo, _key(m + _log(tl.load(minp_ptr + b).to(tl.float32))))
    rejected = x <= -2   # (not FIRST) the previous round rejected -2 - x and drew past it
    x = tl.where(rejected, -2 - x, x)
    z = tl.sum(tl.load(smass_ptr + b * n_chunks + ci, mask=cm, other=0.0), axis=0)
    above_x = tl.sum(tl.load(pabove_ptr + b * n_chunks + ci, mask=cm, other=0.0), axis=0)
    if use_p & (rejected == 0) & (_value_key(row_ptr, x, temp, HAS_TEMP) >= lo) & (above_x < pp * z):
        if c == 0:
            tl.store(out_ptr + b, x.to(tl.int64))
            tl.store(state_ptr + b, -1)
        return
    if not FIRST:
        pwin = tl.load(pwin_ptr + b * n_chunks + ci, mask=cm, other=float("-inf"))
        x = tl.min(tl.where(cm & (pwin == tl.max(pwin, axis=0)),
                            tl.load(pwidx_ptr + b * n_chunks + ci, mask=cm, other=0), V + 1), axis=0)
    kx = _value_key(row_ptr, x, temp, HAS_TEMP)
    draw_lo = tl.where(kx >= lo, kx + 1, lo)
    cols, mask, y = _chunk(row_ptr, c * BLOCK, V, temp, BLOCK, HAS_TEMP)
    key = _key(y)
    g = tl.where(mask & (key >= draw_lo), _race(y, cols, _row_key(seeds_ptr, pos_ptr, b, SALT_SEED, SALT_POS),
                                                SALT_COL), float("-inf"))
    best = tl.max(g, axis=0)
    tl.store(above_ptr + at, tl.sum(tl.where(mask & (key > kx), tl.exp(y - m), 0.0), axis=0))
    tl.store(win_ptr + at, best)
    tl.store(widx_ptr + at, tl.min(tl.where(g == best, cols, V + 1), axis=0))
    if c == 0:
        if FIRST:
            tl.store(state_ptr + b, tl.where(use_p, -2 - x, x))
        else:
            tl.store(state_ptr + b, x)


@triton.jit(do_not_specialize=["rounds"])
def _topk_topp_kernel(logits_ptr, stride_b, seeds_ptr, pos_ptr, temp_ptr, k_ptr, p_ptr, minp_ptr, cmax_ptr,
                      cbest_ptr, cidx_ptr, smass_ptr, sabove_ptr, swin_ptr, swidx_ptr, state_ptr, out_ptr, thr_ptr, V,
                      n_chunks, rounds, KEY_NEG_INF: tl.constexpr, SALT_SEED: tl.constexpr, SALT_POS: tl.constexpr,
                      SALT_COL: tl.constexpr, BLOCK: tl.constexpr, NP: tl.constexpr, CHUNKS_P2: tl.constexpr,
                      HAS_TEMP: tl.constexpr, HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_MINP: tl.constexpr,
                      WANT_THR: tl.constexpr, HAS_SPLIT: tl.constexpr,
                      SELECTED: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    b = tl.program_id(0)
    if _selected(k_ptr, b, SELECTED):
        return
    row_ptr = logits_ptr + b.to(tl.int64) * stride_b
    row_key = _row_key(seeds_ptr, pos_ptr, b, SALT_SEED, SALT_POS)
    temp = _row_temp(temp_ptr, b, HAS_TEMP)
    idx = tl.arange(0, NP)

    ci, cm, cmax, m, x = _pass0(cmax_ptr, cbest_ptr, cidx_ptr, b, n_chunks, V, CHUNKS_P2)
    live = m > float("-inf")   # a row with every logit masked keeps token 0 and skips the stages
    m_key = _key(m)
    lo = tl.full([], KEY_NEG_INF, tl.int32)   # nothing below lo is kept
    do_draw = live

    if HAS_MINP:
        lo = tl.maximum(lo, _key(m + _log(tl.load(minp_ptr + b).to(tl.float32))))

    if HAS_SPLIT:   # the split first pass (no top-k in the batch), then any rounds: the last round's state
        # With rounds, the candidate the last round tested (x0 for rows without top-p); else x0 itself.
        x = tl.load(state_ptr + b, mask=rounds != 0, other=x)
        if x == -1:   # a round found the token and stored it
            return
        rejected = x <= -2       # after one round only: -2 - x was rejected, the winners are past it
        x = tl.where(rejected, -2 - x, x)
        z_split = tl.sum(tl.load(smass_ptr + b * n_chunks + ci, mask=cm, other=0.0), axis=0)
        above_x0 = tl.sum(tl.load(sabove_ptr + b * n_chunks + ci, mask=cm, other=0.0), axis=0)
        swin = tl.load(swin_ptr + b * n_chunks + ci, mask=cm, other=float("-inf"))
        x1 = tl.min(tl.where(cm & (swin == tl.max(swin, axis=0)),
                             tl.load(swidx_ptr + b * n_chunks + ci, mask=cm, other=0), V + 1), axis=0)
        have0 = _value_key(row_ptr, x, temp, HAS_TEMP) >= lo
        # The race winner over a superset of A either way (x over the row or the keys above the last rejected
        # candidate, x1 over P or the keys above x when x is not kept).
        x_split = tl.where(have0, x, x1)
        if WANT_THR or not HAS_P:
            x = x_split

    if HAS_K:
        kk = tl.load(k_ptr + b).to(tl.int32)
        k_eff = tl.where(kk > 0, kk, V + 1)
        # Start above the k-th largest chunk max when k <= the number of chunks: k distinct chunks hold a value at
        # or above it, so nothing below it is kept, and on flat rows only a few more than k values lie above.
        kth = tl.sum(tl.where(ci == kk - 1, tl.sort(cmax, descending=True), 0.0), axis=0)
        lo = tl.where((kk > 0) & (kk <= n_chunks), tl.maximum(lo, _key(kth)), lo)
        hi = m_key + 1   # invariant: count(key >= lo) >= k > count(key >= hi)
        searching = live & (kk > 0)
        while searching:
            cnt, mass, a_min, b_max, _, win_i = _stats(row_ptr, V, temp, m, _spread(lo, hi, idx, NP), row_key, lo,
                                                       SALT_COL, BLOCK, NP, HAS_TEMP, False, True)
            # At most k at or above lo: each of them has < k strictly above it, and all below lo is dropped.
            stop = _pick(cnt, idx, 0) <= k_eff
            j = tl.sum((cnt >= k_eff).to(tl.int32), axis=0) - 1
            lo = tl.where(stop, lo, _pick(a_min, idx, j))
            hi = tl.where(stop, hi, _pick(b_max, idx, j + 1) + 1)
            # The race winner over key >= lo (no key lies in [s_j, a_j)): on the last pass, over the survivors.
            x = tl.where(stop, _pick(win_i, idx, 0), _pick(win_i, idx, j))
            searching = (stop == 0) & (hi.to(tl.int64) - lo.to(tl.int64) > 1)

    if HAS_P:
        pp = tl.load(p_ptr + b).to(tl.float32)
        use_p = live & (pp < 1.0)
        if WANT_THR:
            # Bracket search on the mass: mass(key >= lo) >= top_p * Z_P > mass(key >= hi), Z_P = mass(key >= lo)
            # on entry (the first pass's column 0; it is >= 1, the max contributing exp(0)).
            hi = m_key + 1
            z_p = tl.full([], 0.0, tl.float32)
            searching = use_p
            while searching:
                cnt, mass, a_min, b_max, _, _ = _stats(row_ptr, V, temp, m, _spread(lo, hi, idx, NP), row_key, lo,
                                                       SALT_COL, BLOCK, NP, HAS_TEMP, False)
                z_p = tl.where(z_p == 0.0, _pick(mass, idx, 0), z_p)
                target = tl.maximum(pp * z_p, 1e-30)   # > 0, so mass(key >= hi) = 0 stays below it
                j = tl.sum((mass >= target).to(tl.int32), axis=0) - 1
                lo = _pick(a_min, idx, j)
                hi = _pick(b_max, idx, j + 1) + 1
                searching = hi.to(tl.int64) - lo.to(tl.int64) > 1
        else:
            # Rejection with rising pivots (module docstring). One pass tests candidate x (column 1: the mass
            # strictly above it; column 0: the mass of all that min-p / top-k kept) and draws the next candidate,
            # the race winner over the keys above x.
            searching = use_p
            if HAS_SPLIT:   # x's test is done: accepted, or x1 is the next candidate (superset of A, untested)
                accept0 = have0 & (above_x0 < pp * z_split) & (rejected == 0)
                x = tl.where(use_p, tl.where(accept0, x, x1), x_split)
                searching = use_p & (accept0 == 0)
            x_key = _value_key(row_ptr, x, temp, HAS_TEMP)
            have = x_key >= lo
            while searching:
                above = tl.where(have, x_key + 1, lo)
                cnt, mass, a_min, b_max, nxt, _ = _stats(row_ptr, V, temp, m, tl.where(idx == 0, lo, above),
                                                         row_key, above, SALT_COL, BLOCK, NP, HAS_TEMP, True)
                accept = have & (_pick(mass, idx, 1) < pp * _pick(mass, idx, 0))
                x = tl.where(accept, x, nxt)
                x_key = _value_key(row_ptr, x, temp, HAS_TEMP)
                have = x_key >= lo
                searching = accept == 0
            do_draw = live & (use_p == 0)   # an accepted candidate is already the race winner over A

    if do_draw:
        if _value_key(row_ptr, x, temp, HAS_TEMP) < lo:   # x is not kept: the race winner over A instead
            x, _ = _draw(row_ptr, V, temp, row_key, lo, SALT_COL, BLOCK, HAS_TEMP)
    tl.store(out_ptr + b, x.to(tl.int64))
    if WANT_THR:
        tl.store(thr_ptr + b, _unkey(lo))


_ROUNDS_COMPILED: set = set()


def _compile_rounds(logits, seeds, positions, temperature, top_k, top_p, min_p, block, chunk, num_warps,
                    max_top_k) -> None:
    """A small batch runs no round kernels, so the first large batch would compile them mid-run (seconds on a
    cold Triton cache, every request waiting): the first small batch of each kind also samples a throwaway batch
    of _ROUNDS_MIN_ROWS copies of its first row, which compiles (or loads) them now, with the kernels it compiles
    anyway."""
    args = (logits, seeds, positions, temperature, top_k, top_p, min_p)
    key = (logits.device, logits.dtype, logits.shape[1], block, chunk, num_warps, max_top_k,
           *(None if t is None else t.dtype for t in args[3:]))
    if not logits.is_cuda or key in _ROUNDS_COMPILED or torch.cuda.is_current_stream_capturing():
        return
    _ROUNDS_COMPILED.add(key)
    rep = [None if t is None else t[:1].repeat(_ROUNDS_MIN_ROWS, *([1] * (t.dim() - 1))) for t in args]
    topk_topp_sample(*rep, block=block, chunk=chunk, num_warps=num_warps, max_top_k=max_top_k)


def topk_topp_sample(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                     temperature: torch.Tensor | None = None, top_k: torch.Tensor | None = None,
                     top_p: torch.Tensor | None = None, min_p: torch.Tensor | None = None,
                     want_threshold: bool = False, block: int = _BLOCK, chunk: int = _CHUNK,
                     num_warps: int = _ROW_WARPS, max_top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens [B] int64, thresholds [B] fp32 or None) for logits [B, V] (any float dtype, last dim contiguous).

    seeds / positions [B] int64 key the race noise (sampling_rng). temperature [B] (optional) divides the fp32
    logits first. top_k [B] int (<= 0 = off), top_p [B] float in (0, 1] (1 = off), min_p [B] float (0 = off); a
    None parameter is off for every row. With want_threshold the second result holds, per row, the smallest kept
    temperature-scaled value: the kept set is exactly `logits.float() / temperature >= threshold` (-inf = all).
    block / num_warps: the columns per iteration of the row program and its warps; chunk: the columns of one pass-0
    program (powers of 2; small ones are for the interpreter's tests). max_top_k: the largest top_k of the batch
    (0: unknown); up to TOPK_SELECT_MAX, kernels/triton_topk_select draws the rows with top-k from torch.topk's
    candidates instead (no search passes, no full-row passes), and the kernels here draw only the rows without.
    """
    b, v = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    thr = torch.empty(b if want_threshold else 1, dtype=torch.float32, device=logits.device)
    if b == 0:
        return out, (thr if want_threshold else None)
    selected = top_k is not None and 0 < max_top_k <= TOPK_SELECT_MAX
    if selected:
        select_sample(logits, seeds, positions, temperature, top_k, top_p, min_p, max_top_k, out,
                      thr if want_threshold else None, block)
    # The rows without top-k (top_k 0) still run below: which rows those are is on the device only, so the
    # kernels below launch in full and the programs of selected rows return at once.
    search = top_k is not None and not selected
    dummy = seeds
    k_arg = top_k if top_k is not None else dummy
    pdl = launch_kwargs(logits.device, "sampling")
    n_chunks = triton.cdiv(v, chunk)
    cmax = torch.empty((b, n_chunks), dtype=torch.float32, device=logits.device)
    cbest = torch.empty((b, n_chunks), dtype=torch.float32, device=logits.device)
    cidx = torch.empty((b, n_chunks), dtype=torch.int32, device=logits.device)
    temp = temperature if temperature is not None else dummy
    salts = dict(SALT_SEED=rng._SALT_SEED, SALT_POS=rng._SALT_POS, SALT_COL=rng._SALT_COL)
    _chunks_kernel[(b, n_chunks)](logits, logits.stride(0), seeds, positions, temp, k_arg, cmax, cbest, cidx, v,
                                  n_chunks, BLOCK=chunk, HAS_TEMP=temperature is not None, SELECTED=selected,
                                  num_warps=8, **salts, **pdl)
    # The split first pass pays for top-p alone (its first rejection test spread over the chunks: -37% at batch 1,
    # -37% at 256 on the H200); with top-k the row program searches first, and min-p alone needs no test pass.
    split = not search and top_p is not None
    # Then each round decides the rows' last candidate and tests the next one of the rows that rejected theirs,
    # spread over the chunks like the split pass; a row whose first _ROUNDS candidates are all rejected (probability
    # <= (1 - top_p) ** _ROUNDS) goes on serially in the row program. Programs of finished rows return at once, so a
    # round costs little once most rows are done. The threshold search needs the split's own draw instead.
    # The smallest batches skip the rounds: a row rejects x0 rarely (top_p 0.95: about one row in 20), so at one to
    # three rows the rounds' three launches cost more than the serial passes they save; from a few rows on, the
    # chance that some row of the batch streams serially (and the whole batch waits for it) makes them pay.
    rounds = _ROUNDS if split and not want_threshold and b >= _ROUNDS_MIN_ROWS else 0
    if split and not want_threshold and not rounds:
        _compile_rounds(logits, seeds, positions, temperature, top_k, top_p, min_p, block, chunk, num_warps,
                        max_top_k)
    if split:
        smass, sabove, swin = (torch.empty_like(cmax) for _ in range(3))
        swidx = torch.empty_like(cidx)
        _split_kernel[(b, n_chunks)](
            logits, logits.stride(0), seeds, positions, temp, min_p if min_p is not None else dummy, k_arg, cmax,
            cbest, cidx, smass, sabove, swin, swidx, v, n_chunks, int(rounds == 0), KEY_NEG_INF=_KEY_NEG_INF,
            BLOCK=chunk,
            CHUNKS_P2=triton.next_power_of_2(n_chunks), HAS_TEMP=temperature is not None, HAS_MINP=min_p is not None,
            SELECTED=selected, num_warps=8, **salts, **pdl)
    else:
        smass = sabove = swin = cmax
        swidx = cidx
    state = cidx
    for r in range(rounds):
        # Fresh allocations, not views into one buffer: a view's offset changes the pointers' 16-byte alignment
        # with the batch size, and Triton compiles a variant per alignment (seconds each, mid-run).
        nxt = (torch.empty_like(cmax), torch.empty_like(cmax), torch.empty_like(cidx),
               torch.empty(b, dtype=torch.int32, device=logits.device))
        _round_kernel[(b, n_chunks)](
            logits, logits.stride(0), seeds, positions, temp, top_p, min_p if min_p is not None else dummy, k_arg,
            cmax, cbest, cidx, smass, sabove, swin, swidx, state, *nxt, out, v, n_chunks, KEY_NEG_INF=_KEY_NEG_INF,
            BLOCK=chunk, CHUNKS_P2=triton.next_power_of_2(n_chunks), HAS_TEMP=temperature is not None,
            HAS_MINP=min_p is not None, FIRST=r == 0, SELECTED=selected, num_warps=8, **salts, **pdl)
        sabove, swin, swidx, state = nxt
    _topk_topp_kernel[(b,)](
        logits, logits.stride(0), seeds, positions, temp, k_arg, top_p if top_p is not None else dummy,
        min_p if min_p is not None else dummy, cmax, cbest, cidx, smass, sabove, swin, swidx, state, out, thr, v,
        n_chunks, rounds,
        KEY_NEG_INF=_KEY_NEG_INF, BLOCK=block, NP=_NP, CHUNKS_P2=triton.next_power_of_2(n_chunks),
        HAS_TEMP=temperature is not None, HAS_K=search, HAS_P=top_p is not None, HAS_MINP=min_p is not None,
        WANT_THR=want_threshold, HAS_SPLIT=split, SELECTED=selected, num_warps=num_warps,
        **salts, **pdl)
    return out, (thr if want_threshold else None)
