// Stand-in for Apple's TargetConditionals.h on Linux: no Apple platform, so metal-cpp leaves out
// its macOS-only device-observer calls.
#pragma once
#define TARGET_OS_OSX 0
#define TARGET_OS_IPHONE 0
