"""The suffix tree against a brute-force count of every truncated suffix: node counts,
labels, speculation scores, removal (eviction) and its node bound."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from iterserve.spec_decode.suffix_tree import SuffixTree, _Node


def naive_counts(seqs: dict[int, list[int]], depth: int) -> Counter[tuple[int, ...]]:
    """count[p] = number of (sequence, start) whose truncated suffix starts with ``p``."""
    c: Counter[tuple[int, ...]] = Counter()
    for s in seqs.values():
        for i in range(len(s)):
            suf = s[i : i + depth]
            for k in range(1, len(suf) + 1):
                c[tuple(suf[:k])] += 1
    return c


def tree_paths(tree: SuffixTree) -> dict[tuple[int, ...], _Node]:
    """Every node's full path label, read through its (ref_seq, ref_idx) references."""
    out: dict[tuple[int, ...], _Node] = {}
    stack: list[tuple[_Node, tuple[int, ...]]] = [(tree.root, ())]
    while stack:
        node, path = stack.pop()
        for tok, child in (node.children or {}).items():
            label = tuple(tree.seqs[child.ref_seq][child.ref_idx : child.ref_idx + child.length])
            assert len(label) == child.length > 0
            assert label[0] == tok == child.token
            assert child.parent is node
            p = path + label
            out[p] = child
            stack.append((child, p))
    return out


def check(tree: SuffixTree) -> None:
    want = naive_counts(tree.seqs, tree.max_depth)
    paths = tree_paths(tree)
    assert tree.num_nodes == len(paths)
    assert tree.root.count == sum(len(s) for s in tree.seqs.values())
    for p, node in paths.items():
        assert node.count == want[p], p
        assert len(p) <= tree.max_depth
        # Compressed: a node that nothing ends at branches.
        kids = node.children or {}
        ends = node.count - sum(c.count for c in kids.values())
        assert ends >= 0
        if ends == 0:
            assert len(kids) >= 2, p
    # Every distinct prefix of a truncated suffix is reachable with its count.
    for p, cnt in want.items():
        hit = tree._match(list(p))
        assert hit is not None, p
        assert hit[0].count == cnt


def naive_score(seqs: dict[int, list[int]], depth: int, ctx: list[int], k: int,
                factor: float, min_prob: float) -> tuple[float, int] | None:
    """The best (score, match length); None when the most frequent continuation is
    tied somewhere (then the tree's choice among equals is arbitrary)."""
    cnt = naive_counts(seqs, depth)
    best, best_m = 0.0, 0
    ctx = ctx[-depth:]
    for m in range(1, len(ctx) + 1):
        p = tuple(ctx[len(ctx) - m :])
        if cnt[p] == 0:
            break
        limit = min(k, int(m * factor + 1e-6))
        score, prob, n = 0.0, 1.0, 0
        while n < limit:
            nexts = {t[-1]: c for t, c in cnt.items() if len(t) == len(p) + 1 and t[:-1] == p}
            if not nexts:
                break
            tok = max(nexts, key=lambda t: nexts[t])
            if sorted(nexts.values())[-2:] == [nexts[tok]] * 2:
                return None
            prob *= nexts[tok] / cnt[p]
            if prob < min_prob:
                break
            score += prob
            p += (tok,)
            n += 1
        if score >= best:
            best, best_m = score, m
    return best, best_m


@pytest.mark.parametrize("seed", range(6))
def test_random_appends_match_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    depth = rng.choice([1, 2, 3, 5, 8])
    tree = SuffixTree(depth)
    for step in range(300):
        seq = rng.randrange(4)
        tree.append(seq, rng.randrange(3))  # a small alphabet: many repeats and splits
        if step % 37 == 0:
            check(tree)
    check(tree)


@pytest.mark.parametrize("seed", range(6))
def test_removal_matches_brute_force(seed: int) -> None:
    rng = random.Random(100 + seed)
    depth = rng.choice([2, 3, 4, 6])
    tree = SuffixTree(depth)
    live: list[int] = []
    next_id = 0
    for _ in range(40):
        if live and rng.random() < 0.3:
            victim = live.pop(rng.randrange(len(live)))
            tree.remove(victim)
            check(tree)
            continue
        seq = next_id
        next_id += 1
        live.append(seq)
        tree.extend(seq, [rng.randrange(3) for _ in range(rng.randrange(1, 25))])
        # Interleave appends to older sequences: labels then refer across sequences.
        if len(live) > 1:
            tree.extend(rng.choice(live), [rng.randrange(3) for _ in range(5)])
        check(tree)
    for seq in list(live):
        tree.remove(seq)
        check(tree)
    assert tree.num_nodes == 0 and tree.root.count == 0 and not tree.root.children


def test_nodes_stay_linear_in_tokens() -> None:
    rng = random.Random(7)
    tree = SuffixTree(24)
    tree.extend(0, [rng.randrange(50) for _ in range(3000)])
    # A compressed tree has fewer than two nodes per suffix however deep.
    assert tree.num_nodes < 2 * tree.num_tokens


def test_frequencies_pick_the_most_common_continuation() -> None:
    tree = SuffixTree(8)
    # After "1 2" came 3 three times and 4 once.
    for seq, tail in enumerate([3, 3, 4, 3]):
        tree.extend(seq, [9, 1, 2, tail, 5])
    d = tree.speculate([7, 1, 2], max_spec_tokens=4, max_spec_factor=2.0, min_token_prob=0.1)
    assert d.token_ids == [3, 5]
    assert d.probs == pytest.approx([0.75, 0.75])
    assert d.match_len == 2
    assert d.score == pytest.approx(1.5)
    # A probability floor above 3/4 stops the draft before it starts.
    d = tree.speculate([7, 1, 2], max_spec_tokens=4, max_spec_factor=2.0, min_token_prob=0.8)
    assert d.token_ids == []


def test_spec_factor_limits_draft_by_match_length() -> None:
    tree = SuffixTree(16)
    tree.extend(0, list(range(10)))
    d = tree.speculate([0, 1], max_spec_tokens=8, max_spec_factor=1.0, min_token_prob=0.0)
    assert d.token_ids == [2, 3]  # a 2-token match proposes at most 2
    d = tree.speculate([0, 1], max_spec_tokens=8, max_spec_factor=3.0, min_token_prob=0.0)
    assert d.token_ids == [2, 3, 4, 5, 6, 7]
    d = tree.speculate([0, 1], max_spec_tokens=3, max_spec_factor=3.0, min_token_prob=0.0)
    assert d.token_ids == [2, 3, 4]
    assert tree.speculate([42], 8).token_ids == []


@pytest.mark.parametrize("seed", range(4))
def test_speculation_scores_match_brute_force(seed: int) -> None:
    rng = random.Random(200 + seed)
    depth = 6
    tree = SuffixTree(depth)
    for seq in range(5):
        tree.extend(seq, [rng.randrange(4) for _ in range(40)])
    checked = 0
    for _ in range(60):
        ctx = [rng.randrange(4) for _ in range(rng.randrange(1, 9))]
        k, factor, mp = rng.randrange(1, 6), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.2])
        d = tree.speculate(ctx, k, factor, mp)
        want = naive_score(tree.seqs, depth, ctx, k, factor, mp)
        if want is None:
            continue
        checked += 1
        score, m = want
        assert d.score == pytest.approx(score)
        assert d.match_len == m
        assert len(d.token_ids) <= k
    assert checked >= 10
