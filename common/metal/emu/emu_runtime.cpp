// Fibers for the emulated device's GPU threads, their rendezvous points, and launches (a grid of
// threadgroups with its threadgroup memory). On x86-64 a fiber switch is a few instructions of
// ours (callee-saved registers, the stack pointer, the SSE and x87 control words); elsewhere
// ucontext, whose swapcontext also saves the signal mask (a system call).
#include "emu_runtime.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define GK_FIBER_ASAN 1  // AddressSanitizer is told about every stack switch
#endif

#if defined(__x86_64__) && defined(__linux__)
#include <signal.h>
#include <ucontext.h>
#define GK_DIVIDE_BY_ZERO_GPU_SEMANTICS 1
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <memory>
#include <stdexcept>

namespace ggml_kernels::metal::emu {

std::map<std::string, KernelInfo>& kernels() {
  static std::map<std::string, KernelInfo> k;
  return k;
}

std::multimap<int32_t, ConstantSetter>& constant_setters() {
  static std::multimap<int32_t, ConstantSetter> s;
  return s;
}

namespace {

#if defined(__x86_64__)
// gk_fiber_switch(&from_sp, to_sp): saves the running context on its stack, stores the stack
// pointer in *from_sp, and resumes the context saved at to_sp.
extern "C" void gk_fiber_switch(void** from_sp, void* to_sp);
asm(R"(
.text
.p2align 4
.type gk_fiber_switch, @function
gk_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size gk_fiber_switch, .-gk_fiber_switch
.section .note.GNU-stack,"",@progbits
.text
)");

struct Context {
  void* sp = nullptr;
};

// A fresh context that starts `entry` (which never returns) on [stack, stack + size).
void context_init(Context& c, void* stack, size_t size, void (*entry)()) {
  auto top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t{15};
  auto* slot = reinterpret_cast<uint64_t*>(top);
  *--slot = 0;  // entry's return address: never used; keeps the call alignment (rsp % 16 == 8)
  *--slot = reinterpret_cast<uint64_t>(entry);  // where gk_fiber_switch's ret lands
  for (int i = 0; i < 6; ++i) *--slot = 0;      // rbp, rbx, r12-r15
  *--slot = 0x037F'00001F80ull;                 // x87 control word (high half), MXCSR (low half)
  c.sp = slot;
}

void context_switch(Context& from, Context& to) { gk_fiber_switch(&from.sp, to.sp); }
#else
struct Context {
  ucontext_t uc;
};

void context_init(Context& c, void* stack, size_t size, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}

void context_switch(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

constexpr size_t kStackBytes = size_t{256} << 10;
constexpr size_t kMaxValueBytes = 256;  // the largest value a collective passes (a float4x4 is 64)

enum class State { Runnable, AtCollective, AtBarrier, Done };

struct Fiber {
  Context context;
  void* stack = nullptr;
  ThreadContext thread;
  State state = State::Runnable;
  // the collective it waits at
  uint8_t value[kMaxValueBytes];
  uint8_t result[kMaxValueBytes];
  size_t size = 0;
  Reduce reduce = nullptr;
  int arg = 0;
  const char* what = nullptr;
};

struct Threadgroup {
  std::vector<Fiber> fibers;
  Context scheduler;
  size_t running = 0;
  KernelEntry entry = nullptr;
  const char* kernel = nullptr;
  std::exception_ptr error;
  const void* scheduler_stack = nullptr;  // for AddressSanitizer's fiber switches
  size_t scheduler_stack_size = 0;
  std::map<int, std::unique_ptr<uint8_t[]>> locals;  // kernel-scope threadgroup arrays
};

thread_local Threadgroup* t_group = nullptr;
thread_local std::vector<std::unique_ptr<uint8_t[]>> t_stacks;  // reused across threadgroups
std::atomic<Schedule> g_schedule{Schedule::Forward};
std::atomic<bool> g_lane_zero_convergence{true};

// scheduler -> fiber
void switch_to_fiber(Threadgroup& g, Fiber& f) {
#if GK_FIBER_ASAN
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(&fake_stack, f.stack, kStackBytes);
#endif
  context_switch(g.scheduler, f.context);
#if GK_FIBER_ASAN
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
}

// fiber -> scheduler: a yield, or the fiber's end (`finished`: its stack is not coming back)
void switch_to_scheduler(Threadgroup& g, Fiber& f, bool finished) {
#if GK_FIBER_ASAN
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(finished ? nullptr : &fake_stack, g.scheduler_stack,
                                 g.scheduler_stack_size);
#else
  (void)finished;
#endif
  context_switch(f.context, g.scheduler);
#if GK_FIBER_ASAN
  __sanitizer_finish_switch_fiber(fake_stack, &g.scheduler_stack, &g.scheduler_stack_size);
#endif
}

void fiber_main() {
  Threadgroup& g = *t_group;
#if GK_FIBER_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g.scheduler_stack, &g.scheduler_stack_size);
#endif
  Fiber& f = g.fibers[g.running];
  try {
    g.entry(f.thread);
  } catch (...) {
    g.error = std::current_exception();
  }
  f.state = State::Done;
  switch_to_scheduler(g, f, true);
}

void yield_to_scheduler() {
  Threadgroup& g = *t_group;
  switch_to_scheduler(g, g.fibers[g.running], false);
}

// Resolves every SIMD group whose live lanes all wait at a collective; returns whether any did.
bool resolve_collectives(Threadgroup& g) {
  bool resolved = false;
  const size_t n = g.fibers.size();
  for (size_t first = 0; first < n; first += kSimdWidth) {
    const size_t last = std::min(n, first + kSimdWidth);
    bool alive[kSimdWidth] = {}, any = false, ready = true;
    const Fiber* leader = nullptr;
    for (size_t i = first; i < last; ++i) {
      const Fiber& f = g.fibers[i];
      if (f.state == State::Done) continue;
      alive[i - first] = any = true;
      if (f.state != State::AtCollective) {
        ready = false;
        break;
      }
      if (leader == nullptr) {
        leader = &f;
      } else if (f.reduce != leader->reduce || f.arg != leader->arg || f.size != leader->size) {
        throw std::runtime_error(std::string("Metal emulator: kernel ") + g.kernel +
                                 ": lanes of one SIMD group are at different collectives (" +
                                 leader->what + ", " + f.what + ")");
      }
    }
    if (!any || !ready) continue;
    const size_t size = leader->size;
    std::vector<uint8_t> in(kSimdWidth * size), out(kSimdWidth * size);
    for (size_t i = first; i < last && size > 0; ++i)  // (a value-less collective: size 0)
      if (alive[i - first]) std::memcpy(in.data() + (i - first) * size, g.fibers[i].value, size);
    leader->reduce(in.data(), alive, out.data(), size, leader->arg);
    for (size_t i = first; i < last; ++i) {
      if (!alive[i - first]) continue;
      if (size > 0) std::memcpy(g.fibers[i].result, out.data() + (i - first) * size, size);
      g.fibers[i].state = State::Runnable;
    }
    resolved = true;
  }
  return resolved;
}

// Releases a barrier that every live thread has reached; returns whether it did.
bool resolve_barrier(Threadgroup& g) {
  bool any = false;
  for (const Fiber& f : g.fibers) {
    if (f.state == State::Done) continue;
    if (f.state != State::AtBarrier) return false;
    any = true;
  }
  for (Fiber& f : g.fibers)
    if (f.state == State::AtBarrier) f.state = State::Runnable;
  return any;
}

std::vector<size_t> resume_order(size_t n) {
  std::vector<size_t> order;
  order.reserve(n);
  const bool reverse = g_schedule.load() == Schedule::Reverse;
  for (size_t first = 0; first < n; first += kSimdWidth) {
    const size_t last = std::min(n, first + kSimdWidth);
    for (size_t k = 0; k < last - first; ++k) order.push_back(reverse ? last - 1 - k : first + k);
  }
  return order;
}

}  // namespace

const ThreadContext& current() { return t_group->fibers[t_group->running].thread; }

void simd_collective(const void* value, void* result, size_t size, Reduce reduce, int arg,
                     const char* what) {
  if (size > kMaxValueBytes)
    throw std::runtime_error("Metal emulator: a collective's value is too large");
  Fiber& f = t_group->fibers[t_group->running];
  if (size > 0) std::memcpy(f.value, value, size);
  f.size = size, f.reduce = reduce, f.arg = arg, f.what = what;
  f.state = State::AtCollective;
  yield_to_scheduler();
  if (size > 0) std::memcpy(result, f.result, size);
}

void threadgroup_barrier() {
  t_group->fibers[t_group->running].state = State::AtBarrier;
  yield_to_scheduler();
}

void* threadgroup_local(int id, size_t bytes) {
  auto& slot = t_group->locals[id];
  if (!slot) {
    slot.reset(new uint8_t[bytes]);
    std::memset(slot.get(), 0xff, bytes);
  }
  return slot.get();
}

void set_schedule(Schedule s) { g_schedule.store(s); }
void set_lane_zero_convergence(bool on) { g_lane_zero_convergence.store(on); }
bool lane_zero_convergence() { return g_lane_zero_convergence.load(std::memory_order_relaxed); }
Schedule schedule() { return g_schedule.load(); }

#if GK_DIVIDE_BY_ZERO_GPU_SEMANTICS
// Integer division by zero (and INT_MIN / -1): a GPU does not trap, the result is undefined, and
// upstream's kernels rely on that (fa_vec_common.metal computes `iq2 % args.ne32` for the mask's
// address even without a mask, ne32 = 0, and never reads it). On x86 DIV / IDIV raise SIGFPE: while
// a kernel runs on this thread, the handler gives quotient and remainder 0 and skips the
// instruction. Any other SIGFPE goes to the handler that was there before.
namespace {

struct sigaction g_previous_fpe{};

// Bytes of the DIV / IDIV instruction at pc (F6 / F7 with ModRM reg 6 or 7), 0 if it is not one.
size_t divide_length(const uint8_t* pc) {
  const uint8_t* p = pc;
  while (*p == 0x66 || *p == 0x67 || *p == 0xF2 || *p == 0xF3 || *p == 0x2E || *p == 0x3E) ++p;
  if ((*p & 0xF0) == 0x40) ++p;  // REX
  if (*p != 0xF6 && *p != 0xF7) return 0;
  const uint8_t modrm = *++p;
  ++p;
  const int mod = modrm >> 6, reg = (modrm >> 3) & 7, rm = modrm & 7;
  if (reg != 6 && reg != 7) return 0;
  if (mod != 3 && rm == 4) {  // a SIB byte
    const uint8_t sib = *p++;
    if (mod == 0 && (sib & 7) == 5) p += 4;  // no base register: a 32-bit displacement
  }
  if (mod == 1) {
    p += 1;
  } else if (mod == 2 || (mod == 0 && rm == 5)) {
    p += 4;
  }
  return static_cast<size_t>(p - pc);
}

void on_sigfpe(int sig, siginfo_t* info, void* context) {
  auto& regs = static_cast<ucontext_t*>(context)->uc_mcontext.gregs;
  const size_t length =
      t_group != nullptr ? divide_length(reinterpret_cast<const uint8_t*>(regs[REG_RIP])) : 0;
  if (length > 0) {
    regs[REG_RAX] = 0;
    regs[REG_RDX] = 0;
    regs[REG_RIP] += static_cast<greg_t>(length);
    return;
  }
  if (g_previous_fpe.sa_flags & SA_SIGINFO) {
    g_previous_fpe.sa_sigaction(sig, info, context);
  } else if (g_previous_fpe.sa_handler != SIG_IGN && g_previous_fpe.sa_handler != SIG_DFL) {
    g_previous_fpe.sa_handler(sig);
  } else {
    signal(SIGFPE, SIG_DFL);
    raise(SIGFPE);
  }
}

void install_divide_handler() {
  static const bool installed = [] {
    struct sigaction action{};
    action.sa_sigaction = on_sigfpe;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    return sigaction(SIGFPE, &action, &g_previous_fpe) == 0;
  }();
  (void)installed;
}

}  // namespace
#else
namespace {
void install_divide_handler() {}
}  // namespace
#endif

void run_threadgroup(KernelEntry entry, const char* kernel, ThreadContext base, uint32_t threads) {
  install_divide_handler();
  Threadgroup g;
  g.entry = entry, g.kernel = kernel;
  g.fibers.resize(threads);
  while (t_stacks.size() < threads) t_stacks.emplace_back(new uint8_t[kStackBytes]);
  const uint32_t nx = base.ntg[0], ny = base.ntg[1];
  for (uint32_t i = 0; i < threads; ++i) {
    Fiber& f = g.fibers[i];
    f.thread = base;
    f.thread.tpitg[0] = i % nx, f.thread.tpitg[1] = (i / nx) % ny,
    f.thread.tpitg[2] = i / (nx * ny);
    for (int d = 0; d < 3; ++d) f.thread.tpig[d] = base.tgpig[d] * base.ntg[d] + f.thread.tpitg[d];
    f.thread.index = i, f.thread.simdgroup = i / kSimdWidth, f.thread.lane = i % kSimdWidth;
    f.thread.simdgroups = (threads + kSimdWidth - 1) / kSimdWidth;
    f.stack = t_stacks[i].get();
#if GK_FIBER_ASAN
    // a finished fiber never returns from its frames: their redzones stay poisoned on the reused
    // stack
    ASAN_UNPOISON_MEMORY_REGION(f.stack, kStackBytes);
#endif
    context_init(f.context, f.stack, kStackBytes, fiber_main);
  }
  Threadgroup* outer = t_group;
  t_group = &g;
  const std::vector<size_t> order = resume_order(threads);
  try {
    for (;;) {
      bool ran = false;
      for (size_t i : order) {
        if (g.fibers[i].state != State::Runnable) continue;
        g.running = i;
        switch_to_fiber(g, g.fibers[i]);
        ran = true;
        if (g.error) std::rethrow_exception(g.error);
      }
      const bool resolved = resolve_collectives(g) || resolve_barrier(g);
      bool done = true;
      for (const Fiber& f : g.fibers) done = done && f.state == State::Done;
      if (done) break;
      if (!ran && !resolved) {
        throw std::runtime_error(std::string("Metal emulator: kernel ") + kernel +
                                 " deadlocks: threads wait at a barrier or collective that the "
                                 "others of their threadgroup or SIMD group never reach");
      }
    }
  } catch (...) {
    t_group = outer;
    throw;
  }
  t_group = outer;
}

// ---- launches ----

// Generated at build time (metal_runtime.py): the kernels of upstream's files not translated yet.
extern const char* const kUntranslatedKernels[];

namespace {

bool untranslated(const std::string& kernel) {
  for (const char* const* name = kUntranslatedKernels; *name != nullptr; ++name)
    if (kernel == *name) return true;
  return false;
}

// Every function constant back to zero, then the launch's values (what a pipeline compiled with
// those constants sees).
void set_constants(const std::map<int32_t, int32_t>& constants) {
  for (auto& [index, set] : constant_setters()) set(0);
  for (const auto& [index, value] : constants) {
    auto [first, last] = constant_setters().equal_range(index);
    for (auto it = first; it != last; ++it) it->second(value);
  }
}

// The guard zone after each threadgroup-memory block: a kernel that writes past its threadgroup
// memory (upstream's fa_vec kernels do for some head sizes) writes here, not into the heap.
constexpr size_t kGuardBytes = 4096;
constexpr uint8_t kGuardByte = 0xa5;

// How far into the guard zone at `guard` a threadgroup wrote.
size_t bytes_past_end(const uint8_t* guard) {
  for (size_t i = kGuardBytes; i > 0; --i)
    if (guard[i - 1] != kGuardByte) return i;
  return 0;
}

}  // namespace

bool has_kernel(const std::string& name) { return kernels().count(name) != 0; }

size_t run(const Launch& launch) {
  const auto found = kernels().find(launch.kernel);
  if (found == kernels().end()) {
    if (untranslated(launch.kernel))
      throw std::runtime_error(
          "Metal emulator: kernel " + launch.kernel +
          " is not translated yet (tools/build/metal_translate.py KERNEL_FILES)");
    throw std::runtime_error("upstream's Metal library has no kernel " + launch.kernel +
                             ": its host code asked for a pipeline no .metal file defines (on a "
                             "Mac, compiling it fails)");
  }
  set_constants(launch.constants);
  // threadgroup memory: exactly the sizes the host set, filled with a NaN pattern (it starts
  // undefined on a GPU), each followed by a guard zone that shows writes past its end
  int max_tg = -1;
  for (const auto& [index, size] : launch.threadgroup_memory) max_tg = std::max(max_tg, index);
  std::vector<std::unique_ptr<uint8_t[]>> tg_blocks;
  std::vector<void*> tg_memory(max_tg + 1, nullptr);
  const uint32_t threads = launch.threads[0] * launch.threads[1] * launch.threads[2];
  ThreadContext base{};
  base.buffers = &launch.buffers, base.tg_memory = &tg_memory;
  for (int i = 0; i < 3; ++i) base.ntg[i] = launch.threads[i], base.ntgp[i] = launch.grid[i];
  size_t overrun = 0;
  for (uint32_t z = 0; z < launch.grid[2]; ++z) {
    for (uint32_t y = 0; y < launch.grid[1]; ++y) {
      for (uint32_t x = 0; x < launch.grid[0]; ++x) {
        tg_blocks.clear();
        for (const auto& [index, size] : launch.threadgroup_memory) {
          tg_blocks.emplace_back(new uint8_t[size + kGuardBytes]);
          std::memset(tg_blocks.back().get(), 0xff, size);
          std::memset(tg_blocks.back().get() + size, kGuardByte, kGuardBytes);
          tg_memory[index] = tg_blocks.back().get();
        }
        base.tgpig[0] = x, base.tgpig[1] = y, base.tgpig[2] = z;
        run_threadgroup(found->second.entry, launch.kernel.c_str(), base, threads);
        size_t block = 0;
        for (const auto& [index, size] : launch.threadgroup_memory)
          overrun = std::max(overrun, bytes_past_end(tg_blocks[block++].get() + size));
      }
    }
  }
  return overrun;
}

}  // namespace ggml_kernels::metal::emu
