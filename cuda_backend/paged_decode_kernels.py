"""The Triton kernels of paged decode attention (launched by
``paged_decode``, which chooses and marshals them).

Each walks a row's page table and reads only positions ``start .. pos``
once, with an online softmax in float32:

- ``one_pass_kernel``: one program per (row, query head), or per row and a
  few of its heads, walks the whole context, BLOCK_N keys per iteration;
- ``split_kernel`` then ``combine_kernel`` (flash-decoding): each (row,
  head) is spread over programs of ``chunk`` keys, whose partial softmax
  states the second pass combines; or, with LAST_COMBINES, the last of
  those programs to finish combines them (one launch fewer); or, with
  WHOLE, a (row, head) is one program of one block, every key read before
  the wait, that finishes itself (short buckets at few rows).

With NEW (a compile-time flag) q arrives before its rotary embedding and the
step's own key and value come raw: rotary, the KV write and attention run as
one kernel (``_new_token``). With SLICES > 1 as well, q, k and v arrive as
a projection's float32 partial sums, SLICES slices ``sp_s`` apart, which
the kernels add and round to DT as the projection's whole output would be
(``_load_sum``). With ACT the programs of a row also apply an
MLP activation to a share of its columns (``_activate``). With PDL each is
launched dependent on the kernel before it (``cuda_backend.pdl``).

Shapes: q ``[B, H, D]``, keys/values ``[N * page_size, KVH, D]``, page table
``[B, P]``, positions ``[B]`` (the query's position; keys ``<= pos``).
"""

from __future__ import annotations

from bubblefree.cuda_backend.pdl import enter, release, tl, triton, wait


