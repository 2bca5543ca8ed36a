// metal-cpp's selector and class tables (its "private implementation"), instantiated once per
// library that uses metal-cpp: here, for the MPS device layer's library. metal-cpp itself (Apple's
// headers, Apache-2.0) is taken from the package index at build time, never committed.
#define NS_PRIVATE_IMPLEMENTATION
#define MTL_PRIVATE_IMPLEMENTATION
#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>
