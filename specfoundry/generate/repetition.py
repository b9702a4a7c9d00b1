"""Degenerate repetition loops at the end of a generated answer.

A small target decoding greedily often ends an answer that hits the token cap in a loop: one
block of text repeated verbatim until the cap ("I hope this helps! I hope this helps! ...").
Every token after the first repeat is trivially predictable (the draft copies it from the block
one period back), so a long loop adds training tokens that teach nothing new and inflate
held-out accuracy. `loop_cut` finds such a loop so that sf-regen can keep the answer up to and
including one repeat of the block.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_PERIOD = 64
"""Longest repeated block looked for, in tokens (a sentence or two)."""
MIN_REPEATED_TOKENS = 32
"""How many tokens must repeat one period back before a tail counts as a loop: natural text
does not repeat 32 tokens verbatim."""


def loop_cut(ids: Sequence[int], max_period: int = MAX_PERIOD, min_repeated: int = MIN_REPEATED_TOKENS) -> int | None:
    """Length to cut `ids` to when it ends in a loop, else None.

    For each period p (smallest first, so p is the loop's fundamental period), count how many
    tokens at the end equal the token p places earlier: r_p, the run ids[i] == ids[i - p] for
    i = n-1, n-2, .... The tail is a loop of period p when r_p >= max(p, min_repeated): the
    block repeated at least once in full and at least `min_repeated` tokens in all. The loop
    region starts at s = n - r_p - p (its first block is ordinary text); the cut keeps that
    block and one repeat of it, ids[:s + 2p], and is None when nothing would be removed.
    """
    n = len(ids)
    for period in range(1, min(max_period, n // 2) + 1):
        run = 0
        while run < n - period and ids[n - 1 - run] == ids[n - 1 - run - period]:
            run += 1
        if run >= max(period, min_repeated):
            cut = n - run + period  # s + 2p with s = n - run - p
            return cut if cut < n else None
    return None
