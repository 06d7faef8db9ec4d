"""POP — Partition-guided Online Pruning (arXiv 2602.06822; docs/methods.md §2), and the base of
the POP presets (§7).

A preset is a method whose hyper-parameters name one candidate scorer and one band rule of a
`POPPlan` (plan.py). `POPPreset` holds what every preset honours, ``ratio``, ``gamma`` (the band
width) and ``aggregate``; each preset adds only options it implements:

    POP              ExactScorer, GlobalBand (or the per-shard plan, sharded.py)
    GateScoredPOP    GateScorer, GlobalBand                         gate_scored.py
    LowRankPOP       LowRankScorer, GlobalBand                      low_rank.py
    ShortlistPOP     ShortlistScorer, GlobalBand or UnkeptBand      shortlist.py
    LayerBandsPOP    ExactScorer, PerLayerBands                     layer_bands.py
    ShortlistDynamic ShortlistScorer, UnkeptBand with m = n_keep    shortlist_dynamic.py (no γ)
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ... import kernels
from ...models.config import ModelConfig
from ..base import DensePlan, MethodError, Plan, RatioMethod, check_gamma, kept_channels, round_half_up
from ..prompt_tokens import check_prompt_tokens
from .blocks import BlockBand, check_block_options
from .plan import EXACT, GLOBAL_BAND, BandRule, CandidateScorer, ExactScorer, POPPlan, check_choice
from .sharded import POPShardedPlan

PARTITIONS = ("global", "per_shard")
WEIGHT_MODES = ("compact", "gather")  # where decode reads the partition's weight rows from

__all__ = ["POP", "POPPlan", "POPPreset", "POPShardedPlan"]


@dataclasses.dataclass(frozen=True)
class POPPreset(RatioMethod):
    """A POP preset: ``ratio`` (docs/methods.md §1), ``gamma`` (the band width, in [0, 1]) and
    ``aggregate``; it binds to the `POPPlan` of `candidate_scorer` under `band_rule`, with the
    rule's m for γ. A ratio that keeps every channel binds to the dense plan."""

    plan_class: ClassVar[type] = POPPlan
    gamma: float = dataclasses.field(default=0.1, kw_only=True)
    # on a vision-language model: which prompt tokens score the partition (prompt_tokens.py)
    prompt_tokens: str = dataclasses.field(default="all", kw_only=True)
    # how a decode step reads its data-dependent rows: "auto", "xla" or "pallas" (`kernels.choose`);
    # hyper-parameters without a kernel path say why in `kernel_refusal`
    kernel: str = dataclasses.field(default="auto", kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        check_gamma(self.gamma)
        check_prompt_tokens(self.prompt_tokens)
        check_choice("kernel", self.kernel, kernels.KERNELS)
        if self.kernel == "pallas" and self.kernel_refusal():
            raise MethodError(f"kernel='pallas' {self.kernel_refusal()}; use kernel='xla' or 'auto'")

    def kernel_refusal(self) -> str:
        """Why these hyper-parameters have no kernel path, completing "kernel='pallas' …" ("":
        every preset's step reads its selected rows through a kernel; POP refuses its
        gathered-weight and per-shard variants)."""
        return ""

    def resolved_kernel(self) -> str:
        """What the decode step runs (`popjax.kernels.RESOLVED`): "auto" is XLA where no kernel
        is wired (`kernel_refusal`)."""
        return "xla" if self.kernel == "auto" and self.kernel_refusal() else kernels.choose(self.kernel)

    def band_rule(self) -> BandRule:
        return GLOBAL_BAND

    def candidate_scorer(self, f: int, n_keep: int, m: int) -> CandidateScorer:
        return EXACT

    def plan_sizes(self, f: int, n_keep: int) -> dict:
        """The `POPPlan` fields beyond f, n_keep and aggregate: m, scorer and band."""
        band = self.band_rule()
        m = band.selected(self.gamma, f, n_keep)
        return {"m": m, "scorer": self.candidate_scorer(f, n_keep, m), "band": band, "prompt_tokens": self.prompt_tokens,
                "kernel": self.resolved_kernel()}


@dataclasses.dataclass(frozen=True)
class POP(POPPreset):
    """Partition-guided Online Pruning: ``POP(ratio=0.2, gamma=0.1, aggregate="per_sequence")``.

    Args:
      ratio: global fraction of decoder parameters removed, in [0, 1); all of it comes from the
        FFN (docs/methods.md §1), attention is never pruned.
      gamma: width of the candidate band as a fraction of f, in [0, 1] (paper default 0.1).
      aggregate: "per_sequence" (default: each sequence its own partition and selection, as the
        paper prunes one request at a time; results independent of batch composition) or
        "shared" (one partition and one selection per batch: batch serving, one compact copy).
      partition: "global" (one ranking over all f channels; under tensor parallelism only scores
        travel) or "per_shard" (the channels split into ``shards`` blocks, each ranking its own
        and keeping n_keep/shards of them; see POPShardedPlan and docs/sharding.md).
      shards: blocks of "per_shard" (must divide f); default: the size of the model's mesh
        "model" axis, or 1 (= a global ranking) for an unsharded model.
      weights: "compact" (default: prefill copies the R ∪ C gate/up rows and down columns into
        the state, so decode runs dense matmuls on contiguous blocks) or "gather" (the state
        keeps only channel ids; every decode step gathers those rows from the model's weights).
        Same outputs; "gather" saves the copy — (3·n_R + 4·m)·d elements per layer, per sequence
        with aggregate="per_sequence" — for per-step gathers (docs/scale_out.md).
      kernel: how a decode step reads the m selected candidates' down rows: "auto" (default:
        the Pallas kernel on TPU and GPU, XLA on a CPU and where no kernel is wired),
        "xla" (XLA's gather and dot) or "pallas" (`popjax.kernels.decode_ffn.gather_matvec`,
        or with ``block`` > 1 `block_matvec`, over an input-major copy of C's down rows, which
        reads only the selected rows or blocks;
        interpret mode on a CPU; on a mesh every device runs it on its replicated copy of C's
        rows). Same outputs. Wired for partition="global" with weights="compact"
        (docs/kernels.md, "POP's wiring"); `popjax.kernels.choose` resolves it at bind.
      block: 1 (default: single channels, POP as the paper defines it) or b > 1: each step
        selects its m candidates in whole blocks of b consecutive rows of the prefill's compact
        candidate copy (C in prompt-importance order), m rounded to whole blocks (blocks.py):
        what the block kernel fetches, one contiguous copy per block. The partition is channel POP's.
      block_order: how prefill lays C out into those blocks: "importance" (default: neighbours
        in prompt importance) or "coactivation" (channels that fired on the same prompt tokens,
        blocks.coactive_blocks); block > 1 only.
    """

    name: ClassVar[str] = "pop"
    partition: str = dataclasses.field(default="global", kw_only=True)
    shards: int | None = dataclasses.field(default=None, kw_only=True)
    weights: str = dataclasses.field(default="compact", kw_only=True)
    block: int = dataclasses.field(default=1, kw_only=True)
    block_order: str = dataclasses.field(default="importance", kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        check_choice("partition", self.partition, PARTITIONS)
        if self.shards is not None and (isinstance(self.shards, bool) or not isinstance(self.shards, int) or self.shards < 1):
            raise MethodError(f"shards={self.shards!r} is invalid; use a positive integer that divides f")
        if self.partition == "per_shard" and self.prompt_tokens != "all":
            raise MethodError(f"prompt_tokens={self.prompt_tokens!r} applies to partition='global' only")
        if self.shards is not None and self.partition != "per_shard":
            raise MethodError(f"shards={self.shards} applies to partition='per_shard' only (partition={self.partition!r})")
        check_choice("weights", self.weights, WEIGHT_MODES)
        check_block_options(self.block, self.block_order)
        if self.block > 1 and self.partition != "global":
            raise MethodError(f"block={self.block} applies to partition='global' only (partition={self.partition!r})")

    def kernel_refusal(self) -> str:
        if self.weights == "compact" and self.partition == "global":
            return ""
        return f"is wired for weights='compact', partition='global' only (weights={self.weights!r}, partition={self.partition!r})"

    def band_rule(self) -> BandRule:
        return GLOBAL_BAND if self.block == 1 else BlockBand(self.block, self.block_order)

    def candidate_scorer(self, f, n_keep, m):
        return ExactScorer(gather=self.weights == "gather", block=self.block)

    def prepare(self, model) -> "POP":
        """per_shard without ``shards`` takes the model mesh's "model" axis size."""
        mesh = getattr(model, "mesh", None)
        if self.partition == "per_shard" and self.shards is None and mesh is not None:
            return dataclasses.replace(self, shards=dict(mesh.shape).get("model", 1))
        return self

    def bind(self, cfg: ModelConfig) -> Plan:
        if self.partition == "global":
            return super().bind(cfg)
        f, n_keep, shards = cfg.intermediate_size, kept_channels(cfg, self.ratio), self.shards or 1
        if f % shards:
            raise MethodError(f"shards={shards} does not divide the FFN width f={f}")
        block = f // shards
        keep = min(block, max(1, round_half_up(n_keep / shards)))
        if n_keep == f or keep == block:
            return DensePlan(f=f, n_keep=f)
        m = GLOBAL_BAND.selected(self.gamma, block, keep)  # POP's m within one block
        return POPShardedPlan(f=f, n_keep=keep * shards, aggregate=self.aggregate, shards=shards, m=m,
                              gather=self.weights == "gather")
