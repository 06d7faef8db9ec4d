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

``block_order="coactivation"`` groups C's channels into blocks of channels that fired on the
same prompt tokens instead of neighbours in importance (`coactive_blocks`).

``block=1`` is channel POP itself. `results/frontier/block_pop` measures the NLL cost per b. With
a Pallas ``kernel`` the step reads its blocks through `popjax.kernels.decode_ffn.block_matvec`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..base import MethodError, check_block, check_choice, round_half_up
from .plan import GlobalBand

BLOCK_ORDERS = ("importance", "coactivation")  # how prefill lays C out into blocks


def check_block_options(block, order: str) -> None:
    """MethodError unless ``block`` is a block size and ``order`` one of `BLOCK_ORDERS`, other
    than importance only with blocks (a preset's ``block`` and ``block_order``)."""
    check_block(block)
    check_choice("block_order", order, BLOCK_ORDERS)
    if order != "importance" and block == 1:
        raise MethodError(f"block_order={order!r} applies to block > 1 (block={block})")


@dataclasses.dataclass(frozen=True)
class BlockBand(GlobalBand):
    """POP's band (`GlobalBand`: n_C = 2m straddling the cut at n_keep) with m in whole blocks of
    ``block`` candidates."""

    block: int = 128
    order: str = "importance"

    def __post_init__(self):
        check_choice("block_order", self.order, BLOCK_ORDERS)

    def candidate_order(self, w, h, valid, candidates):
        if self.order == "importance":
            return candidates
        return candidates[coactive_blocks(h[..., candidates], valid, w.down_norm[candidates], self.block)]

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


def coactive_blocks(h: jax.Array, valid: jax.Array, down_norm: jax.Array, block: int) -> jax.Array:
    """C's prompt activations h [B, T, n] (n a multiple of ``block``, C in importance order),
    valid [B, T], ‖W_d[:, c]‖ [n] -> a permutation [n] of C's positions in blocks of co-active
    channels. Each channel's profile is its prompt scores |h_c|·‖W_d[:, c]‖ over the valid
    tokens, scaled to unit norm; greedily, the most important channel left seeds a block and
    takes the ``block`` − 1 channels left whose profiles are the most alike (cosine), so a block
    holds channels that fired on the same tokens. n/b rounds of a top-k over n; the [n, n]
    similarities are prefill's only."""
    n = h.shape[-1]
    scores = jnp.abs(h.astype(jnp.float32)) * down_norm.astype(jnp.float32) * valid[..., None]
    profiles = scores.reshape(-1, n)
    profiles = profiles / (jnp.linalg.norm(profiles, axis=0) + 1e-12)
    alike = profiles.T @ profiles  # [n, n], in [0, 1]

    def one_block(k, carry):
        free, order = carry
        seed = jnp.argmax(free)  # the first free position: the most important channel left
        affinity = jnp.where(free, alike[seed], -jnp.inf).at[seed].set(jnp.inf)
        members = jnp.sort(jax.lax.top_k(affinity, block)[1]).astype(jnp.int32)
        return free.at[members].set(False), jax.lax.dynamic_update_slice(order, members, (k * block,))

    start = (jnp.ones(n, bool), jnp.zeros(n, jnp.int32))
    return jax.lax.fori_loop(0, n // block, one_block, start)[1]