if triton is not None:

    @triton.jit
    def _load_sum(ptr, offs, mask, sp_s, SLICES: tl.constexpr, DT: tl.constexpr):
        """``ptr[offs]`` in float32; with SLICES > 1 the sum of SLICES float32
        slices ``sp_s`` apart, rounded to DT (the projection's own output)."""
        x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if SLICES > 1:
            for i in tl.static_range(1, SLICES):  # every slice asked for at once
                x += tl.load(ptr + i * sp_s + offs, mask=mask, other=0.0)
            x = x.to(DT).to(tl.float32)
        return x

    @triton.jit
    def _rope(ptr, d, cs_ptr, sn_ptr, mask, ROT: tl.constexpr, sp_s, SLICES: tl.constexpr,
              DT: tl.constexpr):
        """``ptr[d]`` in float32 after transformers' rotary embedding on its
        first ROT dims (``x * cos + rotate_half(x) * sin``); the rest pass.
        ``ptr`` is SLICES slices of sums (``_load_sum``)."""
        x = _load_sum(ptr, d, mask, sp_s, SLICES, DT)
        if ROT > 0:
            half = ROT // 2
            rot = mask & (d < ROT)
            partner = _load_sum(ptr, tl.where(d < half, d + half, d - half), rot, sp_s, SLICES,
                                DT)
            c = tl.load(cs_ptr + d, mask=rot, other=1.0).to(tl.float32)
            sn = tl.load(sn_ptr + d, mask=rot, other=0.0).to(tl.float32)
            x = x * c + tl.where(d < half, -partner, partner) * sn
        return x

    @triton.jit
    def _new_token(b, h, kvh, d, mask, k_ptr, v_ptr, sk_t, sk_h, sv_t, sv_h,
                   kn_ptr, vn_ptr, cs_ptr, sn_ptr, slot_ptr, skn_b, skn_h, svn_b, svn_h, scs_b,
                   GROUP: tl.constexpr, ROT: tl.constexpr, sp_s, SLICES: tl.constexpr,
                   DT: tl.constexpr):
        """The step's own key (rotated) and value of row ``b`` for query heads
        ``h``, as the cache holds them (its dtype), in float32. The first
        query head of each KV group writes them into the cache at the row's
        slot, for later steps; this step uses them from registers, so no
        program reads a position another program is writing."""
        cs, sn = cs_ptr + b * scs_b, sn_ptr + b * scs_b
        kn = _rope(kn_ptr + b * skn_b + kvh * skn_h, d, cs, sn, mask, ROT, sp_s, SLICES, DT)
        kn = kn.to(k_ptr.dtype.element_ty)
        vn = _load_sum(vn_ptr + b * svn_b + kvh * svn_h, d, mask, sp_s, SLICES, DT)
        vn = vn.to(v_ptr.dtype.element_ty)
        slot = tl.load(slot_ptr + b)
        writer = mask & (h % GROUP == 0)
        tl.store(k_ptr + slot * sk_t + kvh * sk_h + d, kn, mask=writer)
        tl.store(v_ptr + slot * sv_t + kvh * sv_h + d, vn, mask=writer)
        return kn.to(tl.float32), vn.to(tl.float32)

    @triton.jit
    def _gelu(f, ACT: tl.constexpr):
        """GELU in float32: 1 the tanh form (transformers' gelu_new), 2 erf."""
        if ACT == 1:
            y = 0.7978845608028654 * (f + 0.044715 * f * f * f)
            # tanh(y) = 1 - 2 / (exp(2y) + 1): exact at both infinities
            return 0.5 * f * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))
        else:
            return 0.5 * f * (1.0 + tl.math.erf(f * 0.7071067811865476))

    @triton.jit
    def _activate(src, dst, j, per, n, ACT: tl.constexpr, BLOCK_F: tl.constexpr):
        """``dst[c] = act(src[c])`` for one row's columns ``j * per ..``
        (``per`` of the ``n``): each program of the row takes its share."""
        lo = j * per
        hi = tl.minimum(lo + per, n)
        for c in range(lo, hi, BLOCK_F):
            idx = c + tl.arange(0, BLOCK_F)
            ok = idx < hi
            f = tl.load(src + idx, mask=ok, other=0.0).to(tl.float32)
            tl.store(dst + idx, _gelu(f, ACT).to(dst.dtype.element_ty), mask=ok)

    @triton.jit
    def one_pass_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, pos_ptr, out_ptr,
                kn_ptr, vn_ptr, cs_ptr, sn_ptr, slot_ptr, f_ptr, fo_ptr,
                sq_b, sq_h, sk_t, sk_h, sv_t, sv_h, spt_b, so_b, so_h,
                skn_b, skn_h, svn_b, svn_h, scs_b, sf_b, sfo_b, f_per, f_n,
                scale, window, sp_s,
                GROUP: tl.constexpr, PS: tl.constexpr, D: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
                STAGES: tl.constexpr, NEW: tl.constexpr, ROT: tl.constexpr,
                ACT: tl.constexpr, BLOCK_F: tl.constexpr, PDL: tl.constexpr,
                SLICES: tl.constexpr, DT: tl.constexpr):
        """One row's query heads ``HEADS * j ..`` over its whole context. The
        heads share the page-table walk, and in the ``[tokens, heads, D]``
        cache their keys for one position are one contiguous run. With NEW,
        q arrives before its rotary embedding and the step's own key and
        value come raw (``_new_token``): rotary, the KV write and attention
        in one kernel. With ACT, the row's programs also write act(f) (see
        ``paged_decode.Activation``)."""
        enter(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # [HEADS] query heads
        kvh = h // GROUP
        pos = tl.load(pos_ptr + b)
        d = tl.arange(0, BLOCK_D)
        hd_mask = (h[:, None] >= 0) & (d[None, :] < D)  # [HEADS, BLOCK_D]
        # Keys ``start .. pos``; without a sliding window ``window`` is huge.
        start = tl.maximum(pos - window + 1, 0)
        first = (start // BLOCK_N) * BLOCK_N
        if NEW:
            q = _rope(q_ptr + b * sq_b + h[:, None] * sq_h, d[None, :], cs_ptr + b * scs_b,
                      sn_ptr + b * scs_b, hd_mask, ROT, sp_s, SLICES, DT)
            kn, vn = _new_token(b, h[:, None], kvh[:, None], d[None, :], hd_mask, k_ptr, v_ptr,
                                sk_t, sk_h, sv_t, sv_h, kn_ptr, vn_ptr, cs_ptr, sn_ptr, slot_ptr,
                                skn_b, skn_h, svn_b, svn_h, scs_b, GROUP, ROT, sp_s, SLICES, DT)
            # The softmax starts from the step's own key (position pos), so
            # the running max is finite from the start; the loop reads the
            # cache below pos.
            m_i = tl.sum(kn * q, 1) * scale
            l_i = tl.full([HEADS], 1.0, tl.float32)
            acc = vn
            end = pos
        else:
            q = tl.load(q_ptr + b * sq_b + h[:, None] * sq_h + d[None, :], mask=hd_mask,
                        other=0.0).to(tl.float32)
            m_i = tl.full([HEADS], -float("inf"), tl.float32)
            l_i = tl.zeros([HEADS], tl.float32)
            acc = tl.zeros([HEADS, BLOCK_D], dtype=tl.float32)
            end = pos + 1
        offs = tl.arange(0, BLOCK_N)
        k_off = kvh[None, :, None] * sk_h + d[None, None, :]
        v_off = kvh[None, :, None] * sv_h + d[None, None, :]
        for base in tl.range(first, end, BLOCK_N, num_stages=STAGES):
            kpos = base + offs  # [BLOCK_N] key positions
            valid = (kpos < end) & (kpos >= start)
            page = tl.load(pt_ptr + b * spt_b + kpos // PS, mask=valid, other=0)
            tok = page * PS + kpos % PS  # [BLOCK_N] flat KV index
            kv_mask = valid[:, None, None] & hd_mask[None, :, :]
            k = tl.load(k_ptr + tok[:, None, None] * sk_t + k_off, mask=kv_mask,
                        other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :, :], 2) * scale  # [BLOCK_N, HEADS]
            s = tl.where(valid[:, None], s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            v = tl.load(v_ptr + tok[:, None, None] * sv_t + v_off, mask=kv_mask,
                        other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v, 0)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * so_b + h[:, None] * so_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=hd_mask)
        if ACT != 0:
            _activate(f_ptr + b * sf_b, fo_ptr + b * sfo_b, tl.program_id(1), f_per, f_n, ACT,
                      BLOCK_F)

    @triton.jit
    def _block_slots(pt_row, kpos, start, hi, dmask, PS: tl.constexpr):
        """Key positions ``kpos`` of a row: which are attended (in ``start ..
        hi``), their cache slots through the row's page table, and the mask
        of their ``[keys, D]`` tiles."""
        valid = (kpos < hi) & (kpos >= start)
        page = tl.load(pt_row + kpos // PS, mask=valid, other=0)
        return valid, page * PS + kpos % PS, valid[:, None] & dmask[None, :]

    @triton.jit
    def _query(ptr, d, cs, sn, dmask, NEW: tl.constexpr, ROT: tl.constexpr, sp_s,
               SLICES: tl.constexpr, DT: tl.constexpr):
        """One query head in float32; with NEW, after its rotary embedding
        (from SLICES slices of sums: ``_load_sum``)."""
        if NEW:
            q = _rope(ptr, d, cs, sn, dmask, ROT, sp_s, SLICES, DT)
        else:
            q = tl.load(ptr + d, mask=dmask, other=0.0).to(tl.float32)
        return q

    @triton.jit
    def split_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr,
                      cs_ptr, sn_ptr,
                      sq_b, sq_h, sk_t, sk_h, sv_t, sv_h, spt_b, scs_b,
                      scale, window, chunk, splits, heads,
                      cnt_ptr, out_ptr, so_b, so_h, kn_ptr, vn_ptr, slot_ptr, f_ptr, fo_ptr,
                      skn_b, skn_h, svn_b, svn_h, sf_b, sfo_b, f_per, f_n, sp_s,
                      GROUP: tl.constexpr, PS: tl.constexpr, D: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NEW: tl.constexpr,
                      ROT: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                      LAST_COMBINES: tl.constexpr, BLOCK_S: tl.constexpr, ACT: tl.constexpr,
                      BLOCK_F: tl.constexpr, SLICES: tl.constexpr, DT: tl.constexpr,
                      OWN: tl.constexpr = False, EARLY: tl.constexpr = False,
                      WHOLE: tl.constexpr = False):
        """Keys ``s * chunk ..`` of one (row, head): the partial softmax state
        (max, sum, unnormalised output) for ``combine_kernel``. With NEW, q
        arrives before its rotary embedding and the step's own key (position
        pos) is left to the combining pass, which writes it. With PREFETCH
        (under PDL) the first block's keys and values are read before the
        wait: they are earlier steps' (positions before pos), and the
        positions and page table were copied in before the step began.

        With LAST_COMBINES the combining pass is this kernel's: each program
        counts itself in at ``cnt_ptr[b * heads + h]`` once its state is
        stored (a barrier, then an acquire-release add: every earlier
        program's stores are visible to the one that counts last), and the
        last of the (row, head) resets the count to 0 for the next launch
        and runs ``_combine`` (the arguments after ``cnt_ptr`` are
        ``combine_kernel``'s). The step's own key is written there as
        before: no program of this kernel reads position pos.

        With OWN (and NEW, without LAST_COMBINES) no pass combines: split 0's
        program joins the step's own key and value to its state (and the
        first query head of each KV group writes them), so the ``splits``
        states of a (row, head) are its whole attention, which the output
        projection combines as it reads them (``skinny_gemm``'s STATES).

        EARLY (with PREFETCH): the next kernel may launch before this one
        waits (``pdl.release`` first, ``pdl.wait`` where ``enter`` would
        be), as ``add_norm``'s EARLY.

        WHOLE (with NEW, one program per (row, head), its chunk the whole
        bucket in one block): the program joins the step's own key as OWN
        does, writes its attention output to ``out_ptr`` and applies ACT's
        activation as ``_combine`` would; no states are stored. With
        PREFETCH every key it reads is asked for before the wait."""
        if EARLY:
            release(PDL)
        if not PREFETCH:
            enter(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        kvh = h // GROUP
        pos = tl.load(pos_ptr + b)
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        if not PREFETCH:
            q = _query(q_ptr + b * sq_b + h * sq_h, d, cs_ptr + b * scs_b, sn_ptr + b * scs_b,
                       dmask, NEW, ROT, sp_s, SLICES, DT)
            if OWN or WHOLE:  # split 0's: asked for beside q's loads
                kn, vn = _new_token(b, h, kvh, d, dmask & (s == 0), k_ptr, v_ptr, sk_t, sk_h,
                                    sv_t, sv_h, kn_ptr, vn_ptr, cs_ptr, sn_ptr, slot_ptr, skn_b,
                                    skn_h, svn_b, svn_h, scs_b, GROUP, ROT, sp_s, SLICES, DT)
        if NEW:
            end = pos
        else:
            end = pos + 1
        start = tl.maximum(pos - window + 1, 0)
        hi = tl.minimum(s * chunk + chunk, end)  # exclusive
        # The first block holds a valid key (``start`` itself, or the chunk's
        # first key): the running max is finite after it, never -inf - -inf.
        # A chunk wholly before ``start`` reads nothing.
        lo = tl.maximum(s * chunk, (start // BLOCK_N) * BLOCK_N)
        hi = tl.where(start < hi, hi, lo)
        m_i = tl.full([], -float("inf"), tl.float32)
        l_i = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        offs = tl.arange(0, BLOCK_N)
        first = lo
        if PREFETCH:
            valid0, tok, kv_mask = _block_slots(pt_ptr + b * spt_b, lo + offs, start, hi, dmask,
                                                PS)
            k0 = tl.load(k_ptr + tok[:, None] * sk_t + kvh * sk_h + d[None, :], mask=kv_mask,
                         other=0.0)
            v0 = tl.load(v_ptr + tok[:, None] * sv_t + kvh * sv_h + d[None, :], mask=kv_mask,
                         other=0.0)
            if EARLY:
                wait(PDL)
            else:
                enter(PDL)
            q = _query(q_ptr + b * sq_b + h * sq_h, d, cs_ptr + b * scs_b, sn_ptr + b * scs_b,
                       dmask, NEW, ROT, sp_s, SLICES, DT)
            if OWN or WHOLE:
                kn, vn = _new_token(b, h, kvh, d, dmask & (s == 0), k_ptr, v_ptr, sk_t, sk_h,
                                    sv_t, sv_h, kn_ptr, vn_ptr, cs_ptr, sn_ptr, slot_ptr, skn_b,
                                    skn_h, svn_b, svn_h, scs_b, GROUP, ROT, sp_s, SLICES, DT)
            if lo < hi:  # the first block, from registers
                sc = tl.sum(k0.to(tl.float32) * q[None, :], 1) * scale
                sc = tl.where(valid0, sc, -float("inf"))
                m_i = tl.max(sc, 0)
                p = tl.exp(sc - m_i)
                l_i = tl.sum(p, 0)
                acc = tl.sum(p[:, None] * v0.to(tl.float32), 0)
            first = lo + BLOCK_N
        # WHOLE with PREFETCH read its one block before the wait: the loop
        # runs no iteration there, and is not compiled (compiled, its
        # reductions took registers: 179 a thread where 164 are left now, at
        # 128 keys in 8 warps).
        stop = hi
        if WHOLE and PREFETCH:
            stop = first
        for base in range(first, stop, BLOCK_N):
            valid, tok, kv_mask = _block_slots(pt_ptr + b * spt_b, base + offs, start, hi, dmask,
                                               PS)
            k = tl.load(k_ptr + tok[:, None] * sk_t + kvh * sk_h + d[None, :], mask=kv_mask,
                        other=0.0).to(tl.float32)
            sc = tl.sum(k * q[None, :], 1) * scale
            sc = tl.where(valid, sc, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new)
            l_i = l_i * alpha + tl.sum(p, 0)
            v = tl.load(v_ptr + tok[:, None] * sv_t + kvh * sv_h + d[None, :], mask=kv_mask,
                        other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            m_i = m_new
        if OWN or WHOLE:  # split 0 only (the others' kn and vn are zeros, their weight 0)
            own = s == 0
            m_own = tl.where(own, tl.sum(kn * q, 0) * scale, -float("inf"))
            top = tl.where(own, tl.maximum(m_i, m_own), 0.0)  # finite where own
            alpha = tl.where(own, tl.exp(m_i - top), 1.0)
            w_own = tl.where(own, tl.exp(m_own - top), 0.0)
            l_i = l_i * alpha + w_own
            acc = acc * alpha + w_own * vn
            m_i = tl.where(own, top, m_i)
        if WHOLE:
            tl.store(out_ptr + b * so_b + h * so_h + d,
                     (acc / l_i).to(out_ptr.dtype.element_ty), mask=dmask)
            if ACT != 0:
                _activate(f_ptr + b * sf_b, fo_ptr + b * sfo_b, h, f_per, f_n, ACT, BLOCK_F)
        else:
            at = (b * heads + h) * splits + s
            tl.store(m_ptr + at, m_i)
            tl.store(l_ptr + at, l_i)
            tl.store(acc_ptr + at * D + d, acc, mask=dmask)
        if LAST_COMBINES:
            tl.debug_barrier()  # the program's stores all made before it counts itself in
            arrived = tl.atomic_add(cnt_ptr + b * heads + h, 1, sem="acq_rel", scope="gpu")
            if arrived == splits - 1:
                tl.atomic_xchg(cnt_ptr + b * heads + h, 0, sem="relaxed", scope="gpu")
                _combine(b, h, m_ptr, l_ptr, acc_ptr, out_ptr, splits, heads, so_b, so_h,
                         q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, cs_ptr, sn_ptr, slot_ptr, f_ptr,
                         fo_ptr, sq_b, sq_h, sk_t, sk_h, sv_t, sv_h, skn_b, skn_h, svn_b, svn_h,
                         scs_b, sf_b, sfo_b, f_per, f_n, scale, sp_s,
                         D, BLOCK_D, BLOCK_S, GROUP, NEW, ROT, ACT, BLOCK_F, True, SLICES, DT)

    @triton.jit
    def _combine(b, h, m_ptr, l_ptr, acc_ptr, out_ptr, splits, heads, so_b, so_h,
                 q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, cs_ptr, sn_ptr, slot_ptr, f_ptr, fo_ptr,
                 sq_b, sq_h, sk_t, sk_h, sv_t, sv_h, skn_b, skn_h, svn_b, svn_h, scs_b,
                 sf_b, sfo_b, f_per, f_n, scale, sp_s,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                 GROUP: tl.constexpr, NEW: tl.constexpr, ROT: tl.constexpr,
                 ACT: tl.constexpr, BLOCK_F: tl.constexpr, PAST_L1: tl.constexpr,
                 SLICES: tl.constexpr, DT: tl.constexpr):
        """One (row, head): its splits' partial states into the output. An
        empty split (max -inf) weighs exp(-inf) = 0. With NEW the step's own
        key and value join here as one more state (``_new_token``); with ACT
        the row's programs write act(f) as ``one_pass_kernel``'s do. With
        PAST_L1 the partial states are read past L1 (``.cg``): in
        ``split_kernel``'s last program they are other programs' stores."""
        first = (b * heads + h) * splits
        si = tl.arange(0, BLOCK_S)
        smask = si < splits
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        states = acc_ptr + (first + si)[:, None] * D + d[None, :]
        if PAST_L1:
            m = tl.load(m_ptr + first + si, mask=smask, other=-float("inf"), cache_modifier=".cg")
            l = tl.load(l_ptr + first + si, mask=smask, other=0.0, cache_modifier=".cg")
            acc = tl.load(states, mask=smask[:, None] & dmask[None, :], other=0.0,
                          cache_modifier=".cg")
        else:
            m = tl.load(m_ptr + first + si, mask=smask, other=-float("inf"))
            l = tl.load(l_ptr + first + si, mask=smask, other=0.0)
            acc = tl.load(states, mask=smask[:, None] & dmask[None, :], other=0.0)
        if NEW:
            q = _rope(q_ptr + b * sq_b + h * sq_h, d, cs_ptr + b * scs_b, sn_ptr + b * scs_b,
                      dmask, ROT, sp_s, SLICES, DT)
            kn, vn = _new_token(b, h, h // GROUP, d, dmask, k_ptr, v_ptr, sk_t, sk_h, sv_t, sv_h,
                                kn_ptr, vn_ptr, cs_ptr, sn_ptr, slot_ptr, skn_b, skn_h, svn_b,
                                svn_h, scs_b, GROUP, ROT, sp_s, SLICES, DT)
            m_new = tl.sum(kn * q, 0) * scale
            top = tl.maximum(tl.max(m, 0), m_new)
            w = tl.exp(m - top)
            w_new = tl.exp(m_new - top)
            out = (tl.sum(w[:, None] * acc, 0) + w_new * vn) / (tl.sum(w * l, 0) + w_new)
        else:
            w = tl.exp(m - tl.max(m, 0))
            out = tl.sum(w[:, None] * acc, 0) / tl.sum(w * l, 0)
        tl.store(out_ptr + b * so_b + h * so_h + d, out.to(out_ptr.dtype.element_ty), mask=dmask)
        if ACT != 0:
            _activate(f_ptr + b * sf_b, fo_ptr + b * sfo_b, h, f_per, f_n, ACT, BLOCK_F)

    @triton.jit
    def combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, splits, heads, so_b, so_h,
                        q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, cs_ptr, sn_ptr, slot_ptr, f_ptr,
                        fo_ptr,
                        sq_b, sq_h, sk_t, sk_h, sv_t, sv_h, skn_b, skn_h, svn_b, svn_h, scs_b,
                        sf_b, sfo_b, f_per, f_n, scale, sp_s,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                        GROUP: tl.constexpr, NEW: tl.constexpr, ROT: tl.constexpr,
                        ACT: tl.constexpr, BLOCK_F: tl.constexpr, PDL: tl.constexpr,
                        SLICES: tl.constexpr, DT: tl.constexpr):
        """One program per (row, head): ``_combine``."""
        enter(PDL)
        _combine(tl.program_id(0), tl.program_id(1), m_ptr, l_ptr, acc_ptr, out_ptr, splits,
                 heads, so_b, so_h, q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, cs_ptr, sn_ptr,
                 slot_ptr, f_ptr, fo_ptr, sq_b, sq_h, sk_t, sk_h, sv_t, sv_h, skn_b, skn_h,
                 svn_b, svn_h, scs_b, sf_b, sfo_b, f_per, f_n, scale, sp_s,
                 D, BLOCK_D, BLOCK_S, GROUP, NEW, ROT, ACT, BLOCK_F, False, SLICES, DT)
