// attnplan cuda_ptx: the CUDA-core path's rows (core_loop.cuh), kernel-body fragment 1 of 3: this warp's rows
// (row group rg: rows rg*RT + r; rows past R see nothing) with q in fp32 registers (its scores scaled to base 2 in tile_scores), their
// visible ranges, the union, and the online-softmax state.
//   uses: q, q_sb, q_si, q_sh, b, h, rg, lv, L, cs, ce, window_left, qscale
//   declares: qf [RT][NV][KVEC], lo, hi [RT], start, end (KV is read only in [start, end)), max_lo, min_hi (tiles
//             inside [max_lo, min_hi) need no mask), m, l [RT], acc [RT][NV][KVEC]
// A fragment of the partial / single-pass kernel's body, not a header: decode.cu includes it in place, inside the
// kernel function. The kernel body is text, not calls, on purpose: NVVM optimizes a function before inlining it,
// so moving any of this code into a function (even __forceinline__) changes the PTX the kernel compiles to, and
// measured ptxas's register allocation with it (sm_80 CUDA-core split-K spilled).
    // ---- this warp's rows: q in registers (unscaled), visible range [lo, hi) ----
    float qf[RT][NV][KVEC];
    int lo[RT], hi[RT];
    int start = ce, end = cs;  // KV is read only in [start, end): the visible union of the ring's rows
    int max_lo = cs, min_hi = ce;  // tiles inside [max_lo, min_hi) need no mask
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        const int rr = rg * RT + r;
        lo[r] = 0;
        hi[r] = 0;  // padding rows see nothing
        if (rr < R) {
            const int i = rr / GROUP, g = rr % GROUP;
            query_range(i, L, cs, ce, window_left, lo[r], hi[r]);
            if (lo[r] < hi[r]) {
                start = lo[r] < start ? lo[r] : start;
                end = hi[r] > end ? hi[r] : end;
            }
            max_lo = lo[r] > max_lo ? lo[r] : max_lo;
            min_hi = hi[r] < min_hi ? hi[r] : min_hi;
            const elem_t *qp = q + (i64)b * q_sb + (i64)i * q_si + (i64)(h * GROUP + g) * q_sh;
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int v = lv + LPT * j;
                if (v < DV) {
#pragma unroll
                    for (int c = 0; c < QPV; ++c) {
                        float f[VEC];
                        unpack16(*reinterpret_cast<const uint4 *>(qp + v * KVEC + c * VEC), f);
#pragma unroll
                        for (int e = 0; e < VEC; ++e) qf[r][j][c * VEC + e] = f[e];  // scaled per score (tile_scores)
                    }
                } else {
#pragma unroll
                    for (int e = 0; e < KVEC; ++e) qf[r][j][e] = 0.f;
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < NV; ++j)
#pragma unroll
                for (int e = 0; e < KVEC; ++e) qf[r][j][e] = 0.f;
        }
    }
    float m[RT], l[RT], acc[RT][NV][KVEC];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        m[r] = NEG_INF;
        l[r] = 0.f;
#pragma unroll
        for (int j = 0; j < NV; ++j)
#pragma unroll
            for (int e = 0; e < KVEC; ++e) acc[r][j][e] = 0.f;
    }
