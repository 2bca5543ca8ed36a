// Stand-in for CoreFoundation on Linux: the C headers Apple's CoreFoundation.h brings in (metal-cpp
// relies on size_t and INFINITY arriving this way) and the one CoreFoundation type metal-cpp's
// Foundation and Metal headers use (seconds, as a double).
#pragma once
#include <math.h>
#include <stddef.h>
#include <stdint.h>
typedef double CFTimeInterval;
