"""The context-parallel split of a packed row (`vlpack.data.plan.context`)."""

from __future__ import annotations

import pytest

from vlpack.data.plan.context import QueryChunk, split_row


def test_split_by_hand():
    """Segments of 8 and 4 tokens over 2 ranks: chunks of 2 and 1; rank 0 holds the first and
    last chunk of each segment, rank 1 the middle two; every chunk sees its segment's keys from
    the segment's start through its own end."""
    r0, r1 = split_row([8, 4], 2)
    assert r0.token_index == [0, 1, 6, 7, 8, 11]
    assert r1.token_index == [2, 3, 4, 5, 9, 10]
    assert r0.chunks == (QueryChunk(0, 0, 2, 0, 2), QueryChunk(2, 6, 2, 0, 8),
                         QueryChunk(4, 8, 1, 8, 9), QueryChunk(5, 11, 1, 8, 12))
    assert r1.chunks == (QueryChunk(0, 2, 2, 0, 4), QueryChunk(2, 4, 2, 0, 6),
                         QueryChunk(4, 9, 1, 8, 10), QueryChunk(5, 10, 1, 8, 11))
    # causal (query, key) pairs: segment 0 gives 1+2+7+8 = 18 and 3+4+5+6 = 18
    assert (r0.causal_pairs, r1.causal_pairs) == (18 + 1 + 4, 18 + 2 + 3)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_every_token_once_and_work_balanced(cp):
    """Each row position on exactly one rank; equal token counts; the same causal work on
    every rank (chunks r and 2·cp−1−r of a segment cost s²(2·cp−1) + s(s+1) pairs for any r);
    the keys of a chunk are exactly the causal prefix
    of its segment (checked against a per-token reference)."""
    lengths = [16 * cp, 2 * cp, 40 * cp, 6 * cp]
    shards = split_row(lengths, cp)
    seen = sorted(t for s in shards for t in s.token_index)
    assert seen == list(range(sum(lengths)))
    assert len({s.num_tokens for s in shards}) == 1
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    for s in shards:
        for c in s.chunks:
            seg = max(i for i, a in enumerate(starts) if a <= c.row_start)
            for q in range(c.row_start, c.row_start + c.length):
                want = range(starts[seg], q + 1)  # causal, inside the sample
                assert c.k_start == want.start and c.row_start + c.length == c.k_end
                assert want.stop <= c.k_end
    work = [s.causal_pairs for s in shards]
    total = sum(n * (n + 1) // 2 for n in lengths)
    assert sum(work) == total
    assert len(set(work)) == 1, work


def test_lengths_must_fit_the_chunks():
    with pytest.raises(ValueError, match=r"segment 1 has 6 tokens, not a positive multiple of "
                                         r"2·cp = 4: set data.pad_to_multiple_of"):
        split_row([8, 6], 2)
    with pytest.raises(ValueError, match="at least 1"):
        split_row([8], 0)
