"""POP (Partition-guided Online Pruning, docs/methods.md §2) and its variants (§7), as one plan.

``plan`` is the plan every variant binds to, `POPPlan`: the prompt partition plus a candidate
scorer (how a decode step scores the candidates) and a band rule (how wide the candidate band
is). The other modules are the method presets, each with the scorer or band rule it adds: POP
itself (``core``, and its per-shard partition in ``sharded``), gate-scored candidates
(``gate_scored``), low-rank candidate scores (``low_rank``), per-layer bands (``layer_bands``)
and shortlists (``shortlist``, ``shortlist_dynamic``).
"""

from .core import POP, POPPreset, POPShardedPlan
from .gate_scored import GateScoredPOP, GateScorer
from .layer_bands import BandAllocation, LayerBandsPOP, PerLayerBands
from .low_rank import LowRankFactors, LowRankPOP, LowRankScorer
from .plan import BandRule, CandidateScorer, ExactScorer, GlobalBand, POPPlan, UnkeptBand
from .shortlist import ShortlistPOP, ShortlistScorer
from .shortlist_dynamic import ShortlistDynamic

__all__ = [
    "BandAllocation", "BandRule", "CandidateScorer", "ExactScorer", "GateScoredPOP", "GateScorer",
    "GlobalBand", "LayerBandsPOP", "LowRankFactors", "LowRankPOP", "LowRankScorer",
    "POP", "POPPlan", "POPPreset", "POPShardedPlan", "PerLayerBands", "ShortlistDynamic", "ShortlistPOP", "ShortlistScorer", "UnkeptBand",
]
