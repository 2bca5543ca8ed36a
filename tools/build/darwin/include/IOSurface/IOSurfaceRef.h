// Stand-in for the SDK's IOSurface header: metal-cpp's texture API names IOSurfaceRef, an opaque
// pointer. The darwin builds make no IOSurface.
#pragma once

typedef struct __IOSurface* IOSurfaceRef;
