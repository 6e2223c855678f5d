// attnplan cuda_ptx: the program's rows written, kernel-body fragment of the end (after the loops' *_finish.cuh and a
// __syncthreads): the row groups' KV warps' (m, l, acc) in shared memory merged per row and written, to out / out_lse
// in q's dtype when direct (the single pass, a one-unit sequence; the sink joined), else to the unit's workspace
// slot (fp32, 16-byte stores).
//   uses: tid, sm_acc, sm_m, sm_l, vscale, row_sinks, h, hb, direct, ob, osi, osh, lb, lsi, lsh, wb, o_si, o_sh, wlb,
//         l_si, l_sh
// A fragment, not a header: decode.cu includes it in place in the single pass's body (whose PTX it keeps) and as the
// body of write_rows, the partial kernel's out-of-line end (see there).
    // each thread 4 consecutive head_dim columns of one row: the row's warp weights once per 4 columns, 16-byte
    // shared-memory loads and (partial state, 16-byte aligned: host check) stores; warps summed in index order.
    // A one-unit sequence's rows (and the single pass's) go to out, the sink joined; a unit of several to its slot
    constexpr int D4 = HEAD_DIM / 4;
    for (int idx = tid; idx < R * D4; idx += NTHREADS) {
        const int rr = idx / D4, d = (idx % D4) * 4;
        const int w0 = (rr / RT) * NWK, r = rr % RT;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < NWK; ++w) M = fmax_nan(M, lds<float>(sm_m + (w0 + w) * RT + r));  // NaN: a NaN row
        float lsum = 0.f, a[4] = {0.f, 0.f, 0.f, 0.f};
        if (M != NEG_INF) {
#pragma unroll
            for (int w = 0; w < NWK; ++w) {
                const float f = fast_exp2(lds<float>(sm_m + (w0 + w) * RT + r) - M);  // 0 for a warp that saw nothing
                lsum = fmaf(f, lds<float>(sm_l + (w0 + w) * RT + r), lsum);
                const float4 x = lds<float4>(sm_acc + ((w0 + w) * RT + r) * HEAD_DIM + d);
                a[0] = fmaf(f, x.x, a[0]);
                a[1] = fmaf(f, x.y, a[1]);
                a[2] = fmaf(f, x.z, a[2]);
                a[3] = fmaf(f, x.w, a[3]);
            }
        }
        if constexpr (KV8 && !MMA) {  // the CUDA-core fp8 decoder's 2^-8 (FP8_UNIT), out exactly before the scale
#pragma unroll
            for (int e = 0; e < 4; ++e) a[e] *= FP8_UNIT;
        }
        const int i = rr / GROUP, g = rr % GROUP;
        float lse_n, factor;
        finish_row(M, lsum, vscale, row_sinks, h * GROUP + g, lse_n, factor);
        if (direct) {  // out: unit stride, any alignment
            elem_t *dst = ob + (i64)i * osi + (i64)(hb + g) * osh + d;
#pragma unroll
            for (int e = 0; e < 4; ++e) st_state(dst + e, from_float(a[e] * factor));
            if (d == 0 && lb) st_state(lb + (i64)i * lsi + (i64)(hb + g) * lsh, lse_n);
        } else {  // the unit's state (16-byte aligned: host check)
            float4 t4;
            t4.x = a[0] * factor; t4.y = a[1] * factor; t4.z = a[2] * factor; t4.w = a[3] * factor;
            float4 *dst = reinterpret_cast<float4 *>(wb + (i64)i * o_si + (i64)(hb + g) * o_sh + d);
            check_aligned(dst, 16);
            st_state(dst, t4);
            if (d == 0) st_state(wlb + (i64)i * l_si + (i64)(hb + g) * l_sh, lse_n);
        }
    }
