"""A depth-bounded suffix tree with occurrence counts, updated one token at a time.

The structure behind ``method: "suffix"`` (SuffixDecoding, arXiv 2411.04975). It holds
several token sequences; for every start position ``i`` of every sequence ``s`` the
*truncated suffix* ``s[i : i + max_depth]`` is a path from the root. A node's ``count``
is the number of truncated suffixes whose path passes through or ends in it, so for a
matched context the counts of its children are the frequencies of what followed that
context, across every sequence in the tree: what :meth:`SuffixTree.speculate` scores.

Edges are path-compressed: a node's label is ``length`` tokens of one sequence that
contains it (``ref_seq``, ``ref_idx``), so the tree holds O(tokens) nodes however deep.
Each sequence keeps its *active* suffixes, the last ``max_depth`` ones, which still grow;
each ends exactly at the end of a node's label (an endpoint), which is what lets an
append extend all of them with O(max_depth) work and no rebuilding. Older suffixes have
reached ``max_depth`` and stay fixed.

Removing a sequence walks its suffixes once, takes their counts back, drops nodes no
suffix uses, merges a node left with one child of the same count, and re-points labels
that referred to the removed sequence at a surviving occurrence (found through an
endpoint below). Pure Python: nodes are ``__slots__`` objects whose dicts are created
only when needed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


class _Node:
    __slots__ = ("children", "count", "endpoints", "length", "parent", "ref_idx", "ref_seq",
                 "token")

    def __init__(self, token: int, parent: _Node | None, count: int, length: int,
                 ref_seq: int, ref_idx: int) -> None:
        self.token = token  # the label's first token: the key in the parent's children
        self.parent = parent
        self.count = count
        self.length = length
        self.ref_seq = ref_seq
        self.ref_idx = ref_idx
        self.children: dict[int, _Node] | None = None
        # seq id -> end index (exclusive) of one of its suffixes that ends here.
        self.endpoints: dict[int, int] | None = None

    def set_endpoint(self, seq: int, end: int) -> None:
        if self.endpoints is None:
            self.endpoints = {seq: end}
        else:
            self.endpoints[seq] = end

    def drop_endpoint(self, seq: int) -> None:
        if self.endpoints is not None:
            self.endpoints.pop(seq, None)
            if not self.endpoints:
                self.endpoints = None

    def add_child(self, child: _Node) -> None:
        if self.children is None:
            self.children = {child.token: child}
        else:
            self.children[child.token] = child


@dataclass(slots=True)
class Draft:
    """A speculated continuation: tokens, each one's estimated probability (the product
    of count ratios along the path), their sum (``score``: the expected number of
    accepted tokens if the estimates hold) and the length of the context match."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class SuffixTree:
    """Suffixes of several sequences, each truncated to ``max_depth`` tokens."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node(-1, None, 0, 0, -1, -1)
        self.seqs: dict[int, list[int]] = {}
        # seq id -> the nodes where its active suffixes end, oldest (longest) first.
        self.active: dict[int, deque[_Node]] = {}
        self.num_nodes = 0

    @property
    def num_tokens(self) -> int:
        return self.root.count  # one suffix per token

    def __contains__(self, seq: int) -> bool:
        return seq in self.seqs

    def extend(self, seq: int, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(seq, t)

    def append(self, seq: int, token: int) -> None:
        """Add ``token`` to the end of sequence ``seq`` (created if new)."""
        s = self.seqs.get(seq)
        if s is None:
            s = self.seqs[seq] = []
            self.active[seq] = deque()
        actives = self.active[seq]
        root = self.root
        n = len(s)  # index of the new token
        # The new token starts one more suffix (empty so far, ending at the root).
        actives.append(root)
        root.count += 1
        if len(actives) > self.max_depth:
            actives.popleft()  # that suffix has reached max_depth: it stays where it is
        s.append(token)
        seqs = self.seqs
        for i in range(len(actives)):
            node = actives[i]
            children = node.children
            child = children.get(token) if children is not None else None
            if child is None:
                if node.count == 1 and node is not root:
                    # Only this suffix uses the node (a leaf): lengthen its label in place.
                    node.length += 1
                    node.set_endpoint(seq, n + 1)
                else:
                    leaf = _Node(token, node, 1, 1, seq, n)
                    node.add_child(leaf)
                    self.num_nodes += 1
                    node.drop_endpoint(seq)
                    leaf.set_endpoint(seq, n + 1)
                    actives[i] = leaf
            elif node is not root and node.count == child.count + 1:
                # Everything else in ``node`` goes on to ``child``; this suffix, the only
                # one ending here, does too now: the two would have equal counts.
                if child.length == 1:
                    # Fold ``node`` into ``child``.
                    parent = node.parent
                    assert parent is not None and parent.children is not None
                    child.token = node.token
                    child.count += 1
                    child.length = node.length + 1
                    child.ref_seq, child.ref_idx = seq, n + 1 - child.length
                    child.parent = parent
                    child.set_endpoint(seq, n + 1)  # its own endpoints still end there
                    parent.children[child.token] = child
                    self.num_nodes -= 1
                    actives[i] = child
                else:
                    # Move the boundary one token down: ``node`` takes ``child``'s first.
                    assert children is not None
                    node.length += 1
                    node.ref_seq, node.ref_idx = seq, n + 1 - node.length
                    node.set_endpoint(seq, n + 1)
                    del children[token]
                    child.length -= 1
                    child.ref_idx += 1
                    child.token = seqs[child.ref_seq][child.ref_idx]
                    children[child.token] = child
            elif child.length == 1:
                node.drop_endpoint(seq)
                child.count += 1
                child.ref_seq, child.ref_idx = seq, n  # keep labels on recent sequences
                child.set_endpoint(seq, n + 1)
                actives[i] = child
            else:
                # Split ``child`` after its first token; this suffix ends at the split.
                assert children is not None
                mid = _Node(token, node, child.count + 1, 1, seq, n)
                del children[token]
                node.add_child(mid)
                self.num_nodes += 1
                child.length -= 1
                child.ref_idx += 1
                child.token = seqs[child.ref_seq][child.ref_idx]
                child.parent = mid
                mid.add_child(child)
                node.drop_endpoint(seq)
                mid.set_endpoint(seq, n + 1)
                actives[i] = mid

    def remove(self, seq: int) -> None:
        """Take sequence ``seq`` out of the tree (its counts, nodes and labels)."""
        s = self.seqs.get(seq)
        if s is None:
            raise KeyError(seq)
        root = self.root
        depth = self.max_depth
        n = len(s)
        path: list[_Node] = []
        for start in range(n):
            node = root
            node.count -= 1
            idx = start
            stop = min(n, start + depth)
            path.clear()
            while idx < stop:
                children = node.children
                assert children is not None
                child = children[s[idx]]
                child.count -= 1
                if child.count == 0:
                    del children[s[idx]]
                    if not children:
                        node.children = None
                    self.num_nodes -= self._size(child)
                    break
                child.drop_endpoint(seq)
                idx += child.length
                node = child
                path.append(node)
            # Only the last node can be left with one child of its own count.
            if node is not root and node.children is not None and len(node.children) == 1:
                (only,) = node.children.values()
                if only.count == node.count:  # no suffix ends at ``node`` any more
                    parent = node.parent
                    assert parent is not None and parent.children is not None
                    only.token = node.token
                    only.length += node.length
                    only.ref_idx -= node.length
                    only.parent = parent
                    parent.children[only.token] = only
                    self.num_nodes -= 1
                    node = only
                    if path:
                        path[-1] = only
            self._repoint(node, path, seq)
        del self.seqs[seq]
        del self.active[seq]

    def _size(self, node: _Node) -> int:
        size, stack = 0, [node]
        while stack:
            x = stack.pop()
            size += 1
            if x.children:
                stack.extend(x.children.values())
        return size

    def _repoint(self, node: _Node, path: list[_Node], seq: int) -> None:
        """Labels on ``path`` (ending at ``node``) that point into ``seq``: point them at
        another sequence's occurrence, read off an endpoint below ``node``."""
        if not any(p.ref_seq == seq for p in path):
            return
        leaf, dist = node, 0
        while leaf.children:
            leaf = next(iter(leaf.children.values()))
            dist += leaf.length
        ends = leaf.endpoints
        if not ends:
            return
        other = next((k for k in ends if k != seq), None)
        if other is None:
            return  # a later suffix of ``seq`` visits this leaf again and fixes it then
        end = ends[other] - dist
        # Every node labelled from ``seq`` lies on one of its suffixes' paths, so
        # fixing the path of each suffix removed fixes them all.
        for p in reversed(path):
            end -= p.length
            if p.ref_seq == seq:
                p.ref_seq, p.ref_idx = other, end

    # -- speculation ----------------------------------------------------------------

    def _match(self, context: Sequence[int], start: int = 0) -> tuple[_Node, int] | None:
        """The node and offset in its label where ``context[start:]`` (from the root)
        ends. Labels are compared a slice at a time: the work is per node, not per token."""
        node, idx = self.root, 0
        seqs = self.seqs
        j, n = start, len(context)
        while j < n:
            if idx >= node.length:
                children = node.children
                nxt = children.get(context[j]) if children is not None else None
                if nxt is None:
                    return None
                node, idx = nxt, 0
            take = min(node.length - idx, n - j)
            at = node.ref_idx + idx
            if seqs[node.ref_seq][at : at + take] != context[j : j + take]:
                return None
            idx += take
            j += take
        return node, idx

    def _path(self, node: _Node, idx: int, max_tokens: int, min_prob: float) -> Draft:
        """Follow the most frequent continuation while its probability >= ``min_prob``."""
        d = Draft()
        prob = 1.0
        seqs = self.seqs
        tokens = d.token_ids
        while len(tokens) < max_tokens:
            if idx < node.length:
                # The rest of this label (as far as wanted), at the current probability.
                take = min(node.length - idx, max_tokens - len(tokens))
                at = node.ref_idx + idx
                tokens.extend(seqs[node.ref_seq][at : at + take])
                d.probs.extend([prob] * take)
                d.score += prob * take
                idx += take
                continue
            if not node.children:
                break
            best = max(node.children.values(), key=lambda c: c.count)
            prob *= best.count / node.count
            if prob < min_prob:
                break
            node, idx = best, 0
        return d

    def speculate(self, context: Sequence[int], max_spec_tokens: int,
                  max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                  max_spec_offset: float = 0.0) -> Draft:
        """The best-scoring draft over every match length of ``context``'s suffix: a
        match of ``m`` tokens may propose up to ``m * max_spec_factor + offset``; ties go
        to the longer match. (The tree's depth bounds match + draft together.)

        A match of ``m + 1`` tokens with as many occurrences as the match of ``m``
        continues exactly as it does, and may draft at least as far, so it scores at
        least as high: only the last match length before each drop in the count (and
        the longest) is drafted from, which gives the same result as trying them all.
        """
        ctx = list(context[-self.max_depth:])  # (a list: labels compare as list slices)
        n = len(ctx)
        hits: list[tuple[_Node, int]] = []
        for m in range(1, n + 1):
            hit = self._match(ctx, n - m)
            if hit is None:
                break  # no longer suffix can match either
            hits.append(hit)
        best = Draft()
        depth = self.max_depth
        for m in range(1, len(hits) + 1):
            node, idx = hits[m - 1]
            limit = min(max_spec_tokens, int(m * max_spec_factor + max_spec_offset + 1e-6))
            if m < len(hits) and hits[m][0].count == node.count and m + 1 + limit <= depth:
                continue  # the longer match's draft covers this one's
            d = self._path(node, idx, max(limit, 0), min_token_prob)
            if d.score >= best.score:
                d.match_len = m
                best = d
        return best
