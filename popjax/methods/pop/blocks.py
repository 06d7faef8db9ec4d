"""Block-granular POP: ``POP(ratio, block=b)`` chooses its per-step candidates in whole blocks of
b consecutive rows of the prefill's compact candidate copy instead of one channel at a time.

A kernel reads blocks: a TPU BlockSpec fetches [b, d] tiles (b = 128 fills the lanes), a GPU
program a tile of rows. Channel POP's per-step picks scatter over its candidates, so each costs
a row fetch of its own; block POP's are b consecutive rows of the copy prefill already made.

The partition is channel POP's, unchanged (docs/methods.md §2): prefill ranks every channel by
the prompt's importance, keeps R (a compact copy, read densely every step) and copies C in
ranking order. Only the step's choice among C is coarser:

* sizes: n_keep and n_R are channel POP's; m = min(round(γ·f / 2 / b), ⌊(f − n_keep)/b⌋,
  ⌊n_keep/b⌋) · b, a whole number of blocks (n_C = 2m); a block wider than POP's band (m = 0
  blocks while channel POP has m > 0) is refused in one line;
* decode: the exact scores of C's channels; a block (C's positions k·b … k·b + b − 1: channels
  of neighbouring prompt importance) scores the L2 norm of its channels' scores; the top m/b
  blocks are selected whole (`plan.top_candidates`).

``block=1`` is channel POP itself. `results/frontier/block_pop` measures the NLL cost per b. With
a Pallas ``kernel`` the step reads its blocks through `popjax.kernels.decode_ffn.block_matvec`.
"""

from __future__ import annotations

import dataclasses

from ..base import MethodError, round_half_up
from .plan import GlobalBand


@dataclasses.dataclass(frozen=True)
class BlockBand(GlobalBand):
    """POP's band (`GlobalBand`: n_C = 2m straddling the cut at n_keep) with m in whole blocks of
    ``block`` candidates."""

    block: int = 128

    def selected(self, gamma, f, n_keep):
        b = self.block
        m = min(round_half_up(gamma * f / 2 / b), (f - n_keep) // b, n_keep // b) * b
        channel_m = super().selected(gamma, f, n_keep)
        if m == 0 and channel_m > 0:
            raise MethodError(
                f"block={b} is wider than POP's band here (m={channel_m} candidates chosen per step for gamma={gamma}, "
                f"f={f}, n_keep={n_keep}): use a block of at most {channel_m} or a larger gamma"
            )
        return m
