// attnplan cuda_ptx: the fused cross-program merge (ATTNPLAN_MERGE 1) at the end of a partial program.
//
// The global reduction of split-K inside the partial kernel instead of a merge-kernel launch (peers: FlashInfer's
// merge_states and FlashAttention-2's split-KV combine, both separate kernels): of the units of a (sequence, KV
// head) group (a sequence with two or more units; one-unit sequences write out directly and never count), the
// program that finishes last merges the group's states in unit order with the merge kernel's per-row code
// (merge_accumulate, merge_write: state.cuh), so the result does not depend on which program that is; a group of
// more than FUSED_TEAM units merges in two levels (below). The counters argument holds one int32 completion counter
// per group, counters[b * Hkv + h], then one per team (decode.cu), zero before the launch and again after it (graph
// replays).
#pragma once

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
// kernel's per-row code, reading the states through L2 (ld.global.cg). Its threads form teams of TW (one row's
// merge_row team, fewer warps if the program has fewer) that take the rows r, r + TEAMS, ...; each thread keeps 8
// splits' o loads in flight.
// Two levels (a group of more than FUSED_TEAM units): the units form teams of FUSED_TEAM consecutive units (team j:
// units j FUSED_TEAM .. (j + 1) FUSED_TEAM - 1, the last team shorter), each with its own counter; the program that
// counts last in a team merges the team's states in unit order into a team state (fp32, normalized, no sink) written
// over the team's first slot, then counts the team in the group's counter, and the program that counts the last team
// merges the team states in team order into out. No program merges more than FUSED_TEAM states per level (one
// program merging 49-128 units' states alone ran 1.2-1.7x the merge kernel's step on an H100), and the order is
// fixed by the unit indices alone: bitwise the same whichever programs count last. The team state overwrites the
// team's first slot in place: a team of two warps (head_dim 256) has both warps read that slot's lse, so the team
// waits at a named barrier (bar.sync 1 + team, TW threads) before its lse is written; a one-warp team's only reader
// of it is the lane that writes it.

// Count this program in *counter (n programs count it to completion) and return whether it counted last (then the
// counter is back at zero). Every thread of the program calls it; it begins and ends with a barrier.
__device__ __forceinline__ bool count_last(unsigned char *smem, int tid, int *counter, int n) {
    __syncthreads();
    int *flag = reinterpret_cast<int *>(smem);  // the program is done with its shared memory
    if (tid == 0) {
        const bool last = atom_add_acq_rel(counter, 1) == n - 1;
        if (last) atomicExch(counter, 0);
        sts(flag, last ? 1 : 0);
    }
    __syncthreads();
    return lds<int>(flag) != 0;  // a later count_last writes the flag after its first barrier
}

