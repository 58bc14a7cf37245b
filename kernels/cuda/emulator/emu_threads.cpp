// The CUDA emulator's thread scheduler: each CUDA thread of a block is a fiber, run in turn
// until it reaches a barrier or returns; barriers are released when every thread they wait for
// has arrived. Warp-level instructions (shuffles, ldmatrix, mma.sync) exchange values through a
// per-warp buffer between two warp barriers.
//
// A block runs warp by warp: one warp's lanes run, and its warp barriers are released as they
// fill, until each lane waits at __syncthreads or has returned; then the next warp runs. Between
// two block barriers each warp thus runs its whole stretch before the next starts (warp-level
// instructions do not hold the warps in step, as nothing does on a GPU). The order of the warps,
// of the lanes within a warp, and of the blocks is KEEL_EMU_SCHEDULE's: "forward" (default:
// first to last), "reverse" (last to first) or "random[:SEED]" (a new permutation every time).
// Each is an extreme interleaving: forward exposes a read of shared or global memory that a
// later warp writes before the barrier that should separate them, reverse one that an earlier
// warp writes (and a write over what an earlier warp has yet to read), random mixes both. A
// kernel free of races gives the same bits under each.
//
// Fibers switch by a dozen instructions on x86-64 (callee-saved registers and the stack
// pointer: a switch is a function call, so the ABI says nothing else survives it); elsewhere by
// ucontext, whose swapcontext also saves the signal mask with a system call, ~10x slower. The
// kernels switch at every barrier and every warp-level instruction, so this is what an emulated
// test's time goes to.
#if !defined(__x86_64__) || defined(KEEL_EMU_UCONTEXT)
#include <ucontext.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/cuda/emulator/emu_device.h"
#include "kernels/dtype.h"

// Under AddressSanitizer every switch is announced (its fiber API), so that ASan knows which
// stack is live: a fiber's stack is heap memory, and its frames' redzones must not be taken for
// the heap's.
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define KEEL_EMU_ASAN 1
#else
#define KEEL_EMU_ASAN 0
#endif

