// Host emulation of the CUDA built-ins the kernels use, for emu/run.sh
// (which includes it at the top of a copy of ../common.cuh). A block runs on one
// host thread: each of its CUDA threads is a ucontext fiber, switched
// cooperatively at barriers (__syncthreads, and the warp-wide exchange of
// every shuffle, ballot and match). Half the blocks run their warps one
// after another in a random order, each until it waits at a __syncthreads;
// the others give turns (up to the next barrier) to the fibers of a random
// subset of the warps in a random order. So warps drift apart between
// __syncthreads, and a read of shared memory that misses one sees stale
// data in some runs
// (EMU_SEED=n in the environment runs another order).
// Blocks run one after another, so `__shared__` (function statics here) is
// the running block's. `extern __shared__` arrays are rewritten by run.sh
// into pointers to the launch's dynamic shared memory, which starts filled
// with NaN bytes (0xff) as a read of unwritten shared memory would show.
// A barrier that can never complete (some threads exited or took another
// path) aborts with "deadlock".
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <ucontext.h>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__ __restrict
struct Dim3 { unsigned x = 1, y = 1, z = 1; };
inline Dim3 threadIdx, blockIdx, blockDim, gridDim;

// The running block.
struct EmuBlock {
    int n = 0, cur = 0, live = 0;
    std::vector<ucontext_t> ctx;
    std::vector<char*> stacks;
    std::vector<char> done;
    ucontext_t sched;
    int bar_count = 0;
    unsigned bar_gen = 0;
    int wbar_count[32] = {};
    unsigned wbar_gen[32] = {};
    unsigned long long slots[1024];
    unsigned long long progress = 0;
    std::vector<unsigned char> dyn;
    const std::function<void()>* body = nullptr;
};
inline EmuBlock* emu_blk = nullptr;
inline unsigned char* emu_dyn_smem = nullptr;
// EMU_SEED (environment) picks another order of the fibers.
inline std::mt19937 emu_order_rng(getenv("EMU_SEED") ? (unsigned)atoi(getenv("EMU_SEED")) : 7u);

inline void emu_yield() { swapcontext(&emu_blk->ctx[emu_blk->cur], &emu_blk->sched); }

inline void __syncthreads() {
    EmuBlock& b = *emu_blk;
    const unsigned g = b.bar_gen;
    b.progress++;
    if (++b.bar_count == b.n) {
        b.bar_count = 0;
        b.bar_gen++;
        return;
    }
    while (b.bar_gen == g) emu_yield();
}
inline void emu_warp_barrier() {
    EmuBlock& b = *emu_blk;
    const int w = threadIdx.x >> 5;
    const int size = std::min(32, b.n - w * 32);
    const unsigned g = b.wbar_gen[w];
    b.progress++;
    if (++b.wbar_count[w] == size) {
        b.wbar_count[w] = 0;
        b.wbar_gen[w]++;
        return;
    }
    while (b.wbar_gen[w] == g) emu_yield();
}
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp_barrier(); }

inline void emu_trampoline() {
    (*emu_blk->body)();
    emu_blk->done[emu_blk->cur] = 1;
    emu_blk->live--;
    emu_blk->progress++;
    // uc_link returns to the scheduler.
}

// Runs f as every thread of a grid of `grid` blocks of `threads` threads,
// with `dyn_bytes` of dynamic shared memory per block.
inline void launch(Dim3 grid, unsigned threads, size_t dyn_bytes, const std::function<void()>& f) {
    const size_t stack = 256 * 1024;
    gridDim = grid;
    blockDim = Dim3{threads, 1, 1};
    EmuBlock b;
    b.n = threads;
    b.ctx.resize(threads);
    b.done.resize(threads);
    for (unsigned t = 0; t < threads; ++t) b.stacks.push_back((char*)malloc(stack));
    b.body = &f;
    std::vector<int> order(threads);
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                blockIdx = Dim3{bx, by, bz};
                b.live = threads;
                b.bar_count = 0;
                std::fill(b.wbar_count, b.wbar_count + 32, 0);
                std::fill(b.done.begin(), b.done.end(), 0);
                b.dyn.assign(dyn_bytes + 16, 0xff);
                emu_dyn_smem = b.dyn.data();
                emu_blk = &b;
                for (unsigned t = 0; t < threads; ++t) {
                    getcontext(&b.ctx[t]);
                    b.ctx[t].uc_stack.ss_sp = b.stacks[t];
                    b.ctx[t].uc_stack.ss_size = stack;
                    b.ctx[t].uc_link = &b.sched;
                    makecontext(&b.ctx[t], emu_trampoline, 0);
                    order[t] = t;
                }
                const int warps = (threads + 31) / 32;
                std::vector<char> run_warp(warps);
                std::vector<int> warp_order(warps);
                for (int w = 0; w < warps; ++w) warp_order[w] = w;
                // Half the blocks run warp after warp (each until it waits
                // at a __syncthreads), the others interleave the fibers.
                const bool serial = emu_order_rng() % 2;
                auto turn = [&](int t) {
                    b.cur = t;
                    threadIdx = Dim3{(unsigned)t, 0, 0};
                    swapcontext(&b.sched, &b.ctx[t]);
                };
                while (b.live > 0) {
                    const unsigned long long before = b.progress;
                    bool all = true;
                    if (serial) {
                        std::shuffle(warp_order.begin(), warp_order.end(), emu_order_rng);
                        for (int w : warp_order) {
                            const int lanes = std::min(32, (int)threads - 32 * w);
                            for (;;) {
                                const unsigned long long p0 = b.progress;
                                const int start = emu_order_rng() % lanes;
                                for (int l = 0; l < lanes; ++l) {
                                    const int t = 32 * w + (start + l) % lanes;
                                    if (!b.done[t]) turn(t);
                                }
                                if (b.progress == p0) break;
                            }
                        }
                    } else {
                        std::shuffle(order.begin(), order.end(), emu_order_rng);
                        // Mostly a random half of the warps gets a turn.
                        all = emu_order_rng() % 3 == 0;
                        int chosen = 0;
                        for (auto& r : run_warp) chosen += r = all || emu_order_rng() % 2;
                        if (chosen == warps) all = true;
                        if (chosen == 0) std::fill(run_warp.begin(), run_warp.end(), 1), all = true;
                        for (int t : order)
                            if (!b.done[t] && run_warp[t >> 5]) turn(t);
                    }
                    if (all && b.live > 0 && b.progress == before) {
                        fprintf(stderr, "deadlock: block (%u,%u,%u), %d of %d threads live\n", bx, by, bz,
                                b.live, threads);
                        abort();
                    }
                }
            }
    for (char* s : b.stacks) free(s);
    emu_blk = nullptr;
}

