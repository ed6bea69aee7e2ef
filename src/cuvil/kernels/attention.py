"""Flash-style attention tiles: the node that the x86 attention kernel (:mod:`cuvil.targets.x86.attention`)
implements for FusedAttention (:mod:`cuvil.kernels.lower.attention`).

The lowering stores its operands once per call in the layouts the kernel reads at unit stride (O(S D)
copies against the O(S^2 D) products):

* ``q[B, H, Sq, D]``: the queries, one contiguous row each (their elements are broadcast); or, where they are
  already stored with contiguous rows of ``d`` (``q_axes`` set: BERT's Q projection through the head split), that
  buffer read in place;
* ``kt[B, H, KBLOCKS, D, KB]``: the keys transposed and cut into panels of ``kb`` keys: for each ``d`` one
  contiguous run of ``kb`` keys (``kb / lanes`` vectors), zeros past the last key; or, for a few query rows
  (``k_axes`` set: a decode step) whose keys are stored with contiguous rows of ``d`` (the KV cache), that
  buffer read in place: each key's score is a dot product of its row with the query, ``lanes`` keys' partial
  sums reduced together (no per-call copy of the whole cache);
* ``v[B, H, KBLOCKS * KB, DVP]``: the values, ``dv`` padded with zeros to whole vectors (``dvp``), zero rows
  past the last key; or, where the values are already stored with contiguous rows of whole vectors (``v_axes``
  set: a decode step's KV cache, a graph input), that buffer read in place, keys past the last never read;
* ``mask[MB, MH, MSQ, KBLOCKS * KB]``: the additive mask (0 when the op has none) with each of its batch,
  head and query dims either the output's or 1 (broadcast), ``-inf`` past the last key (so a padded key's
  probability is exp(-inf) = 0 and the kernel needs no key test).

The node is ``E("attention", [b, h, i, c, plain], attr=AttentionTile)``: ``plain`` is the output element
computed by reductions over these buffers (max-shifted softmax, as the reference computes it), the value
every backend may evaluate; the x86 backend replaces the stage by its tiled kernel when the node is the
stage's whole expression.
"""
from __future__ import annotations

import attrs

from typing import Optional, Tuple

from .texpr import Buf, E


def stored_index(axes, at, zero) -> list:
    """The index into a buffer read in place (``AttentionTile``'s ``q_axes`` / ``k_axes`` / ``v_axes``, the key
    panels' stored rows): its dim k takes the logical index ``at[axes[k]]`` (0 batch, 1 head, 2 row or key, 3
    column), or ``zero`` where ``axes[k]`` is None (a broadcast dim)."""
    return [at[a] if a is not None else zero for a in axes]


@attrs.define(eq=False)
class AttentionTile:
    q: Buf
    kt: Buf
    v: Buf
    mask: Buf
    scale: E            # the scalar multiplying every score (an expression with no index variables)
    heads: int          # H: the output's head dim (static)
    d: int              # head size of Q and K
    dv: int             # head size of V and the output
    dvp: int            # dv padded to whole vectors
    kb: int             # keys per panel
    qb: int             # query rows per tile
    zero_nan: bool      # a NaN output element counts as 0 (Where(IsNaN(P), 0, P) upstream)
    keys: object = None     # Sk, the key count (a dim)
    # None: ``v`` is the padded copy; else ``v`` is read in place, each of its dims indexed by the logical axis
    # (0 batch, 1 head, 2 key, 3 column) given here, or 0 where None (a broadcast dim)
    v_axes: Optional[Tuple[Optional[int], ...]] = None
    # None: ``kt`` holds the key panels; else ``kt`` is the keys' buffer read in place (rows of ``d``), its dims
    # indexed by the logical axes (0 batch, 1 head, 2 key, 3 column d) given here, or 0 where None; every
    # row then takes the one-row tile
    k_axes: Optional[Tuple[Optional[int], ...]] = None
    blocks: object = None   # KBLOCKS (a dim) where ``kt`` is read in place
    # None: ``q`` is the queries' copy [B, H, Sq, D]; else ``q`` is their buffer read in place (rows of ``d``, e.g.
    # the Q projection's output seen through the exports' head split), its dims indexed by the logical axes (0
    # batch, 1 head, 2 row, 3 column d) given here, or 0 where None
    q_axes: Optional[Tuple[Optional[int], ...]] = None
    q_dims: Optional[tuple] = None      # (B, Sq): the output's batch and row counts
    # the stage's buffer is [B, Sq, H, Dv] (the heads merged next: the exports' Transpose [0, 2, 1, 3] then reads
    # it at its own index); else [B, H, Sq, Dv]
    out_heads_inner: bool = False

    def out_index(self, n, h, i, c) -> list:
        """The stage buffer's index of output element (n, h, i, c)."""
        return [n, i, h, c] if self.out_heads_inner else [n, h, i, c]

    @property
    def batch(self):
        return self.q.shape[0] if self.q_axes is None else self.q_dims[0]

    @property
    def rows(self):
        """Sq, the query count (a dim: int or symbolic)."""
        return self.q.shape[2] if self.q_axes is None else self.q_dims[1]

    @property
    def key_blocks(self):
        return self.kt.shape[2] if self.k_axes is None else self.blocks

    @property
    def flops(self):
        """4 B H Sq Sk_padded D (Q·Kt and P·V as multiply-adds over every key panel)."""
        return 2 * self.batch * self.heads * self.rows * self.key_blocks * self.kb * (self.d + self.dv)


@attrs.define(eq=False)
class AttentionRows:
    """The GPU's form of the node (``E("attention", [b, h, i, c, plain], attr=AttentionRows)``, the kernel of
    :mod:`cuvil.targets.ptx.attention`): no operand is copied; each is an index expression over the variables
    :attr:`vars` (``b, h, i, d, key, c``) read where the graph stores it (the KV cache, the presents, the
    projections' outputs through their head split), so a head split or a transpose is indexing.

    ``q`` is Q[b, h, i, d], ``k`` K[b, h, key, d] (the graph's Kt read transposed), ``v`` V[b, h, key, c],
    ``mask`` the additive mask at [b, h, i, key] (None: none), ``scale`` the score's factor (no variables).
    ``plain`` evaluates these very expressions at ``d < D``, ``key < keys``, ``c < dv``: the ranges the kernel
    reads them at, so the bounds prover's proof of ``plain``'s loads covers the kernel's (ptx/bounds_patterns.py)."""
    q: E
    k: E
    v: E
    mask: Optional[E]
    scale: E
    vars: Tuple[E, ...]     # the variables of the index expressions: b, h, i, d, key, c
    batch: int
    heads: int
    rows: int               # Sq
    keys: int               # Sk
    d: int
    dv: int
    zero_nan: bool
    # the stage's buffer is [B, Sq, H, Dv] (the heads merged next: the exports' Transpose [0, 2, 1, 3] then reads
    # it at its own index, a view, and the Reshape to [B, Sq, H * Dv] another); else [B, H, Sq, Dv]
    out_heads_inner: bool = False

    def out_index(self, b, h, i, c) -> list:
        """The stage buffer's index of output element (b, h, i, c)."""
        return [b, i, h, c] if self.out_heads_inner else [b, h, i, c]

    @property
    def flops(self):
        return 2 * self.batch * self.heads * self.rows * self.keys * (self.d + self.dv)