// Merge n states of every row of the group (row r = i GROUP + g: lse at lb0 + i l_si + g l_sh + s l_ss, o likewise;
// state s at s l_ss / s o_ss) in state order: into out / out_lse with the sink (to_state false), or (to_state true)
// into state 0's own slot as a normalized fp32 state, lse natural-log, no sink. Threads of team >= TEAMS skip.
// Not inlined: fused_merge calls it at two sites (a team's level, then the teams'), and two inlined copies of its
// unrolled loads made the fused specialization's code 31% larger (NVRTC 13.0, sm_90, bf16 head_dim 128 page 16,
// tensor cores: 101.5 KB against 77.2 KB with one level), its 16-unit steps 0.3-1.4 us slower on an H100.
__device__ __noinline__ void fused_merge_rows(int tid, int n, const float *ob0, i64 o_si, i64 o_sh, i64 o_ss,
                                              const float *lb0, i64 l_si, i64 l_sh, i64 l_ss,
                                              elem_t *outb, i64 out_si, i64 out_sh, float *olb, i64 ol_si,
                                              i64 ol_sh, const float *sinkb, bool to_state) {
    constexpr int TW = cmin(NTHREADS, ROW_MERGE_THREADS), TEAMS = NTHREADS / TW;
    constexpr int NSLOT = merge_slots<TW>();
    static_assert(TW == 32 || TEAMS < 16, "a named barrier per team: ids 1 .. 15");
    const int team = tid / TW, t = tid % TW;
    if (team >= TEAMS) return;  // whole warps
    for (int rr = team; rr < R; rr += TEAMS) {
        const int i = rr / GROUP, g = rr % GROUP;
        const float *lr = lb0 + (i64)i * l_si + (i64)g * l_sh;
        const float *orow = ob0 + (i64)i * o_si + (i64)g * o_sh;
        float M, tot, a[NSLOT][4];
        merge_accumulate<TW, 8 / NSLOT, true>(lr, l_ss, orow, o_ss, n, t, M, tot, a);
        if (to_state) {  // program-uniform
            if constexpr (TW > 32) team_barrier(1 + team, TW);  // every warp of the team read state 0's lse
            merge_write_state<TW>(M, tot, a, const_cast<float *>(orow), const_cast<float *>(lr), t);
        } else {
            merge_write<TW>(M, tot, a, sinkb ? sinkb + g : nullptr, outb + (i64)i * out_si + (i64)g * out_sh,
                            olb ? olb + (i64)i * ol_si + (i64)g * ol_sh : nullptr, t);
        }
    }
}

// Fused merge: every thread of the program calls it once its unit's state is written. The group's units are the
// workspace slots first .. first + units - 1, this program's unit is unit k (slot first + k): unit s's o at ob0 +
// s o_ss, lse at lb0 + s l_ss (ob0 / lb0 at slot `first`; rows r = i GROUP + g at i _si + g _sh; out / out_lse / sinks
// likewise at the group's first head). counter: the group's counter; team_counter: this unit's team's (units >
// FUSED_TEAM only, else unused).
// Not inlined: inlined, its code changed ptxas's allocation of the whole kernel, and the tile loop of the fused
// specialization compiled to ~10% more instructions (sm_90, bf16 head_dim 128 page 16, 4 KV warps: 420 against the
// separate merge's 380, extra IMAD / LOP3 address arithmetic); as a call the loop is the separate kernel's (388).
// The call costs once per program, at its end.
__device__ __noinline__ void fused_merge(unsigned char *smem, int tid, int units, int k, int *counter,
                                         int *team_counter, const float *ob0, i64 o_si, i64 o_sh, i64 o_ss,
                                         const float *lb0, i64 l_si, i64 l_sh, i64 l_ss,
                                         elem_t *outb, i64 out_si, i64 out_sh, float *olb, i64 ol_si, i64 ol_sh,
                                         const float *sinkb) {
    int n = units;
    i64 stride_o = o_ss, stride_l = l_ss;
    if (units > FUSED_TEAM) {  // the team's merge into the team's first slot, then the teams'
        const int j0 = k / FUSED_TEAM * FUSED_TEAM, nt = cmin(FUSED_TEAM, units - j0);
        if (!count_last(smem, tid, team_counter, nt)) return;
        fused_merge_rows(tid, nt, ob0 + (i64)j0 * o_ss, o_si, o_sh, o_ss, lb0 + (i64)j0 * l_ss, l_si, l_sh, l_ss,
                         outb, out_si, out_sh, olb, ol_si, ol_sh, sinkb, true);
        n = (units + FUSED_TEAM - 1) / FUSED_TEAM;
        stride_o = o_ss * FUSED_TEAM;
        stride_l = l_ss * FUSED_TEAM;
    }
    if (!count_last(smem, tid, counter, n)) return;
    fused_merge_rows(tid, n, ob0, o_si, o_sh, stride_o, lb0, l_si, l_sh, stride_l, outb, out_si, out_sh, olb, ol_si,
                     ol_sh, sinkb, false);
}
