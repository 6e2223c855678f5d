// attnplan cuda_ptx: the fused cross-program merge (ATTNPLAN_MERGE 1) at the end of a partial program.
//
// The global reduction of split-K inside the partial kernel instead of a merge-kernel launch (peers: FlashInfer's
// merge_states and FlashAttention-2's split-KV combine, both separate kernels): of the units of a (sequence, KV
// head) group (a sequence with two or more units; one-unit sequences write out directly and never count), the
// program that finishes last merges the group's states in unit order with the merge kernel's merge_row
// (state.cuh), so the result does not depend on which program that is. The counters argument holds one int32
// completion counter per group, counters[b * Hkv + h], zero before the launch and again after it (graph replays).
#pragma once

// Fused merge: every thread of the program calls it once its unit's state is written (the group's units are the
// workspace slots first .. first + units - 1: unit k's o at ob0 + k * o_ss, lse at lb0 + k * l_ss, ob0 / lb0 at slot
// `first`; rows r = i*GROUP + g at i * _si + g * _sh; out / out_lse / sinks likewise at the group's first head).
// Release: the barrier orders every thread's state stores before thread 0's count (bar.sync synchronizes the
// program's threads), and thread 0 counts the program in the (sequence, KV head) completion counter with an acq_rel
// atomic at gpu scope. Release is cumulative in the PTX memory model: the stores ordered before the count through the
// barrier are visible to any thread whose acquire reads this count or a later add of the counter's chain of atomic
// adds, which is how every earlier program's states reach the program that counts last (the pattern of cooperative
// groups' grid sync and CUTLASS's arrive_inc, cutlass/barrier.h: one fence, in the thread that signals; a
// __threadfence in every thread, the classic threadFenceReduction sample, cost every warp a MEMBAR.SC.GPU, ~5% of a
// b1 1K step's stall samples on an H100). That acquire, then the second barrier, orders the program's reads of the
// states after it. The program that counts last resets the counter (no other program of the launch touches it again:
// zero for the next launch and graph replays) and merges the group's rows over its units in unit order with the merge
// kernel's merge_row, reading the states through L2 (ld.global.cg). Its threads form teams of TW (one row's merge_row
// team, fewer warps if the program has fewer) that take the rows r, r + TEAMS, ...; each thread keeps 8 splits' o
// loads in flight.
// Not inlined: inlined, its code changed ptxas's allocation of the whole kernel, and the tile loop of the fused
// specialization compiled to ~10% more instructions (sm_90, bf16 head_dim 128 page 16, 4 KV warps: 420 against the
// separate merge's 380, extra IMAD / LOP3 address arithmetic); as a call the loop is the separate kernel's (388).
// The call costs once per program, at its end.
__device__ __noinline__ void fused_merge(unsigned char *smem, int tid, int units, int *counter,
                                         const float *ob0, i64 o_si, i64 o_sh, i64 o_ss,
                                         const float *lb0, i64 l_si, i64 l_sh, i64 l_ss,
                                         elem_t *outb, i64 out_si, i64 out_sh, float *olb, i64 ol_si, i64 ol_sh,
                                         const float *sinkb) {
    __syncthreads();
    int *flag = reinterpret_cast<int *>(smem);  // the program is done with its shared memory
    if (tid == 0) {
        const bool last = atom_add_acq_rel(counter, 1) == units - 1;
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
                                       o_ss, units, sinkb ? sinkb + g : nullptr,
                                       outb + (i64)i * out_si + (i64)g * out_sh,
                                       olb ? olb + (i64)i * ol_si + (i64)g * ol_sh : nullptr, tid % TW);
    }
}
