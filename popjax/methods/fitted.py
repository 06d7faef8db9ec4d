"""What a method fits offline (norms, priors, bases) as hashable values: ``FittedArrays``."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np


def array_digest(a) -> str:
    """A fingerprint of a fitted array's float32 values (a calibration cache key, the memo name
    of a weight copy derived from it)."""
    return hashlib.sha256(np.ascontiguousarray(a, np.float32).tobytes()).hexdigest()


class FittedArrays:
    """Base of the frozen dataclasses that hold what a method fits offline (norms, priors, bases):
    equal and hashed by their non-array fields and their arrays' shapes — ``source`` names the
    model (and corpus) they came from — so a method holding them stays a hashable dataclass
    without hashing megabytes. Subclasses are ``@dataclass(frozen=True, eq=False, repr=False)``."""

    def _identity(self) -> tuple:
        values = (getattr(self, f.name) for f in dataclasses.fields(self))
        return (type(self).__name__, *(("shape", np.shape(v)) if isinstance(v, np.ndarray) else v for v in values))

    def __hash__(self) -> int:
        return hash(self._identity())

    def __eq__(self, other) -> bool:
        return isinstance(other, FittedArrays) and self._identity() == other._identity()

    def __repr__(self) -> str:
        parts = [str(list(v.shape)) if isinstance(v, np.ndarray) else repr(v) for v in
                 (getattr(self, f.name) for f in dataclasses.fields(self))]
        return f"{type(self).__name__}({', '.join(parts)})"
