// Hidden stand-ins, linked into every .so we build, for the few glibc symbols newer than 2.28 that
// ggml's code references (see glibc_compat.h). References inside the .so bind to these, so the
// library never asks the system's glibc for them.
#include "glibc_compat.h"

#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#define GK_HIDDEN __attribute__((visibility("hidden")))

// glibc 2.32: read by libstdc++'s headers. 0 = "maybe multi-threaded": atomics always used.
GK_HIDDEN char __libc_single_threaded = 0;

struct stat;

// glibc 2.29 added the getcpu() wrapper; older glibc only has the system call.
GK_HIDDEN int getcpu(unsigned int* cpu, unsigned int* node) {
  return (int)syscall(SYS_getcpu, cpu, node, (void*)0);
}

// glibc 2.33 turned stat() from an inline wrapper into an exported function. On x86-64 the kernel's
// struct stat is glibc's, so the system call fills the caller's buffer directly.
GK_HIDDEN int stat(const char* path, struct stat* buf) {
  return (int)syscall(SYS_newfstatat, AT_FDCWD, path, buf, 0);
}
