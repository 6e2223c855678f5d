// attnplan cuda_ptx: the tensor-core path's end (mma_loop.cuh), kernel-body fragment 2 of 2, after the last tile:
// the 8 lanes of a row (fragment groupIDs) hold different tokens: l is summed over them; then (once every warp is
// done with its ring) the warp's (m, l, acc) go to the end merge's shared memory, [NWARPS][RT][HEAD_DIM] acc, then
// [NWARPS][RT] m and l (head_dim column of acc[md][nt][e]: acc_col).
//   uses: mma_loop_rows.cuh's declarations, smem, warp
//   declares: sm_acc, sm_m, sm_l
// A fragment of the partial / single-pass kernel's body, not a header: decode.cu includes it in place, inside the
// kernel function. The kernel body is text, not calls, on purpose: NVVM optimizes a function before inlining it,
// so moving any of this code into a function (even __forceinline__) changes the PTX the kernel compiles to, and
// measured ptxas's register allocation with it (sm_80 CUDA-core split-K spilled).
    // ---- the 8 lanes of a row (fragment groupIDs) hold different tokens: sum l over them ----
#pragma unroll
    for (int off = 4; off < 32; off <<= 1)
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
            for (int j = 0; j < 2; ++j) l[nt][j] += __shfl_xor_sync(FULL_MASK, l[nt][j], off);

    // ---- merge the KV warps of each row group through shared memory (the rings are free now) ----
    __syncthreads();
    float *sm_acc = reinterpret_cast<float *>(smem);  // [NWARPS][RT][HEAD_DIM]
    float *sm_m = sm_acc + NWARPS * RT * HEAD_DIM;    // [NWARPS][RT]
    float *sm_l = sm_m + NWARPS * RT;                 // [NWARPS][RT]
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
#pragma unroll
        for (int md = 0; md < KS; ++md)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                sts(sm_acc + (warp * RT + nt * 8 + 2 * ft + (e & 1)) * HEAD_DIM + acc_col(md, fg, e >> 1),
                    acc[md][nt][e]);
        if (fg == 0) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                sts(sm_m + warp * RT + nt * 8 + 2 * ft + j, m[nt][j]);
                sts(sm_l + warp * RT + nt * 8 + 2 * ft + j, l[nt][j]);
            }
        }
    }
