// Hidden stand-ins for libstdc++ symbols newer than manylinux_2_28's GLIBCXX_3.4.24 that GCC 12's
// headers make our code call. References inside the .so bind to these.
#include <new>

namespace std {
// GLIBCXX_3.4.29 (GCC 11): thrown by `new T[n]` when n is too large.
__attribute__((visibility("hidden"), noreturn)) void __throw_bad_array_new_length() {
  throw std::bad_array_new_length();
}
}  // namespace std
