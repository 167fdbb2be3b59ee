"""One rule between a prompt's blocks and its tokens, for every count of the reuse decomposition.

A prompt of ``prompt`` tokens is ``ceil(prompt / bs)`` blocks; the last may be partial. The first
``d`` blocks hold ``min(prompt, d × bs)`` tokens (a partial last block counts with its own size),
and ``t`` reused tokens cover the blocks they fill completely (all of them once ``t`` reaches the
prompt). Prompt, available and achieved tokens all go through this rule, so
achieved ≤ available ≤ prompt holds on every path: engines that report whole blocks, and trace
replays whose last block is partial.
"""

from __future__ import annotations


def tokens_of(blocks: int, prompt: int, block_size: int) -> int:
    """Tokens held by the first ``blocks`` blocks of a ``prompt``-token prompt."""
    return min(prompt, max(0, blocks) * block_size)


def blocks_of(tokens: int, prompt: int, n_blocks: int, block_size: int) -> int:
    """Leading blocks (of ``n_blocks``) that ``tokens`` reused tokens cover completely."""
    if tokens >= prompt:
        return n_blocks
    return min(n_blocks, max(0, tokens) // block_size)
