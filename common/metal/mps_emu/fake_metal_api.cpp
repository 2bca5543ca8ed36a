// The fake framework's diagnostics as a C API of JSON texts (fake_mps.h), for Python (ctypes) and
// any other caller that does not link C++ against it.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>

#include "fake_mps.h"
#include "metal_emu_api.h"

namespace {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
      out += escaped;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

template <class Map>
std::string json_object(const Map& map) {
  std::string out = "{";
  for (const auto& [key, value] : map)
    out += (out.size() > 1 ? ", " : "") + json_string(std::to_string(key)) + ": " +
           std::to_string(value);
  return out + "}";
}

std::string json_dispatch(const fake_metal::DispatchRecord& d) {
  auto triple = [](const uint32_t* v) {
    return "[" + std::to_string(v[0]) + ", " + std::to_string(v[1]) + ", " + std::to_string(v[2]) +
           "]";
  };
  return "{\"kernel\": " + json_string(d.kernel) + ", \"constants\": " + json_object(d.constants) +
         ", \"grid\": " + triple(d.grid) + ", \"threads\": " + triple(d.threads) +
         ", \"buffer_offsets\": " + json_object(d.buffer_offsets) +
         ", \"bytes\": " + json_object(d.bytes_lengths) +
         ", \"threadgroup_memory\": " + json_object(d.threadgroup_memory) +
         ", \"threadgroup_overrun\": " + std::to_string(d.threadgroup_overrun) + "}";
}

// Copies text into out (at most capacity bytes, NUL-terminated); returns the length it needs.
size_t give(const std::string& text, char* out, size_t capacity) {
  if (out != nullptr && capacity > 0) {
    const size_t n = std::min(text.size(), capacity - 1);
    std::memcpy(out, text.data(), n);
    out[n] = '\0';
  }
  return text.size();
}

}  // namespace

extern "C" {

size_t gk_fake_metal_calls_json(char* out, size_t capacity) {
  std::string text = "[";
  for (const std::string& line : fake_metal::calls())
    text += (text.size() > 1 ? ", " : "") + json_string(line);
  return give(text + "]", out, capacity);
}

size_t gk_fake_metal_dispatches_json(char* out, size_t capacity) {
  std::string text = "[";
  for (const fake_metal::DispatchRecord& d : fake_metal::dispatches())
    text += (text.size() > 1 ? ", " : "") + json_dispatch(d);
  return give(text + "]", out, capacity);
}

size_t gk_fake_metal_live_objects_json(char* out, size_t capacity) {
  std::string text = "{";
  for (const auto& [type, n] : fake_metal::live_objects())
    text += (text.size() > 1 ? ", " : "") + json_string(type) + ": " + std::to_string(n);
  return give(text + "}", out, capacity);
}

size_t gk_fake_metal_overruns_json(char* out, size_t capacity) {
  std::string text = "{";
  for (const auto& [kernel, bytes] : fake_metal::threadgroup_overruns())
    text += (text.size() > 1 ? ", " : "") + json_string(kernel) + ": " + std::to_string(bytes);
  return give(text + "}", out, capacity);
}
void gk_fake_metal_set_lane_schedule(int flags) {
  fake_metal::set_lane_schedule((flags & GK_METAL_LANES_REVERSE) != 0,
                                (flags & GK_METAL_LANES_NO_CONVERGENCE) == 0);
}
void gk_fake_metal_reset(void) {
  fake_metal::reset_calls();
  fake_metal::reset_dispatches();
}

}  // extern "C"
