// Where the hardware puts the programs of a capacity plan's grid: 384 blocks of 128 threads with 70 KB of dynamic
// shared memory each (3 resident per SM on a 132-SM H100: the H100's cuda_ptx capacity grid at 8 KV heads, 48 slots x 8), each
// recording its SM (%smid) and the ticket it draws from one atomic counter at its start. Prints, for the block sets
// the schedule's placements give 16 and 26 working units of 8 KV heads (packed: blocks 0..8U-1; the spread's window:
// unit j in slot floor(j 33 / U); the whole grid: slot floor(j 48 / U)) and for the first 8U tickets (a program that
// took its unit by arrival), how many distinct SMs hold them and the most on one SM; three runs each without and with
// the blocks holding their SM a while.
//   nvcc -O2 -arch=sm_90 -o /tmp/sm_placement benchmarks/sm_placement.cu && /tmp/sm_placement
#include <cstdio>
#include <vector>
#include <set>
#include <map>
#include <algorithm>
__global__ void probe(int *sm, int *ticket, unsigned long long *t0, unsigned *ctr, int spin) {
    extern __shared__ char smem[];
    if (threadIdx.x == 0) {
        unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
        unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        sm[blockIdx.x] = s; t0[blockIdx.x] = t;
        ticket[blockIdx.x] = atomicAdd(ctr, 1u);
        smem[0] = (char)(s & 1);
    }
    // hold the SM a while, as a working program would (empty ones exit at once in the real kernel)
    long long c0 = clock64(); while (clock64() - c0 < spin) {}
    if (threadIdx.x == 0 && smem[0] == 2) sm[blockIdx.x] = -2;  // never: keeps the shared memory in use
}
static void report(const char *name, const std::vector<int> &blocks, const std::vector<int> &sm) {
    std::map<int, int> per; for (int b : blocks) per[sm[b]]++;
    int mx = 0; for (auto &kv : per) mx = std::max(mx, kv.second);
    printf("%-28s %3zu blocks on %3zu SMs, at most %d on one\n", name, blocks.size(), per.size(), mx);
}
int main() {
    int G = 384, smem = 70 * 1024, nsm; cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0);
    cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    int occ; cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, probe, 128, smem);
    printf("SMs %d, resident blocks per SM %d\n", nsm, occ);
    int *sm, *ticket; unsigned long long *t0; unsigned *ctr;
    cudaMalloc(&sm, G * 4); cudaMalloc(&ticket, G * 4); cudaMalloc(&t0, G * 8); cudaMalloc(&ctr, 4);
    for (int spin : {0, 200000}) for (int rep = 0; rep < 3; ++rep) {
        cudaMemset(ctr, 0, 4);
        probe<<<G, 128, smem>>>(sm, ticket, t0, ctr, spin);
        cudaDeviceSynchronize();
        std::vector<int> hs(G), ht(G); cudaMemcpy(hs.data(), sm, G * 4, cudaMemcpyDeviceToHost);
        cudaMemcpy(ht.data(), ticket, G * 4, cudaMemcpyDeviceToHost);
        printf("-- spin %d, run %d; first 24 blocks' SMs:", spin, rep);
        for (int i = 0; i < 24; ++i) printf(" %d", hs[i]);
        printf("\n");
        std::vector<int> packed, window, whole, first, window26, packed26;
        for (int b = 0; b < 128; ++b) packed.push_back(b);
        for (int j = 0; j < 16; ++j) for (int h = 0; h < 8; ++h) { window.push_back(8 * (j * 33 / 16) + h); whole.push_back(8 * (j * 48 / 16) + h); }
        for (int j = 0; j < 26; ++j) for (int h = 0; h < 8; ++h) { window26.push_back(8 * (j * 33 / 26) + h); packed26.push_back(8 * j + h); }
        std::vector<int> byticket(G); for (int b = 0; b < G; ++b) byticket[ht[b]] = b;
        std::vector<int> first26;
        for (int r = 0; r < 128; ++r) first.push_back(byticket[r]);
        for (int r = 0; r < 208; ++r) first26.push_back(byticket[r]);
        report("packed 16 units", packed, hs); report("window 16 units", window, hs); report("whole 16 units", whole, hs);
        report("first 128 tickets", first, hs);
        report("packed 26 units", packed26, hs); report("window 26 units", window26, hs); report("first 208 tickets", first26, hs);
        int inorder = 0; for (int r = 0; r < G; ++r) inorder += byticket[r] == r; printf("tickets in block order: %d of %d\n", inorder, G);
    }
    return 0;
}
