// attnplan cuda_ptx: the CUDA-core path's step (core_loop.cuh), kernel-body fragment 2 of 3: one KV tile of the
// warp's ring (K at ks, V at vs, first token ts): scores, the mask, the online-softmax update, P.V.
//   uses: core_loop_rows.cuh's declarations, ks, vs, ts, slot, lv, softcap_log2
// A fragment of the partial / single-pass kernel's body, not a header: decode.cu includes it in place, inside the
// kernel function. The kernel body is text, not calls, on purpose: NVVM optimizes a function before inlining it,
// so moving any of this code into a function (even __forceinline__) changes the PTX the kernel compiles to, and
// measured ptxas's register allocation with it (sm_80 CUDA-core split-K spilled).
        float sc[PASSES][RT];
        tile_scores(sc, qf, ks, slot, lv, qscale, softcap_log2);

        // mask the tile's positions a row cannot see, then the online-softmax update of (m, l, acc); sc
        // becomes p = exp2(s - m). The row max is warp-uniform, so the rescale branch is too.
        if (ts < max_lo || ts + TILE > min_hi) {  // warp-uniform: the tile holds positions a row cannot see
#pragma unroll
            for (int p = 0; p < PASSES; ++p) {
                const int t = ts + p * TPP + slot;
#pragma unroll
                for (int r = 0; r < RT; ++r)
                    if (t < lo[r] || t >= hi[r]) sc[p][r] = NEG_INF;
            }
        }
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            float mx = sc[0][r];
#pragma unroll
            for (int p = 1; p < PASSES; ++p) mx = fmax_nan(mx, sc[p][r]);
#pragma unroll
            for (int off = LPT; off < 32; off <<= 1) mx = fmax_nan(mx, __shfl_xor_sync(FULL_MASK, mx, off));
            // a larger max, or a NaN score (q or a visible K position non-finite): NaN then spreads into m, l and
            // acc, so the row is NaN, never taken for an empty one (fmaxf would drop the NaN, mx > m is false)
            if (!(mx <= m[r])) {
                const float alpha = fast_exp2(m[r] - mx);  // 0 while m = -inf
                m[r] = mx;
                l[r] *= alpha;
#pragma unroll
                for (int j = 0; j < NV; ++j)
#pragma unroll
                    for (int e = 0; e < KVEC; ++e) acc[r][j][e] *= alpha;
            }
            const float mu = m[r] == NEG_INF ? 0.f : m[r];  // never -inf - (-inf)
#pragma unroll
            for (int p = 0; p < PASSES; ++p) {
                const float pr = fast_exp2(sc[p][r] - mu);
                sc[p][r] = pr;
                l[r] += pr;
            }
        }

        if constexpr (QLEN > 1) {  // the tile may hold positions some rows see and others do not: NaN isolation
            if (ts < max_lo || ts + TILE > min_hi)
                tile_pv_isolated(acc, sc, vs, slot, lv, ts, lo, hi);
            else
                tile_pv(acc, sc, vs, slot, lv);
        } else {
            tile_pv(acc, sc, vs, slot, lv);
        }
