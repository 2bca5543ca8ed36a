// Stand-in for IOSurface on Linux: the opaque handle type metal-cpp's texture calls name.
#pragma once
typedef struct __IOSurface* IOSurfaceRef;
