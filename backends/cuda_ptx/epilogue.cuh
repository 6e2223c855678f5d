// attnplan cuda_ptx: the fused cross-program merge (ATTNPLAN_MERGE 1) at the end of a partial program.
//
// Fused merge (the global reduction of split-K inside the partial kernel instead of a merge kernel launch; peers:
// FlashInfer's merge_states / FlashAttention-2's split-KV combine, both separate kernels): the counters argument
// holds one int32 completion counter per (sequence, KV head), zero before the launch. After writing its split's
// state (every path: tensor-core or CUDA-core split-K, the empty program), every thread fences its stores
// (__threadfence), a barrier gathers the program and one thread counts it with atom.acq_rel.gpu add (release:
// cumulative over the program's stores the barrier ordered before it; acquire: every program counted before has
// released its state). The program that counts last sees the whole group written: it resets the counter to 0
// (ready for the next launch and graph replays) and merges the group's R rows over all num_splits splits in split
// order, its threads in teams of one row's merge_row threads (fewer if the program has fewer warps: several slots
// per thread), the rows spread over the teams, reading the states with ld.global.cg (L2, the coherence point;
// never L1 or the non-coherent path), and writes out (q's dtype) and out_lse. Which program is last does not
// change the result: deterministic. The merge is in the last program's critical path.
#pragma once

// Fused merge: every thread of the program calls it once its split's state is written (o at ob0 + s * o_ss,
// lse at lb0 + s * l_ss; rows r = i*GROUP + g at i * _si + g * _sh; out / out_lse / sinks likewise at the
// group's first head). Release: each thread fences its own state stores (__threadfence), the barrier gathers
// the program, then one thread counts the program in the (sequence, KV head) completion counter with an
// acq_rel atomic: its release is cumulative over the stores the barrier ordered before it, so the whole state
// is visible at gpu scope before the count moves; its acquire makes every state released before it visible
// to that thread, and through the second barrier to the program. The program that counts last resets the
// counter (no other program of the launch touches it again: zero for the next launch and graph replays) and
// merges the group's rows over all splits in split order with the merge kernel's merge_row, reading the
// states through L2 (ld.global.cg). Its threads form teams of TW (one row's merge_row team, fewer warps if the
// program has fewer) that take the rows r, r + TEAMS, ...; each thread keeps 8 splits' o loads in flight.
__device__ __forceinline__ void fused_merge(unsigned char *smem, int tid, int num_splits, int *counter,
                                            const float *ob0, i64 o_si, i64 o_sh, i64 o_ss,
                                            const float *lb0, i64 l_si, i64 l_sh, i64 l_ss,
                                            elem_t *outb, i64 out_si, i64 out_sh, float *olb, i64 ol_si, i64 ol_sh,
                                            const float *sinkb) {
    __threadfence();
    __syncthreads();
    int *flag = reinterpret_cast<int *>(smem);  // the program is done with its shared memory
    if (tid == 0) {
        const bool last = atom_add_acq_rel(counter, 1) == num_splits - 1;
        if (last) atomicExch(counter, 0);
        sts(flag, last ? 1 : 0);
    }
    __syncthreads();
    if (!lds<int>(flag)) return;
    constexpr int TW = cmin(NTHREADS, ROW_MERGE_THREADS), TEAMS = NTHREADS / TW;
    constexpr int NSLOT = merge_slots<TW>();
    const int team = tid / TW;
    if (team >= TEAMS) return;  // whole warps
    for (int rr = team; rr < R; rr += TEAMS) {
        const int i = rr / GROUP, g = rr % GROUP;
        merge_row<TW, 8 / NSLOT, true>(lb0 + (i64)i * l_si + (i64)g * l_sh, l_ss, ob0 + (i64)i * o_si + (i64)g * o_sh,
                                       o_ss, num_splits, sinkb ? sinkb + g : nullptr,
                                       outb + (i64)i * out_si + (i64)g * out_sh,
                                       olb ? olb + (i64)i * ol_si + (i64)g * ol_sh : nullptr, tid % TW);
    }
}
