// Force-included (-include) into every translation unit of our builds, ggml's included.
//
// Hub kernels must be manylinux_2_28: no symbol newer than GLIBC 2.28. This machine's glibc (2.36)
// gives some libc/libm functions a newer default version; binding them to their older version keeps
// the .so loadable on glibc 2.28. The older implementations compute the same results.
#pragma once

#if defined(__linux__) && defined(__x86_64__) && !defined(GGML_KERNELS_NO_GLIBC_COMPAT)
// libm: new default versions in glibc 2.29 (faster wrappers, same results).
__asm__(".symver exp,exp@GLIBC_2.2.5");
__asm__(".symver log,log@GLIBC_2.2.5");
__asm__(".symver pow,pow@GLIBC_2.2.5");
__asm__(".symver exp2,exp2@GLIBC_2.2.5");
__asm__(".symver log2,log2@GLIBC_2.2.5");
// libpthread / libdl were folded into libc in glibc 2.34, which re-versioned these.
__asm__(".symver pthread_create,pthread_create@GLIBC_2.2.5");
__asm__(".symver pthread_join,pthread_join@GLIBC_2.2.5");
__asm__(".symver pthread_detach,pthread_detach@GLIBC_2.2.5");
__asm__(".symver pthread_once,pthread_once@GLIBC_2.2.5");
__asm__(".symver pthread_key_create,pthread_key_create@GLIBC_2.2.5");
__asm__(".symver pthread_key_delete,pthread_key_delete@GLIBC_2.2.5");
__asm__(".symver pthread_getspecific,pthread_getspecific@GLIBC_2.2.5");
__asm__(".symver pthread_setspecific,pthread_setspecific@GLIBC_2.2.5");
__asm__(".symver pthread_setaffinity_np,pthread_setaffinity_np@GLIBC_2.3.4");
__asm__(".symver pthread_getaffinity_np,pthread_getaffinity_np@GLIBC_2.3.4");
__asm__(".symver pthread_attr_setstacksize,pthread_attr_setstacksize@GLIBC_2.2.5");
__asm__(".symver pthread_mutexattr_settype,pthread_mutexattr_settype@GLIBC_2.2.5");
__asm__(".symver pthread_mutexattr_init,pthread_mutexattr_init@GLIBC_2.2.5");
__asm__(".symver pthread_mutexattr_destroy,pthread_mutexattr_destroy@GLIBC_2.2.5");
__asm__(".symver dlopen,dlopen@GLIBC_2.2.5");
__asm__(".symver dlsym,dlsym@GLIBC_2.2.5");
__asm__(".symver dlclose,dlclose@GLIBC_2.2.5");
__asm__(".symver dlerror,dlerror@GLIBC_2.2.5");
__asm__(".symver dladdr,dladdr@GLIBC_2.2.5");
#endif

#ifdef __cplusplus
extern "C" {
#endif
// libstdc++ (GCC >= 11) reads glibc 2.32's __libc_single_threaded to skip atomics. A hidden local
// definition (see glibc_compat.c) satisfies those references inside the .so; 0 = "maybe threaded",
// i.e. atomics always used, which is always correct.
extern char __libc_single_threaded __attribute__((visibility("hidden")));
#ifdef __cplusplus
}
#endif
