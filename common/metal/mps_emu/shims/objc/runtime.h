// The Objective-C runtime as metal-cpp uses it, declared for Linux's GNU runtime (libobjc4):
// object, class and selector handles, class and protocol look-up, selector registration. An
// object's first word is its class (isa), as on Apple's runtime.
#pragma once
#include <stddef.h>
#ifdef __cplusplus
extern "C" {
#endif
typedef struct objc_class* Class;
struct objc_object {
  Class isa;
};
typedef struct objc_object* id;
typedef const struct objc_selector* SEL;
typedef id (*IMP)(id, SEL, ...);
typedef unsigned char BOOL;  // the GNU runtime's (Apple's x86-64 runtime: signed char)
typedef struct objc_object Protocol;

Class objc_lookUpClass(const char* name);
Protocol* objc_getProtocol(const char* name);
SEL sel_registerName(const char* name);
const char* sel_getName(SEL selector);
#ifdef __cplusplus
}
#endif
