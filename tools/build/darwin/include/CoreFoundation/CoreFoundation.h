// Stand-in for the SDK's CoreFoundation header (not on the package index): the types metal-cpp's
// Foundation headers name, declared as CoreFoundation declares them (an opaque struct pointer, a
// double). The darwin builds never call CoreFoundation.
#pragma once

typedef double CFTimeInterval;
typedef const void* CFTypeRef;
typedef const struct __CFString* CFStringRef;