#if defined(__x86_64__) && !defined(KEEL_EMU_UCONTEXT)
// keel_emu_switch(save, to): pushes the callee-saved registers, stores the stack pointer in
// *save, loads `to` as the stack pointer and pops the registers saved there.
extern "C" void keel_emu_switch(void** save, void* to);
asm(R"(
  .text
  .globl keel_emu_switch
  .type keel_emu_switch, @function
keel_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size keel_emu_switch, .-keel_emu_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");
#endif

namespace keel_emu {

namespace {

// A saved execution context: a stack pointer (x86-64) or a ucontext; for ASan, its stack.
struct Context {
#if defined(__x86_64__) && !defined(KEEL_EMU_UCONTEXT)
  void* sp = nullptr;
#else
  ucontext_t uc{};
#endif
  const void* stack = nullptr;  // lowest address (the scheduler's: learnt at a fiber's first entry)
  size_t stack_bytes = 0;
  void* asan_fake_stack = nullptr;
};

// Leaves `save` for `to`; returns when something switches back. `ending`: `save` will never be
// resumed (ASan then frees what it kept for that stack).
void switch_context(Context& save, Context& to, bool ending = false) {
#if KEEL_EMU_ASAN
  __sanitizer_start_switch_fiber(ending ? nullptr : &save.asan_fake_stack, to.stack, to.stack_bytes);
#else
  (void)ending;
#endif
#if defined(__x86_64__) && !defined(KEEL_EMU_UCONTEXT)
  keel_emu_switch(&save.sp, to.sp);
#else
  swapcontext(&save.uc, &to.uc);
#endif
#if KEEL_EMU_ASAN
  __sanitizer_finish_switch_fiber(save.asan_fake_stack, nullptr, nullptr);
#endif
}

enum class State { Ready, AtBlockBarrier, AtWarpBarrier, AtGroupBarrier, Done };

constexpr int kGroupThreads = 128;  // a warpgroup: warps 4w .. 4w + 3

struct PendingCopy {
  void* dst;
  const void* src;
  int bytes;
  int group;  // -1: not yet committed
};

struct Fiber {
  Context ctx;
  State state = State::Ready;
  unsigned warp_mask = 0;
  ThreadCoords coords;
  std::vector<PendingCopy> copies;  // cp.async copies not yet landed
  int committed_groups = 0;
};

constexpr size_t kStackBytes = size_t{256} << 10;
constexpr int kMaxThreads = 1024;
constexpr int kSlotBytes = 32;  // per lane: a shuffled value, or mma.sync's six fragment registers

struct Scheduler {
  std::mutex launch_mutex;  // one launch at a time: __shared__ statics are per process
  Context main_ctx;
  std::vector<Fiber> fibers;
  std::vector<std::unique_ptr<char[]>> stacks;
  std::vector<unsigned char> dynamic_smem;
  unsigned char warp_slots[kMaxThreads / 32][32][kSlotBytes] = {};
  const std::function<void()>* body = nullptr;
  int current = -1;
  int threads = 0;
  std::vector<int> block_order, warp_order, lane_order;  // this launch's and round's running orders
  uint64_t random_state = 0;
  // The running launch, for the checks of kernel_entry and static_shared.
  const void* kernel = nullptr;
  const char* kernel_name = nullptr;  // its __PRETTY_FUNCTION__, from kernel_entry
  size_t dynamic_bytes = 0;
  std::vector<const void*> static_vars;  // the __shared__ variables it reached, and their bytes
  size_t static_bytes = 0;
  bool failed = false;
};

enum class Order { kForward, kReverse, kRandom };
struct Schedule {
  Order order = Order::kForward;
  uint64_t seed = 1;
};

// KEEL_EMU_SCHEDULE, read once.
const Schedule& schedule() {
  static const Schedule sch = [] {
    Schedule r;
    const char* env = std::getenv("KEEL_EMU_SCHEDULE");
    if (!env || !*env || std::strcmp(env, "forward") == 0) return r;
    if (std::strcmp(env, "reverse") == 0) {
      r.order = Order::kReverse;
      return r;
    }
    if (std::strncmp(env, "random", 6) == 0 && (env[6] == '\0' || env[6] == ':')) {
      r.order = Order::kRandom;
      char* end = nullptr;
      if (env[6] == ':') r.seed = std::strtoull(env + 7, &end, 10);
      if (env[6] != ':' || (end != env + 7 && *end == '\0')) return r;
    }
    std::fprintf(stderr, "keel CUDA emulator: KEEL_EMU_SCHEDULE='%s' is not one of forward, reverse, random, random:SEED\n",
                 env);
    std::exit(2);
  }();
  return sch;
}

// SplitMix64: the random schedule's generator.
uint64_t next_random(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// order = 0 .. n-1 in the schedule's order (a fresh permutation each call when random).
void schedule_order(std::vector<int>& order, int n, uint64_t& state) {
  order.resize(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  switch (schedule().order) {
    case Order::kForward: break;
    case Order::kReverse: std::reverse(order.begin(), order.end()); break;
    case Order::kRandom:
      for (int i = n - 1; i > 0; --i)
        std::swap(order[static_cast<size_t>(i)], order[next_random(state) % static_cast<uint64_t>(i + 1)]);
      break;
  }
}

Scheduler& sched() {
  static Scheduler s;
  return s;
}

Fiber& self() {
  Scheduler& s = sched();
  if (s.current < 0) {
    std::fprintf(stderr, "keel CUDA emulator: a device function was called outside a kernel launch\n");
    std::abort();
  }
  return s.fibers[static_cast<size_t>(s.current)];
}

void yield_to_scheduler(State st) {
  Fiber& f = self();
  f.state = st;
  switch_context(f.ctx, sched().main_ctx);
}

void fiber_entry() {
  Scheduler& s = sched();
#if KEEL_EMU_ASAN
  // The first entry completes the scheduler's switch here, and tells the scheduler's stack.
  __sanitizer_finish_switch_fiber(nullptr, &s.main_ctx.stack, &s.main_ctx.stack_bytes);
#endif
  (*s.body)();
  Fiber& f = s.fibers[static_cast<size_t>(s.current)];
  f.state = State::Done;
  switch_context(f.ctx, s.main_ctx, true);
  std::abort();  // a finished fiber is never resumed
}

// Makes ctx start fiber_entry on the stack [stack, stack + bytes).
void start_context(Context& ctx, char* stack, size_t bytes) {
  ctx.stack = stack;
  ctx.stack_bytes = bytes;
#if defined(__x86_64__) && !defined(KEEL_EMU_UCONTEXT)
  // keel_emu_switch pops six registers, then returns into fiber_entry; at a function's entry
  // the stack pointer is 8 below a multiple of 16 (as if `call` had pushed a return address).
  auto top = reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t{15};
  auto* sp = reinterpret_cast<void**>(top - 16);  // 16-byte aligned: fiber_entry's return slot
  sp[1] = nullptr;                                // fiber_entry never returns
  sp[0] = reinterpret_cast<void*>(&fiber_entry);
  sp -= 6;
  for (int i = 0; i < 6; ++i) sp[i] = nullptr;
  ctx.sp = sp;
#else
  getcontext(&ctx.uc);
  ctx.uc.uc_stack.ss_sp = stack;
  ctx.uc.uc_stack.ss_size = bytes;
  ctx.uc.uc_link = nullptr;
  makecontext(&ctx.uc, fiber_entry, 0);
#endif
}

const char* state_name(State st) {
  switch (st) {
    case State::Ready: return "running";
    case State::AtBlockBarrier: return "__syncthreads";
    case State::AtWarpBarrier: return "a warp-level barrier (__syncwarp, shuffle, ldmatrix, mma)";
    case State::AtGroupBarrier: return "a warpgroup barrier (wgmma.wait_group)";
    default: return "done";
  }
}

[[noreturn]] void report_deadlock(const Scheduler& s, const uint3& block) {
  std::fprintf(stderr, "keel CUDA emulator: deadlock in block (%u, %u, %u): no thread can go on\n", block.x, block.y,
               block.z);
  for (int i = 0; i < s.threads; ++i) {
    const Fiber& f = s.fibers[static_cast<size_t>(i)];
    if (f.state == State::Done) continue;
    std::fprintf(stderr, "  thread %d (warp %d lane %d) waits at %s", i, i / 32, i % 32, state_name(f.state));
    if (f.state == State::AtWarpBarrier) std::fprintf(stderr, " mask 0x%08x", f.warp_mask);
    std::fprintf(stderr, "\n");
  }
  std::abort();
}

// Releases warp w's warp barrier when every lane in the mask has arrived at one (or has
// exited); false when it cannot be released.
bool release_warp_barrier(Scheduler& s, int w) {
  unsigned waiting = 0, mask = 0;
  for (int l = 0; l < 32 && w * 32 + l < s.threads; ++l) {
    const Fiber& f = s.fibers[static_cast<size_t>(w * 32 + l)];
    if (f.state == State::AtWarpBarrier) {
      waiting |= 1u << l;
      mask |= f.warp_mask;
    }
  }
  if (!waiting) return false;
  for (int l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    const int t = w * 32 + l;
    if (t >= s.threads) continue;  // lanes past the block size do not exist
    const State st = s.fibers[static_cast<size_t>(t)].state;
    if (st != State::AtWarpBarrier && st != State::Done) return false;
  }
  for (int l = 0; l < 32; ++l)
    if (waiting >> l & 1u) s.fibers[static_cast<size_t>(w * 32 + l)].state = State::Ready;
  return true;
}

// Releases each warpgroup whose threads have all arrived at its barrier; false when none can be.
bool release_group_barriers(Scheduler& s) {
  bool released = false;
  for (int g0 = 0; g0 + kGroupThreads <= s.threads; g0 += kGroupThreads) {
    bool all = true;
    for (int i = g0; i < g0 + kGroupThreads && all; ++i) all = s.fibers[static_cast<size_t>(i)].state == State::AtGroupBarrier;
    if (!all) continue;
    for (int i = g0; i < g0 + kGroupThreads; ++i) s.fibers[static_cast<size_t>(i)].state = State::Ready;
    released = true;
  }
  return released;
}

// Releases the block barrier when every live thread has arrived; false when it cannot.
bool release_block_barrier(Scheduler& s) {
  bool any = false;
  for (int i = 0; i < s.threads; ++i) {
    const State st = s.fibers[static_cast<size_t>(i)].state;
    if (st == State::AtBlockBarrier) any = true;
    else if (st != State::Done) return false;
  }
  if (!any) return false;
  for (int i = 0; i < s.threads; ++i) {
    Fiber& f = s.fibers[static_cast<size_t>(i)];
    if (f.state == State::AtBlockBarrier) f.state = State::Ready;
  }
  return true;
}

void wgmma_block_end();  // the wgmma section below

void run_block(Scheduler& s, const ThreadCoords& base) {
  for (int i = 0; i < s.threads; ++i) {
    Fiber& f = s.fibers[static_cast<size_t>(i)];
    f.state = State::Ready;
    f.copies.clear();
    f.committed_groups = 0;
    f.coords = base;
    const unsigned bx = base.block_dim.x, by = base.block_dim.y;
    f.coords.thread_idx = {i % bx, (i / bx) % by, i / (bx * by)};
    start_context(f.ctx, s.stacks[static_cast<size_t>(i)].get(), kStackBytes);
  }
  const int warps = (s.threads + 31) / 32;
  while (true) {
    // Each warp in turn, as far as it can go: to __syncthreads, its end, or a deadlock.
    schedule_order(s.warp_order, warps, s.random_state);
    for (int w : s.warp_order) {
      const int lanes = std::min(32, s.threads - w * 32);
      do {
        schedule_order(s.lane_order, lanes, s.random_state);
        for (int l : s.lane_order) {
          Fiber& f = s.fibers[static_cast<size_t>(w * 32 + l)];
          if (f.state != State::Ready) continue;
          s.current = w * 32 + l;
          switch_context(s.main_ctx, f.ctx);
        }
        s.current = -1;
      } while (release_warp_barrier(s, w));
    }
    bool all_done = true;
    for (int i = 0; i < s.threads; ++i) all_done = all_done && s.fibers[static_cast<size_t>(i)].state == State::Done;
    if (all_done) {
      wgmma_block_end();
      return;
    }
    if (!release_group_barriers(s) && !release_block_barrier(s)) report_deadlock(s, base.block_idx);
  }
}

}  // namespace

const ThreadCoords& coords() { return self().coords; }

void block_barrier() { yield_to_scheduler(State::AtBlockBarrier); }

namespace {
// The running thread's warpgroup: its 128 threads wait for each other (as a wgmma.wait_group
// waits for the whole group's instruction).
void group_barrier() { yield_to_scheduler(State::AtGroupBarrier); }
}  // namespace

void warp_barrier(unsigned mask) {
  self().warp_mask = mask;
  yield_to_scheduler(State::AtWarpBarrier);
}

int lane_id() { return sched().current % 32; }

unsigned char* warp_slot(int lane) {
  Scheduler& s = sched();
  return s.warp_slots[s.current / 32][lane & 31];
}

unsigned char* dynamic_shared() { return sched().dynamic_smem.data(); }

bool kernel_entry(const char* name, int max_threads) {
  Scheduler& s = sched();
  if (!s.kernel_name) s.kernel_name = name;
  if (s.failed) return false;
  if (max_threads > 0 && s.threads > max_threads) {
    s.failed = true;
    const std::string msg = std::string(name) + ": a block of " + std::to_string(s.threads) +
                            " threads is more than its __launch_bounds__ of " + std::to_string(max_threads) +
                            ": the launch fails on a GPU (too many resources requested)";
    fail_launch(cudaErrorLaunchOutOfResources, msg.c_str());
    return false;
  }
  return true;
}

void static_shared(const void* var, size_t bytes) {
  Scheduler& s = sched();
  if (s.failed || std::find(s.static_vars.begin(), s.static_vars.end(), var) != s.static_vars.end()) return;
  s.static_vars.push_back(var);
  s.static_bytes += bytes;
  constexpr size_t kStaticMax = size_t{48} << 10, kOptinMax = size_t{227} << 10;
  const std::string kernel = s.kernel_name ? s.kernel_name : "a kernel";
  const std::string statics = kernel + ": " + std::to_string(s.static_bytes) + " bytes of static __shared__ memory";
  const int attr = max_dynamic_shared_attribute(s.kernel);
  std::string msg;
  if (s.static_bytes > kStaticMax)
    msg = statics + ", more than the 49152 (48 KiB) a kernel may declare (ptxas refuses it); take the rest as "
                    "dynamic shared memory";
  else if (attr < 0 && s.static_bytes + s.dynamic_bytes > kStaticMax)
    msg = statics + " and " + std::to_string(s.dynamic_bytes) +
          " of dynamic, more than the 49152 (48 KiB) a kernel has together without cudaFuncSetAttribute"
          "(MaxDynamicSharedMemorySize)";
  else if (attr >= 0 && s.static_bytes + static_cast<size_t>(attr) > kOptinMax)
    msg = statics + " and its MaxDynamicSharedMemorySize of " + std::to_string(attr) +
          ", more than the 232448 (227 KiB) a block may have together (cudaFuncSetAttribute refuses it on a GPU)";
  if (msg.empty()) return;
  s.failed = true;
  fail_launch(cudaErrorInvalidValue, msg.c_str());
}

void run_grid(const void* kernel, dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& f) {
  Scheduler& s = sched();
  std::lock_guard<std::mutex> lock(s.launch_mutex);
  s.kernel = kernel;
  s.kernel_name = nullptr;
  s.dynamic_bytes = smem_bytes;
  s.static_vars.clear();
  s.static_bytes = 0;
  s.failed = false;
  const long long threads = static_cast<long long>(block.x) * block.y * block.z;
  if (threads < 1 || threads > kMaxThreads || grid.x < 1 || grid.y < 1 || grid.z < 1) {
    std::fprintf(stderr, "keel CUDA emulator: invalid launch: grid (%u, %u, %u), block (%u, %u, %u)\n", grid.x, grid.y,
                 grid.z, block.x, block.y, block.z);
    std::abort();
  }
  s.threads = static_cast<int>(threads);
  if (s.fibers.size() < static_cast<size_t>(s.threads)) s.fibers.resize(static_cast<size_t>(s.threads));
  while (s.stacks.size() < static_cast<size_t>(s.threads)) s.stacks.emplace_back(new char[kStackBytes]);
  // Real shared memory starts uninitialized; a fixed garbage pattern makes reads of unwritten
  // bytes show up as wrong results rather than as lucky zeros.
  s.dynamic_smem.assign(smem_bytes + 16, 0xA5);
  s.body = &f;
  ThreadCoords base;
  base.block_dim = block;
  base.grid_dim = grid;
  const long long blocks = static_cast<long long>(grid.x) * grid.y * grid.z;
  if (blocks > (1ll << 31) - 1) {
    std::fprintf(stderr, "keel CUDA emulator: a grid of %lld blocks is more than it can run\n", blocks);
    std::abort();
  }
  s.random_state = schedule().seed;
  schedule_order(s.block_order, static_cast<int>(blocks), s.random_state);
  for (int b : s.block_order) {
    const unsigned ub = static_cast<unsigned>(b);
    base.block_idx = {ub % grid.x, (ub / grid.x) % grid.y, ub / (grid.x * grid.y)};
    run_block(s, base);
  }
  s.body = nullptr;
}

// ---- ldmatrix / mma.sync ----

void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
  const int lane = lane_id();
  // Publish this lane's row address, then read the four matrices' rows from their owners.
  const unsigned char* rows[32];
  const void* mine = row;
  std::memcpy(warp_slot(lane), &mine, sizeof mine);
  warp_barrier(0xffffffffu);
  for (int l = 0; l < 32; ++l) std::memcpy(&rows[l], warp_slot(l), sizeof rows[l]);
  warp_barrier(0xffffffffu);
  for (int m = 0; m < 4; ++m) {
    uint16_t lo, hi;
    if (!trans) {
      // (row lane / 4, cols 2 (lane % 4), +1) of matrix m
      const unsigned char* p = rows[m * 8 + lane / 4] + 4 * (lane % 4);
      std::memcpy(&lo, p, 2);
      std::memcpy(&hi, p + 2, 2);
    } else {
      // (rows 2 (lane % 4), +1; col lane / 4) of matrix m
      std::memcpy(&lo, rows[m * 8 + 2 * (lane % 4)] + 2 * (lane / 4), 2);
      std::memcpy(&hi, rows[m * 8 + 2 * (lane % 4) + 1] + 2 * (lane / 4), 2);
    }
    r[m] = static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16;
  }
}

void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16) {
  // Every lane publishes its fragments (a0..a3, b0, b1), then reads the two rows of A and the
  // two columns of B its outputs need (g = lane / 4, t = lane % 4):
  //   A(r, k) is in lane 4 (r % 8) + (k % 8) / 2, register (r >= 8) + 2 (k >= 8), half k % 2
  //   B(k, n) is in lane 4 n + (k % 8) / 2, register 4 + (k >= 8), half k % 2
  const int lane = lane_id();
  const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  std::memcpy(warp_slot(lane), mine, sizeof mine);
  warp_barrier(0xffffffffu);
  auto element = [&](int owner, int reg, int half) {
    uint32_t word;
    std::memcpy(&word, warp_slot(owner) + 4 * reg, 4);
    const auto bits = static_cast<uint16_t>(word >> (16 * half));
    return bf16 ? keel::bf16_to_f32(bits) : keel::f16_to_f32(bits);
  };
  const int g = lane / 4, t = lane % 4;
  float A[2][16], B[2][16];  // rows g, g + 8 of A; columns 2t, 2t + 1 of B
  for (int k = 0; k < 16; ++k) {
    for (int r = 0; r < 2; ++r) A[r][k] = element(4 * g + (k % 8) / 2, r + 2 * (k >= 8), k % 2);
    for (int n = 0; n < 2; ++n) B[n][k] = element(4 * (2 * t + n) + (k % 8) / 2, 4 + (k >= 8), k % 2);
  }
  warp_barrier(0xffffffffu);  // nobody overwrites a slot before every lane has read it
  // c0, c1 = (row g, cols 2t, 2t+1); c2, c3 = (row g+8, cols 2t, 2t+1)
  for (int i = 0; i < 4; ++i) {
    float sum = 0.0f;
    for (int k = 0; k < 16; ++k) sum += A[i / 2][k] * B[i % 2][k];
    c[i] += sum;
  }
}

// ---- wgmma.mma_async (warpgroup) ----

namespace {
// An issued instruction: what each of the warpgroup's 128 threads brought to it (its
// accumulators' address and, for A in registers, a copy of its four registers) and the shared
// one.
struct PendingWgmma {
  int n = 0, group = 0;  // group: the commits that came before its issue
  uint64_t desc_a = 0, desc_b = 0;
  bool trans_b = false, accumulate = false, bf16 = false, a_regs = false;
  float* d[128] = {};
  uint32_t a[128][4] = {};
};
// A warpgroup's issued, not yet executed instructions (issue order), and per thread how many it
// has issued (its next one's index, minus `erased`) and committed.
struct WarpgroupQueue {
  std::deque<PendingWgmma> pending;
  int erased = 0;
  int issued[128] = {}, commits[128] = {};
};
std::vector<WarpgroupQueue> wg_queues;  // the running block's, one per warpgroup
WarpgroupQueue& queue_of(const Scheduler& s) {
  const size_t groups = static_cast<size_t>(s.threads / kGroupThreads);
  if (wg_queues.size() < groups) wg_queues.resize(groups);
  return wg_queues[static_cast<size_t>(s.current / kGroupThreads)];
}

[[noreturn]] void wgmma_fail(const char* what) {
  std::fprintf(stderr, "keel CUDA emulator: wgmma: %s\n", what);
  std::abort();
}

// A swizzle-free descriptor's fields: start address, LBO and SBO in bytes.
struct Descriptor {
  uint32_t start, lbo, sbo;
};
Descriptor decode(uint64_t desc) {
  if ((desc >> 62) != 0) wgmma_fail("descriptor asks for a swizzled layout (bits 62-63), which keel does not use");
  if (((desc >> 49) & 7u) != 0) wgmma_fail("descriptor has a non-zero base offset (bits 49-51)");
  return {static_cast<uint32_t>(desc & 0x3FFFu) << 4, static_cast<uint32_t>((desc >> 16) & 0x3FFFu) << 4,
          static_cast<uint32_t>((desc >> 32) & 0x3FFFu) << 4};
}

// D (+)= A B of one instruction, reading shared memory now.
void execute(Scheduler& s, const PendingWgmma& op) {
  for (float* d : op.d)
    if (!d) wgmma_fail("not every thread of the warpgroup issued the instruction it waits for");
  const size_t smem_size = s.dynamic_smem.size() - 16;
  const bool bf16 = op.bf16;
  // Element (mn, k) of a swizzle-free shared-memory operand: core matrix (mn / 8, k / 8) at
  // (mn / 8) SBO + (k / 8) LBO; inside it rows of 16 bytes along K (K-major) or MN (MN-major).
  auto smem_elem = [&](const Descriptor& dsc, int mn, int k, bool mn_major) {
    const uint32_t inner = mn_major ? (k % 8) * 16 + (mn % 8) * 2 : (mn % 8) * 16 + (k % 8) * 2;
    const size_t at = dsc.start + static_cast<size_t>(mn / 8) * dsc.sbo + static_cast<size_t>(k / 8) * dsc.lbo + inner;
    if (at + 2 > smem_size) wgmma_fail("operand reaches past the block's dynamic shared memory");
    uint16_t bits;
    std::memcpy(&bits, s.dynamic_smem.data() + at, 2);
    return bf16 ? keel::bf16_to_f32(bits) : keel::f16_to_f32(bits);
  };
  static float A[64][16], B[256][16];
  const Descriptor da = decode(op.desc_a), db = decode(op.desc_b);
  for (int r = 0; r < 64; ++r)
    for (int k = 0; k < 16; ++k) {
      if (op.a_regs) {
        // the m16n8k16 A fragment of warp r / 16: row g or g + 8, columns 2t, 2t+1 (+8)
        const int rr = r % 16, lane = 4 * (rr % 8) + (k % 8) / 2, reg = (rr >= 8) + 2 * (k >= 8);
        const auto bits = static_cast<uint16_t>(op.a[(r / 16) * 32 + lane][reg] >> (16 * (k % 2)));
        A[r][k] = bf16 ? keel::bf16_to_f32(bits) : keel::f16_to_f32(bits);
      } else {
        A[r][k] = smem_elem(da, r, k, false);
      }
    }
  for (int c = 0; c < op.n; ++c)
    for (int k = 0; k < 16; ++k) B[c][k] = smem_elem(db, c, k, op.trans_b);
  // thread (warp w, g, t): d[4i + e] = (row 16w + g + 8 (e / 2), col 8i + 2t + e % 2)
  for (int th = 0; th < 128; ++th) {
    const int w = th / 32, g = (th % 32) / 4, t = th % 4;
    for (int i = 0; i < op.n / 2; ++i) {
      const int row = 16 * w + g + 8 * ((i % 4) / 2), col = 8 * (i / 4) + 2 * t + i % 2;
      float sum = 0.0f;
      for (int k = 0; k < 16; ++k) sum += A[row][k] * B[col][k];
      op.d[th][i] = op.accumulate ? op.d[th][i] + sum : sum;
    }
  }
}
}  // namespace

void wgmma_m64k16(float* d, int n, const uint32_t* a, uint64_t desc_a, uint64_t desc_b, bool trans_b, bool accumulate,
                  bool bf16) {
  Scheduler& s = sched();
  if (s.threads % kGroupThreads != 0) wgmma_fail("the block is not whole warpgroups (multiples of 128 threads)");
  if (n < 8 || n > 256 || n % 8 != 0) wgmma_fail("N must be a multiple of 8 from 8 to 256");
  WarpgroupQueue& wgq = queue_of(s);
  const int tid = s.current % kGroupThreads;
  const int index = wgq.issued[tid]++ - wgq.erased;
  if (index < 0) wgmma_fail("a thread issued an instruction the others had already waited for");
  if (index == static_cast<int>(wgq.pending.size())) {  // the first thread to issue it
    PendingWgmma op;
    op.n = n, op.group = wgq.commits[tid], op.desc_a = desc_a, op.desc_b = desc_b;
    op.trans_b = trans_b, op.accumulate = accumulate, op.bf16 = bf16, op.a_regs = a != nullptr;
    wgq.pending.push_back(op);
  }
  PendingWgmma& op = wgq.pending[static_cast<size_t>(index)];
  if (op.n != n || op.desc_a != desc_a || op.desc_b != desc_b || op.trans_b != trans_b ||
      op.accumulate != accumulate || op.a_regs != (a != nullptr) || op.group != wgq.commits[tid])
    wgmma_fail("the warpgroup's threads issued different instructions");
  op.d[tid] = d;
  if (a) std::memcpy(op.a[tid], a, sizeof op.a[tid]);  // registers are read at the issue
}

void wgmma_commit() {
  Scheduler& s = sched();
  ++queue_of(s).commits[s.current % kGroupThreads];
}

void wgmma_wait(int keep_pending) {
  // Executes, in issue order, every instruction of the groups older than the newest
  // `keep_pending` committed ones: shared memory is read now, at the latest moment the hardware
  // may read it, so an overwrite before the wait shows as a wrong result, and so does a read of
  // the accumulators before it (they still hold their old values).
  Scheduler& s = sched();
  group_barrier();
  if (s.current % kGroupThreads == 0) {
    WarpgroupQueue& wgq = queue_of(s);
    const int done_below = wgq.commits[0] - keep_pending;
    while (!wgq.pending.empty() && wgq.pending.front().group < done_below) {
      execute(s, wgq.pending.front());
      wgq.pending.pop_front();
      ++wgq.erased;
    }
  }
  group_barrier();
}

namespace {
// A block's end: every instruction must have been waited for (its accumulators would hold
// garbage on a GPU); then a clean queue for the next block.
void wgmma_block_end() {
  for (const WarpgroupQueue& q : wg_queues)
    if (!q.pending.empty()) wgmma_fail("the block ended with instructions it never waited for (wgmma.wait_group)");
  wg_queues.clear();
}
}  // namespace

// ---- cp.async ----

namespace {
// A copy lands: 16 bytes, the first `bytes` from the source and the rest zeros (cp.async's
// src-size form).
void land(const PendingCopy& c) {
  unsigned char buf[16] = {};
  if (c.bytes > 0) std::memcpy(buf, c.src, static_cast<size_t>(c.bytes));
  std::memcpy(c.dst, buf, 16);
}
}  // namespace

// A copy may land at any moment between its issue and the wait for its group. Forward and
// reverse schedules land it as late as allowed (at the wait: a read before the wait sees stale
// data); the random one lands each copy either then or at once, at random (at once: a copy into
// a buffer that another warp is still reading, for want of a barrier, overwrites it).
void cp_async16(void* smem, const void* gmem, int src_bytes) {
  Scheduler& s = sched();
  const PendingCopy c{smem, gmem, src_bytes, -1};
  if (schedule().order == Order::kRandom && (next_random(s.random_state) & 1u)) land(c);
  else self().copies.push_back(c);
}

void cp_async_commit() {
  Fiber& f = self();
  for (PendingCopy& c : f.copies)
    if (c.group < 0) c.group = f.committed_groups;
  ++f.committed_groups;
}

void cp_async_wait(int keep_pending) {
  // Lands every copy of the groups older than the newest `keep_pending` committed ones.
  Fiber& f = self();
  const int land_below = f.committed_groups - keep_pending;
  std::vector<PendingCopy> still;
  for (const PendingCopy& c : f.copies) {
    if (c.group >= 0 && c.group < land_below) {
      land(c);
    } else {
      still.push_back(c);
    }
  }
  f.copies.swap(still);
}

}  // namespace keel_emu
