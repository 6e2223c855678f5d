// attnplan cuda_ptx: the tensor-core path's rows (mma_loop.cuh), kernel-body fragment 1 of 2: this warp's rows
// (row group rg: rows rg*RT + nt*8 + n, NTW n8-tiles; rows past R are zero and see nothing) as Q^T's B fragments
// in registers, the visible ranges of the lane's C-fragment rows, their union, and the online-softmax state.
//   uses: q, q_sb, q_si, q_sh, b, h, rg, lane, L, cs, ce, window_left, qscale
//   declares: fg, ft (fragment groupID, thread in group), start, end (KV is read only in [start, end)), max_lo,
//             min_hi (tiles inside [max_lo, min_hi) need no mask), lo, hi [NTW][2], qb [NTW][KS][2], rs [NTW] (the
//             n8-tiles' score scales), m, l [NTW][2], acc [KS][NTW][4]
// A fragment of the partial / single-pass kernel's body, not a header: decode.cu includes it in place, inside the
// kernel function. The kernel body is text, not calls, on purpose: NVVM optimizes a function before inlining it,
// so moving any of this code into a function (even __forceinline__) changes the PTX the kernel compiles to, and
// measured ptxas's register allocation with it (sm_80 CUDA-core split-K spilled).
    // ---- this warp's rows (row group rg: rows rg*RT + nt*8 + n): Q^T's B fragments (raw q) in registers;
    // the visible ranges [lo, hi) of the lane's C-fragment rows nt*8 + 2t + j; the row group's union ----
    const int fg = lane >> 2, ft = lane & 3;  // fragment groupID, thread in group
    int start = ce, end = cs;  // KV is read only in [start, end): the visible union of the row group's rows
    int max_lo = cs, min_hi = ce;  // tiles inside [max_lo, min_hi) need no mask
#pragma unroll
    for (int i = 0; i < QLEN; ++i) {
        if ((i + 1) * GROUP > rg * RT && i * GROUP < rg * RT + RT) {  // warp-uniform: query i has rows here
            int a, z;
            query_range(i, L, cs, ce, window_left, a, z);
            if (a < z) {
                start = a < start ? a : start;
                end = z > end ? z : end;
            }
            max_lo = a > max_lo ? a : max_lo;
            min_hi = z < min_hi ? z : min_hi;
        }
    }
    int lo[NTW][2], hi[NTW][2];
    u32 qb[NTW][KS][2];
    float rs[NTW];  // score scale (base 2) of n8-tile nt
    // B fragment (k-indices 2t, 2t+1 | 2t+8, 2t+9 of k16-step kk) = q columns kk*16 + (2t | 2t+8) for a bf16 /
    // fp16 cache, kk*16 + (4t | 4t+2) for fp8 (the K-dim order of the fp8 K fragments, see mma_loop.cuh)
    constexpr int QC0 = KV8 ? 4 : 2, QC1 = KV8 ? 2 : 8;
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int rr = rg * RT + nt * 8 + 2 * ft + j;
            lo[nt][j] = 0;
            hi[nt][j] = 0;  // padding rows see nothing
            if (rr < R) query_range(rr / GROUP, L, cs, ce, window_left, lo[nt][j], hi[nt][j]);
        }
        rs[nt] = qscale;
        const int rq = rg * RT + nt * 8 + fg;  // this lane's B-fragment row
        if (rq < R) {
            const elem_t *qp = q + (i64)b * q_sb + (i64)(rq / GROUP) * q_si + (i64)(h * GROUP + rq % GROUP) * q_sh;
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) {
                qb[nt][kk][0] = *reinterpret_cast<const u32 *>(qp + kk * 16 + QC0 * ft);
                qb[nt][kk][1] = *reinterpret_cast<const u32 *>(qp + kk * 16 + QC0 * ft + QC1);
            }
        } else {
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) qb[nt][kk][0] = qb[nt][kk][1] = 0u;
        }
        if constexpr (KV8 && DTYPE == 1) {
            // bf16 q with an fp8 cache: the mmas are fp16, so the rows of n8-tile nt move to fp16 as q x 2^e, e
            // putting the tile's largest |q| in [2^14, 2^15): no overflow, and bf16's 8 significant bits fit
            // fp16's 11 for every element down to 2^-32 of that largest |q| (smaller ones round to fp16's subnormal
            // grid, or flush in the mma: an absolute score error under ~2^-28 x max |q| x |k|); 2^-e joins the
            // tile's score scale (exact)
            float amax = 0.f;
#pragma unroll
            for (int kk = 0; kk < KS; ++kk)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    float x0, x1;
                    unpack2(qb[nt][kk][i], x0, x1);
                    amax = fmaxf(amax, fmaxf(fabsf(x0), fabsf(x1)));
                }
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, off));
            const int ex = q_exp_shift(amax);
            const float up = pow2i(ex);
#pragma unroll
            for (int kk = 0; kk < KS; ++kk)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    float x0, x1;
                    unpack2(qb[nt][kk][i], x0, x1);
                    qb[nt][kk][i] = pack2<false>(x0 * up, x1 * up);
                }
            rs[nt] = qscale * pow2i(-ex);
        }
    }
    float m[NTW][2], l[NTW][2], acc[KS][NTW][4];
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
        m[nt][0] = m[nt][1] = NEG_INF;
        l[nt][0] = l[nt][1] = 0.f;
#pragma unroll
        for (int md = 0; md < KS; ++md)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[md][nt][e] = 0.f;
    }
