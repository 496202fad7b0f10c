"""Drafts from the sequence itself: what followed an earlier occurrence of its end. The
ngram method drafts with it alone, and a model's chain of drafts starts with it where the
context repeats (specserve/drafting.py)."""

from __future__ import annotations


def ngram_drafts(tokens: list[int], k: int, max_n: int, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    tokens (of at most max_n tokens) that occurred before; [] when no suffix of at least
    min_n tokens repeats. One pass back over the sequence, comparing only where its last
    token recurs."""
    length = len(tokens)
    if length < 2:
        return []
    last = tokens[-1]
    best_n, best_end = 0, -1
    for end in range(length - 2, -1, -1):  # where an earlier occurrence of the suffix ends
        if tokens[end] != last:
            continue
        n = 1
        while n < max_n and n <= end and tokens[end - n] == tokens[length - 1 - n]:
            n += 1
        if n > best_n:
            best_n, best_end = n, end
            if n == max_n:
                break
    if best_n < max(1, min_n):
        return []
    return tokens[best_end + 1 : best_end + 1 + k]
