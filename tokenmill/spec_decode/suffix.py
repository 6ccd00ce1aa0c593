"""Suffix decoding (as Arctic Inference describes it): drafts from the continuations of the context's longest
suffix match, in a trie over the request's own tokens and one over earlier requests' outputs.

Each trie holds every substring of at most `max_depth` tokens of the sequences inserted into it, with how often it
occurs. To draft, the longest suffix of the context that occurs earlier with a continuation is found (binary search:
a suffix that has a continuation makes every shorter one have one too), then the most frequent child is followed
while the product of the children's frequencies stays at or above `min_token_prob`; the draft is at most k tokens
and at most `max_spec_factor` x the match length. Of the request's trie and the global one, the draft with the
larger expected number of accepted tokens (the sum of those products) is proposed.
"""
from __future__ import annotations

from collections import OrderedDict

from tokenmill.config.speculative import SpeculativeConfig
from tokenmill.spec_decode.proposer import Proposer


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Substrings of at most `max_depth` tokens of the inserted sequences, with occurrence counts.

    Contract: `extend(seq_id, tokens)` appends tokens to sequence `seq_id` (a sequence's substrings never span into
    another's); `remove(seq_id, tokens)` takes a whole sequence out again (its tokens as inserted); `draft(context,
    k, factor, min_prob)` returns (draft tokens, expected accepted tokens). O(max_depth) dict operations per
    appended token.
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()
        self._active: dict[object, list[_Node]] = {}  # seq -> nodes of its suffixes ending at its last token

    def extend(self, seq_id: object, tokens) -> None:
        active = self._active.get(seq_id, [])
        d = self.max_depth
        for t in tokens:
            t = int(t)
            nxt = []
            for node in [self.root] + active[:d - 1]:   # active[i] is at depth i + 1: extended to depth i + 2
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                child.count += 1
                nxt.append(child)
            active = nxt
        self._active[seq_id] = active

    def end(self, seq_id: object) -> None:
        """No more tokens for `seq_id` (its substrings stay)."""
        self._active.pop(seq_id, None)

    def remove(self, tokens) -> None:
        toks = [int(t) for t in tokens]
        for i in range(len(toks)):
            node = self.root
            for t in toks[i:i + self.max_depth]:
                child = node.children.get(t)
                if child is None:
                    break
                child.count -= 1
                if child.count <= 0:
                    del node.children[t]
                    break
                node = child

    def _find(self, context: list[int], m: int) -> _Node | None:
        node = self.root
        for t in context[len(context) - m:]:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def draft(self, context: list[int], k: int, factor: float, min_prob: float) -> tuple[list[int], float]:
        # The match leaves room for k tokens below it in the trie.
        hi = min(len(context), self.max_depth - 1)
        lo, best = 1, None
        while lo <= hi:  # the longest m whose suffix node has a continuation
            mid = (lo + hi) // 2
            node = self._find(context, mid)
            if node is not None and node.children:
                best, lo = (mid, node), mid + 1
            else:
                hi = mid - 1
        if best is None:
            return [], 0.0
        m, node = best
        room = min(k, int(factor * m), self.max_depth - m)
        out, prob, score = [], 1.0, 0.0
        while len(out) < room and node.children:
            total = sum(c.count for c in node.children.values())
            t, child = max(node.children.items(), key=lambda kv: kv[1].count)
            prob *= child.count / total
            if prob < min_prob:
                break
            out.append(t)
            score += prob
            node = child
        return out, score


class SuffixProposer(Proposer):
    """Suffix decoding over the request's tokens (prompt and outputs) and the outputs of up to
    `suffix_decoding_max_cached_requests` earlier requests (0: no global trie)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.depth = config.suffix_decoding_max_tree_depth
        self.factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.global_trie = SuffixTrie(self.depth)
        self._cached: OrderedDict[int, list[int]] = OrderedDict()   # earlier requests' outputs, oldest first
        self._next_id = 0
        # req -> (its own trie, tokens inserted, its outputs so far)
        self._reqs: dict[str, tuple[SuffixTrie, int, list[int]]] = {}

    def propose(self, req_id: str, tokens: np.ndarray, k: int) -> list[int]:
        st = self._reqs.get(req_id)
        if st is None:  # first call: the prompt is done and its first token sampled
            st = (SuffixTrie(self.depth), len(tokens) - 1, [])
            st[0].extend(req_id, tokens[:-1])
        trie, seen, outputs = st
        new = tokens[seen:].tolist()
        trie.extend(req_id, new)
        outputs.extend(new)
        self._reqs[req_id] = (trie, len(tokens), outputs)
        context = tokens[max(0, len(tokens) - self.depth):].tolist()
        local, s_local = trie.draft(context, k, self.factor, self.min_prob)
        if self.max_cached and self._cached:
            glob, s_glob = self.global_trie.draft(context, k, self.factor, self.min_prob)
            if s_glob > s_local:
                return glob
        return local

    def remove(self, req_id: str) -> None:
        st = self._reqs.pop(req_id, None)
        if st is None or not self.max_cached:
            return
        outputs = st[2]
        if not outputs:
            return
        sid = self._next_id
        self._next_id += 1
        self.global_trie.extend(sid, outputs)
        self.global_trie.end(sid)
        self._cached[sid] = outputs
        while len(self._cached) > self.max_cached:
            _, old = self._cached.popitem(last=False)
            self.global_trie.remove(old)