template <class T>
inline unsigned long long emu_bits(T v) {
    static_assert(sizeof(T) <= 8);
    unsigned long long u = 0;
    memcpy(&u, &v, sizeof(T));
    return u;
}
template <class T>
inline T emu_from(unsigned long long u) {
    T v;
    memcpy(&v, &u, sizeof(T));
    return v;
}
// Lane `src` of this warp's `v` (src outside the warp: wrapped, as CUDA).
template <class T>
inline T __shfl_sync(unsigned, T v, int src) {
    const int w = threadIdx.x >> 5;
    emu_blk->slots[threadIdx.x] = emu_bits(v);
    emu_warp_barrier();
    const T r = emu_from<T>(emu_blk->slots[w * 32 + (src & 31)]);
    emu_warp_barrier();
    return r;
}
template <class T>
inline T __shfl_xor_sync(unsigned m, T v, int o) {
    return __shfl_sync(m, v, (int)((threadIdx.x & 31) ^ (unsigned)o));
}
template <class T>
inline T __shfl_up_sync(unsigned m, T v, unsigned d) {
    const int lane = threadIdx.x & 31;
    const T r = __shfl_sync(m, v, lane - (int)d);
    return lane >= (int)d ? r : v;
}
template <class T>
inline T __shfl_down_sync(unsigned m, T v, unsigned d) {
    const int lane = threadIdx.x & 31;
    const T r = __shfl_sync(m, v, lane + (int)d);
    return lane + (int)d < 32 ? r : v;
}
inline unsigned __ballot_sync(unsigned, int pred) {
    const int w = threadIdx.x >> 5;
    emu_blk->slots[threadIdx.x] = pred != 0;
    emu_warp_barrier();
    unsigned m = 0;
    const int size = std::min(32, emu_blk->n - w * 32);
    for (int l = 0; l < size; ++l) m |= (emu_blk->slots[w * 32 + l] ? 1u : 0u) << l;
    emu_warp_barrier();
    return m;
}
template <class T>
inline unsigned __match_any_sync(unsigned, T v) {
    const int w = threadIdx.x >> 5;
    emu_blk->slots[threadIdx.x] = emu_bits(v);
    emu_warp_barrier();
    unsigned m = 0;
    const int size = std::min(32, emu_blk->n - w * 32);
    for (int l = 0; l < size; ++l) m |= (emu_blk->slots[w * 32 + l] == emu_bits(v) ? 1u : 0u) << l;
    emu_warp_barrier();
    return m;
}
// Fibers never preempt each other: a plain read-modify-write is atomic.
template <class T>
inline T atomicAdd(T* p, T v) {
    const T old = *p;
    *p = old + v;
    return old;
}
template <class T>
inline T atomicMax(T* p, T v) {
    const T old = *p;
    *p = std::max(old, v);
    return old;
}
struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
inline float emu_f16_to_f32(unsigned short h) { _Float16 f; memcpy(&f, &h, 2); return (float)f; }
// cvt.rn.f16.f32 (run.sh rewrites that inline PTX into this).
inline unsigned short emu_f32_to_f16(float x) { _Float16 h = (_Float16)x; unsigned short u; memcpy(&u, &h, 2); return u; }
using std::max;
using std::min;

