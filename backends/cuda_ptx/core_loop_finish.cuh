// attnplan cuda_ptx: the CUDA-core path's end (core_loop.cuh), kernel-body fragment 3 of 3, after the last tile:
// the lanes of a row's token slots hold different tokens: l and acc are summed over them; then (once every warp
// is done with its ring) the warp's (m, l, acc) go to the end merge's shared memory, [NWARPS][RT][HEAD_DIM] acc,
// then [NWARPS][RT] m and l.
//   uses: core_loop_rows.cuh's declarations, smem, warp, lane, slot, lv
//   declares: sm_acc, sm_m, sm_l
// A fragment of the partial / single-pass kernel's body, not a header: decode.cu includes it in place, inside the
// kernel function. The kernel body is text, not calls, on purpose: NVVM optimizes a function before inlining it,
// so moving any of this code into a function (even __forceinline__) changes the PTX the kernel compiles to, and
// measured ptxas's register allocation with it (sm_80 CUDA-core split-K spilled).
    // ---- lanes of one row's token slots hold different tokens: sum l over them ----
#pragma unroll
    for (int off = LPT; off < 32; off <<= 1)
#pragma unroll
        for (int r = 0; r < RT; ++r) l[r] += __shfl_xor_sync(FULL_MASK, l[r], off);

    // ---- lanes of the same head_dim slice hold different tokens: sum their acc ----
#pragma unroll
    for (int off = LPT; off < 32; off <<= 1)
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int j = 0; j < NV; ++j)
#pragma unroll
                for (int e = 0; e < KVEC; ++e) acc[r][j][e] += __shfl_xor_sync(FULL_MASK, acc[r][j][e], off);

    // ---- merge the KV warps of each row group through shared memory (the rings are free now) ----
    __syncthreads();
    float *sm_acc = reinterpret_cast<float *>(smem);  // [NWARPS][RT][HEAD_DIM]
    float *sm_m = sm_acc + NWARPS * RT * HEAD_DIM;    // [NWARPS][RT]
    float *sm_l = sm_m + NWARPS * RT;                 // [NWARPS][RT]
    if (slot == 0) {
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int v = lv + LPT * j;
                if (v < DV) {
                    float *dst = sm_acc + (warp * RT + r) * HEAD_DIM + v * KVEC;
#pragma unroll
                    for (int e = 0; e < KVEC; e += 4) {
                        float4 t4;
                        t4.x = acc[r][j][e]; t4.y = acc[r][j][e + 1]; t4.z = acc[r][j][e + 2]; t4.w = acc[r][j][e + 3];
                        sts(dst + e, t4);
                    }
                }
            }
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            sts(sm_m + warp * RT + r, m[r]);
            sts(sm_l + warp * RT + r, l[r]);
        }
    }
