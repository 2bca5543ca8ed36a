// Message sending as metal-cpp calls it. The GNU runtime has no objc_msgSend (it looks methods up
// with objc_msg_lookup); these three are ggml-kernels' trampolines (objc_msgsend_x86_64.S),
// declared the way Apple declares them: cast to the method's real type before calling.
#pragma once
#include <objc/runtime.h>
#ifdef __cplusplus
extern "C" {
#endif
void objc_msgSend(void);
void objc_msgSend_stret(void);  // a struct over 16 bytes returned in memory (x86-64)
void objc_msgSend_fpret(void);  // a floating-point result
#ifdef __cplusplus
}
#endif
