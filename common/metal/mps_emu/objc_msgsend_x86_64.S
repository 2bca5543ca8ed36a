// objc_msgSend for Linux's GNU Objective-C runtime (libobjc4) on x86-64, which has none: look the
// method up with objc_msg_lookup(receiver, selector), then jump to it with every argument register
// as the caller left it (rdi, rsi, rdx, rcx, r8, r9, xmm0-7, and al, the vector-register count of
// a variadic call). Arguments passed in memory (an MTLSize by value, 24 bytes) stay where the
// caller put them: the jump leaves the stack as it was at entry, so the method returns straight
// to the caller. A nil receiver returns 0 in rax, rdx, xmm0 and xmm1, as Apple's runtime does.
//
// objc_msgSend_stret: a struct over 16 bytes returned in memory; its address comes first (rdi),
// the receiver and selector in rsi and rdx. objc_msgSend_fpret: a floating-point result, which on
// x86-64 comes back in xmm0 like any other, so it is objc_msgSend.

#define FRAME 200  // 7 saved registers (56 bytes) + 8 xmm (128) at 64..191; rsp % 16 == 0 after

  .text

// SAVE / RESTORE: the argument registers around the look-up call
.macro SAVE
  subq $FRAME, %rsp
  .cfi_adjust_cfa_offset FRAME
  movq %rdi, 0(%rsp)
  movq %rsi, 8(%rsp)
  movq %rdx, 16(%rsp)
  movq %rcx, 24(%rsp)
  movq %r8, 32(%rsp)
  movq %r9, 40(%rsp)
  movq %rax, 48(%rsp)
  movaps %xmm0, 64(%rsp)
  movaps %xmm1, 80(%rsp)
  movaps %xmm2, 96(%rsp)
  movaps %xmm3, 112(%rsp)
  movaps %xmm4, 128(%rsp)
  movaps %xmm5, 144(%rsp)
  movaps %xmm6, 160(%rsp)
  movaps %xmm7, 176(%rsp)
.endm

.macro RESTORE
  movq 0(%rsp), %rdi
  movq 8(%rsp), %rsi
  movq 16(%rsp), %rdx
  movq 24(%rsp), %rcx
  movq 32(%rsp), %r8
  movq 40(%rsp), %r9
  movq 48(%rsp), %rax
  movaps 64(%rsp), %xmm0
  movaps 80(%rsp), %xmm1
  movaps 96(%rsp), %xmm2
  movaps 112(%rsp), %xmm3
  movaps 128(%rsp), %xmm4
  movaps 144(%rsp), %xmm5
  movaps 160(%rsp), %xmm6
  movaps 176(%rsp), %xmm7
  addq $FRAME, %rsp
  .cfi_adjust_cfa_offset -FRAME
.endm

  .globl objc_msgSend
  .type objc_msgSend, @function
  .globl objc_msgSend_fpret
  .type objc_msgSend_fpret, @function
  .p2align 4
objc_msgSend:
objc_msgSend_fpret:
  .cfi_startproc
  testq %rdi, %rdi
  jz 1f
  SAVE
  call objc_msg_lookup@PLT  // (rdi, rsi) are already (receiver, selector)
  movq %rax, %r11
  RESTORE
  jmp *%r11
1:
  xorl %eax, %eax
  xorl %edx, %edx
  xorps %xmm0, %xmm0
  xorps %xmm1, %xmm1
  ret
  .cfi_endproc
  .size objc_msgSend, .-objc_msgSend
  .size objc_msgSend_fpret, .-objc_msgSend_fpret

  .globl objc_msgSend_stret
  .type objc_msgSend_stret, @function
  .p2align 4
objc_msgSend_stret:
  .cfi_startproc
  testq %rsi, %rsi
  jz 1f
  SAVE
  movq %rsi, %rdi  // receiver
  movq %rdx, %rsi  // selector
  call objc_msg_lookup@PLT
  movq %rax, %r11
  RESTORE
  jmp *%r11
1:
  movq %rdi, %rax  // a nil receiver: the result's address back, the memory left as it was
  ret
  .cfi_endproc
  .size objc_msgSend_stret, .-objc_msgSend_stret

  .section .note.GNU-stack,"",@progbits
