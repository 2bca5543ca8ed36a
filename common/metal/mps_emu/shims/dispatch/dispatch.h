// Stand-in for libdispatch on Linux: the handle types metal-cpp and torch's MPSStream.h name, and
// dispatch_sync_f, which the fake MPS stream implements for its own serial queue (a device layer
// encodes on torch's stream inside dispatch_sync_f(stream->queue(), ...)). C-mode types, as
// libdispatch declares them for C++ on macOS.
#pragma once
#ifdef __cplusplus
extern "C" {
#endif
typedef struct dispatch_queue_s* dispatch_queue_t;
typedef struct dispatch_data_s* dispatch_data_t;
typedef void (*dispatch_function_t)(void*);
// Runs work(context) on `queue` and returns when it is done. Refuses (a C++ exception) a call made
// from work already running on that queue: on macOS that deadlocks.
void dispatch_sync_f(dispatch_queue_t queue, void* context, dispatch_function_t work);
#ifdef __cplusplus
}
#endif
