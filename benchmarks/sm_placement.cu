// Where the hardware puts the programs of a capacity plan's grid. 384 blocks of 128 threads with 70 KB of dynamic
// shared memory each (3 resident per SM on a 132-SM H100, as the H100's cuda_ptx capacity grid at 8 KV heads: 48
// unit slots x 8) record their SM (%smid) and the ticket each draws from one atomic counter at its start.
//
// For the blocks the schedule's placements give 16 and 26 working units of 8 KV heads (unit-major: unit j's programs
// are the 8 blocks of its slot), it prints how many distinct SMs hold them and the most on one SM:
//   packed   unit j in slot j;
//   window   unit j in slot floor(j 33 / U) (attnplan.schedule.slot_unit over the spread's window of 33 slots);
//   whole    unit j in slot floor(j 48 / U) (spread over the whole grid);
//   tickets  the first 8 U blocks to draw a ticket (units handed out by arrival).
// Three launches each with the blocks exiting at once and holding their SM a while.
//
//   nvcc -O2 -arch=sm_90 -o /tmp/sm_placement benchmarks/sm_placement.cu && /tmp/sm_placement
#include <algorithm>
#include <cstdio>
#include <map>
#include <vector>

constexpr int GRID = 384, THREADS = 128, SMEM = 70 * 1024, HEADS = 8;

__global__ void probe(int *sm, int *ticket, unsigned *counter, long long spin) {
    extern __shared__ char smem[];
    if (threadIdx.x == 0) {
        unsigned s;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
        sm[blockIdx.x] = (int)s;
        ticket[blockIdx.x] = (int)atomicAdd(counter, 1u);
        smem[0] = (char)(s & 1);
    }
    const long long c0 = clock64();
    while (clock64() - c0 < spin) {
    }
    if (threadIdx.x == 0 && smem[0] == 2) sm[blockIdx.x] = -2;  // never (s & 1 < 2): a use of the shared memory
}

static void report(const char *name, const std::vector<int> &blocks, const std::vector<int> &sm) {
    std::map<int, int> per;
    for (int b : blocks) per[sm[b]]++;
    int most = 0;
    for (const auto &kv : per) most = std::max(most, kv.second);
    printf("%-20s %3zu blocks on %3zu SMs, at most %d on one\n", name, blocks.size(), per.size(), most);
}

// the blocks of units 0..units-1 placed at slot(j)
template <class F>
static std::vector<int> blocks_of(int units, F slot) {
    std::vector<int> out;
    for (int j = 0; j < units; ++j)
        for (int h = 0; h < HEADS; ++h) out.push_back(HEADS * slot(j) + h);
    return out;
}

int main() {
    int sms = 0, resident = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, probe, THREADS, SMEM);
    printf("SMs %d, resident blocks per SM %d\n", sms, resident);
    int *sm, *ticket;
    unsigned *counter;
    cudaMalloc(&sm, GRID * sizeof(int));
    cudaMalloc(&ticket, GRID * sizeof(int));
    cudaMalloc(&counter, sizeof(unsigned));
    for (long long spin : {0LL, 200000LL}) {
        for (int run = 0; run < 3; ++run) {
            cudaMemset(counter, 0, sizeof(unsigned));
            probe<<<GRID, THREADS, SMEM>>>(sm, ticket, counter, spin);
            if (cudaDeviceSynchronize() != cudaSuccess) {
                printf("launch failed\n");
                return 1;
            }
            std::vector<int> hs(GRID), ht(GRID), by_ticket(GRID);
            cudaMemcpy(hs.data(), sm, GRID * sizeof(int), cudaMemcpyDeviceToHost);
            cudaMemcpy(ht.data(), ticket, GRID * sizeof(int), cudaMemcpyDeviceToHost);
            for (int b = 0; b < GRID; ++b) by_ticket[ht[b]] = b;
            printf("-- spin %lld, run %d; the first 24 blocks' SMs:", spin, run);
            for (int b = 0; b < 24; ++b) printf(" %d", hs[b]);
            printf("\n");
            for (int units : {16, 26}) {
                char name[32];
                snprintf(name, sizeof name, "packed %d units", units);
                report(name, blocks_of(units, [](int j) { return j; }), hs);
                snprintf(name, sizeof name, "window %d units", units);
                report(name, blocks_of(units, [units](int j) { return j * 33 / units; }), hs);
                snprintf(name, sizeof name, "whole %d units", units);
                report(name, blocks_of(units, [units](int j) { return j * 48 / units; }), hs);
                snprintf(name, sizeof name, "first %d tickets", HEADS * units);
                report(name, std::vector<int>(by_ticket.begin(), by_ticket.begin() + HEADS * units), hs);
            }
        }
    }
    return 0;
}
