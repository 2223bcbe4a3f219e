"""The Triton kernel of :mod:`ppd.decoding.split_attention`, imported only where it runs (Triton comes with
PyTorch's CUDA builds, not with its CPU ones)."""

import triton
import triton.language as tl


@triton.jit
def _block(query, keys, values, mask, first, stop, column0, t, row_ok, d, d_ok, k_w, v_w, m_t, scale, best, total, acc,
           BN: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """The online softmax carried over the slots ``[first, min(first + BN, stop))``: their scores against the
    tile's ``query`` rows, plus, where ``MASKED``, the mask's columns ``slot - column0`` of rows ``t``."""
    n = first + tl.arange(0, BN)
    n_ok = n < stop
    block_keys = tl.load(keys + n[None, :] * k_w + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [D, BN]
    scores = tl.dot(query, block_keys, input_precision=PRECISION) * scale
    if MASKED:
        added = tl.load(mask + t[:, None] * m_t + (n - column0)[None, :], mask=row_ok[:, None] & n_ok[None, :],
                        other=0.0)
        scores += added.to(tl.float32)
    scores = tl.where(n_ok[None, :], scores, float("-inf"))
    new_best = tl.maximum(best, tl.max(scores, 1))
    shift = tl.where(new_best == float("-inf"), 0.0, new_best)  # a row that has seen only -inf so far
    weights = tl.exp(scores - shift[:, None])
    kept = tl.exp(best - shift)
    total = total * kept + tl.sum(weights, 1)
    block_values = tl.load(values + n[:, None] * v_w + d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                           other=0.0)  # [BN, D]
    acc = acc * kept[:, None] + tl.dot(weights.to(block_values.dtype), block_values, input_precision=PRECISION)
    return new_best, total, acc


def pieces(q, k, v, mask, lengths, out, lse, result, counters,
           q_b, q_h, q_t, k_b, k_h, k_w, v_b, v_h, v_w, m_b, m_t, o_p, o_b, o_h, o_r, l_p, l_b, l_h, r_b, r_h, r_t,
           rows, folded, width, piece, scale,
           GROUP: tl.constexpr, KEY_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
           BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, TREE: tl.constexpr, WHOLE: tl.constexpr,
           FUSED: tl.constexpr, PRECISION: tl.constexpr):
    """One piece of the cache for one batch row, key head and tile of folded rows: writes that piece's softmax-
    weighted values (normalised within the piece) and its log-sum-exp, or with ``WHOLE`` (one piece spans the
    width) the attention's result itself into ``result`` (query heads' layout, the query's dtype). ``mask`` is
    added to the scores: the whole width's ``[B, 1, T, W]``, cut into pieces of ``piece`` slots, or with ``TREE``
    the tree's own ``[B, 1, T, T]``, slot ``L_b + j`` its column ``j``, every slot below the row's length ``L_b``
    seen and nothing past ``L_b + T`` read, those ``L_b + T`` slots shared out evenly among the programs along the
    first axis (an empty piece writes a log-sum-exp of minus infinity). With ``FUSED`` the pieces merge themselves:
    each program counts itself done in ``counters`` (one per batch row, key head and tile, zero between launches)
    and the last of a tile's pieces merges them all (:func:`_merge_rows`) and sets its counter back to zero, so
    that no merging kernel follows. ``PRECISION``: the products' input precision (``ieee`` for float32 inputs,
    which would otherwise be multiplied in TF32)."""
    part = tl.program_id(0)
    batch_head = tl.program_id(1).to(tl.int64)  # offsets in 64 bits: a cache layer may hold 2^31 values or more
    tile = tl.program_id(2)
    b = batch_head // KEY_HEADS
    h = batch_head % KEY_HEADS
    r = tile * BM + tl.arange(0, BM)  # folded rows of this tile
    row_ok = r < folded
    t = r % rows  # the tree row ...
    g = r // rows  # ... of query head h * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    query = tl.load(q + b * q_b + (h * GROUP + g)[:, None] * q_h + t[:, None] * q_t + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if TREE:
        # The row's own slots, its prefix and its tree, shared out evenly among the pieces in whole blocks: a cache
        # is captured wider than most rows fill, and pieces cut from the width left the work to the first few.
        length = tl.load(lengths + b).to(tl.int32)  # loop bounds in 32 bits
        end = tl.minimum(length + rows, width)
        share = tl.cdiv(tl.cdiv(end, tl.num_programs(0)), BN) * BN
        start = part * share
        stop = tl.minimum(start + share, end)
    else:
        start = part * piece
        stop = tl.minimum(start + piece, width)
    best = tl.full([BM], float("-inf"), tl.float32)
    total = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BLOCK_D], tl.float32)
    keys = k + b * k_b + h * k_h
    values = v + b * v_b + h * v_h
    if TREE:
        # The prefix, seen by every row: no mask to read or add (a loop of its own, so that its blocks carry none
        # of the tree's masking: mixing the two in one loop made the kernel twice as slow on an H200).
        prefix_stop = tl.minimum(stop, length)
        for first in range(start, prefix_stop, BN):
            best, total, acc = _block(query, keys, values, mask, first, prefix_stop, 0, t, row_ok, d, d_ok, k_w, v_w,
                                      m_t, scale, best, total, acc, BN=BN, MASKED=False, PRECISION=PRECISION)
        # The tree's own slots, its mask's column j at slot length + j.
        for first in range(tl.maximum(start, length), stop, BN):
            best, total, acc = _block(query, keys, values, mask + b * m_b, first, stop, length, t, row_ok, d, d_ok,
                                      k_w, v_w, m_t, scale, best, total, acc, BN=BN, MASKED=True, PRECISION=PRECISION)
    else:
        for first in range(start, stop, BN):
            best, total, acc = _block(query, keys, values, mask + b * m_b, first, stop, 0, t, row_ok, d, d_ok, k_w,
                                      v_w, m_t, scale, best, total, acc, BN=BN, MASKED=True, PRECISION=PRECISION)
    total = tl.maximum(total, 1e-30)  # at least 1 wherever a slot was read; an empty piece keeps 0 / 1e-30
    acc = acc / total[:, None]
    if WHOLE:
        tl.store(result + b * r_b + (h * GROUP + g)[:, None] * r_h + t[:, None] * r_t + d[None, :],
                 acc.to(result.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        tl.store(out + part.to(tl.int64) * o_p + b * o_b + h * o_h + r[:, None] * o_r + d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse + part.to(tl.int64) * l_p + b * l_b + h * l_h + r, best + tl.log(total), mask=row_ok)
        if FUSED:
            # Every thread's stores before the count (a barrier, then the count's release); the last piece's
            # acquire makes the others' stores visible to it, and its loads skip the processor's own cache.
            tl.debug_barrier()
            counter = counters + batch_head * tl.num_programs(2) + tile
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == tl.num_programs(0) - 1:
                _merge_rows(out + b * o_b + h * o_h, lse + b * l_b + h * l_h, result + b * r_b, o_p, o_r, l_p,
                            r_h, r_t, r, row_ok, t, (h * GROUP + g), d, d_ok, tl.num_programs(0), BM=BM,
                            BLOCK_D=BLOCK_D)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_rows(out, lse, result, o_p, o_r, l_p, r_h, r_t, r, row_ok, t, head, d, d_ok, count, BM: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """The ``count`` pieces of one tile's folded rows ``r`` merged by their log-sum-exp, one piece after another
    (a running maximum, as the online softmax keeps), and written into ``result`` (query heads' layout, the query's
    dtype); a piece that read no slot weighs nothing."""
    best = tl.full([BM], float("-inf"), tl.float32)
    total = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BLOCK_D], tl.float32)
    for _ in range(0, count):  # the pointers step a piece at a time (a piece's offset may pass 32 bits)
        sums = tl.load(lse + r, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(out + r[:, None] * o_r + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0,
                       cache_modifier=".cg")
        lse += l_p
        out += o_p
        new_best = tl.maximum(best, sums)
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)
        kept = tl.exp(best - shift)
        weight = tl.exp(sums - shift)
        total = total * kept + weight
        acc = acc * kept[:, None] + part * weight[:, None]
        best = new_best
    merged = acc / tl.maximum(total, 1e-30)[:, None]
    tl.store(result + head[:, None] * r_h + t[:, None] * r_t + d[None, :], merged.to(result.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def merge(out, lse, result, o_p, o_b, o_h, o_r, l_p, l_b, l_h, r_b, r_h, r_t, rows, folded, count,
          GROUP: tl.constexpr, KEY_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
          BP: tl.constexpr, BR: tl.constexpr):
    """The pieces of ``BR`` folded rows of one batch row and key head merged by their log-sum-exp: every piece of
    every row read at once (a block ``[BP, BR, D]``, ``BP`` the piece count rounded up to a power of two), each
    weighted by its share of the whole softmax's sum, summed and written into ``result`` (query heads' layout, the
    query's dtype). A piece that read no slot has a log-sum-exp of minus infinity and weighs nothing."""
    batch_head = tl.program_id(0).to(tl.int64)
    b = batch_head // KEY_HEADS
    h = batch_head % KEY_HEADS
    r = tl.program_id(1) * BR + tl.arange(0, BR)
    row_ok = r < folded
    p = tl.arange(0, BP)
    p_ok = p < count
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    sums = tl.load(lse + p[:, None].to(tl.int64) * l_p + b * l_b + h * l_h + r[None, :],
                   mask=p_ok[:, None] & row_ok[None, :], other=float("-inf"))  # [BP, BR]
    best = tl.max(sums, 0)
    shift = tl.where(best == float("-inf"), 0.0, best)
    shares = tl.exp(sums - shift[None, :])
    shares = shares / tl.maximum(tl.sum(shares, 0), 1e-30)[None, :]
    parts = tl.load(out + p[:, None, None].to(tl.int64) * o_p + b * o_b + h * o_h + r[None, :, None] * o_r
                    + d[None, None, :], mask=p_ok[:, None, None] & row_ok[None, :, None] & d_ok[None, None, :],
                    other=0.0)  # [BP, BR, D]
    merged = tl.sum(parts * shares[:, :, None], 0)
    t = r % rows
    g = r // rows
    tl.store(result + b * r_b + (h * GROUP + g)[:, None] * r_h + t[:, None] * r_t + d[None, :],
             merged.to(result.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# Compiled for a GPU; with TRITON_INTERPRET=1 set before Triton is first imported, run by Triton's interpreter on
# CPU tensors instead (the tests do this in a process of their own).
kernel = triton.jit(pieces)
merge_kernel = triton.jit(merge)
