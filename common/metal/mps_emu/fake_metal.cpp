// A fake Metal framework for Linux: Objective-C classes registered at load time with the GNU
// runtime (libobjc4), so that metal-cpp's calls (objc_msgSend, our trampoline) land here. Every
// message is recorded; what a real Metal runtime refuses throws fake_metal::Misuse out of the call;
// each committed dispatch runs on the emulated device (emu_runtime.h), in encoding order.
//
// Objects are C++ structs whose first word is their class (what the runtime reads), reference
// counted like Cocoa's: alloc/new/copy/Create give +1, everything else is autoreleased into the
// thread's innermost NSAutoreleasePool. A released object is kept as a zombie whose class has no
// methods, so any later message (a second release included) is refused, naming it.
#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <vector>

#include "emu_runtime.h"
#include "fake_mps.h"

// The GNU runtime's class-building API (libobjc4), beyond what metal-cpp declares.
extern "C" {
Class objc_allocateClassPair(Class super_class, const char* name, size_t extra_bytes);
void objc_registerClassPair(Class cls);
BOOL class_addMethod(Class cls, SEL name, IMP imp, const char* types);
BOOL class_addIvar(Class cls, const char* name, size_t size, unsigned char log2_align,
                   const char* type);
const char* class_getName(Class cls);
BOOL class_respondsToSelector(Class cls, SEL sel);
// Consulted when a class has no method for a selector: the IMP it returns is called instead.
extern IMP (*__objc_msg_forward2)(id receiver, SEL sel);
}

namespace ggml_kernels::metal::emu {
// Generated at build time (metal_runtime.py): kernels of upstream's files not translated yet.
extern const char* const kUntranslatedKernels[];
}  // namespace ggml_kernels::metal::emu

namespace fake_metal {

// Generated at build time (tools/build/mps_runtime.py, from upstream's .metal sources): what each
// kernel reads. Ends with {nullptr, ...}.
struct KernelFacts {
  const char* kernel;
  const int32_t* constants;  // function-constant indices
  int constant_count;
  uint32_t buffers;       // bit i: argument index i
  uint32_t threadgroups;  // bit i: threadgroup memory index i
};
extern const KernelFacts kKernelFacts[];

namespace {

namespace emu = ggml_kernels::metal::emu;

// ---- objects ----

struct Obj {
  Class isa;                         // first: what objc_msg_lookup reads
  std::atomic<int> refs{1};          // atomic, as Cocoa's: objects are shared across threads
  const char* type = "";             // the Metal / Foundation type, for messages and leak counts
  void (*destroy)(Obj*) = nullptr;   // releases the objects it holds
  void (*destruct)(Obj*) = nullptr;  // runs its C++ destructor (frees its strings, vectors, memory)
  bool counted = true;  // in live_objects() (not: tensor storage buffers, torch's on a Mac)
};

template <class T>
void destruct(Obj* o) {
  static_cast<T*>(o)->~T();
}

struct Registry {
  std::mutex mutex;
  std::multiset<std::string> live;
  std::vector<std::string> calls;
  std::vector<DispatchRecord> dispatches;
  std::map<std::string, size_t>
      overruns;  // kernel -> most bytes written past its threadgroup memory
  uint64_t source_hash = 0;
  int libraries = 0;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: objects may die after static teardown
  return *r;
}

Class g_zombie = nullptr;  // constant-initialised: set by load() before dynamic initialisers

// Our classes by type name, filled once at load (a function-local static: load() runs before the
// dynamic initialisers of this library's globals).
std::map<std::string, Class>& classes() {
  static std::map<std::string, Class> c;
  return c;
}

[[noreturn]] void refuse(const std::string& what) { throw Misuse("fake Metal: " + what); }

std::string describe(Obj* self, SEL sel) {
  return std::string("-[") + self->type + " " + sel_getName(sel) + "]";
}

thread_local size_t t_last_line = SIZE_MAX;  // this thread's latest line in the call log

void record(const std::string& line) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  t_last_line = SIZE_MAX;
  if (r.calls.size() >= kMaxCalls) return;
  t_last_line = r.calls.size();
  r.calls.push_back(line);
}

// A string argument for the call log: long ones (a library's source) shortened to their start.
std::string quoted(const std::string& text) {
  constexpr size_t kShown = 48;
  const size_t cut = std::min(text.find('\n'), kShown);
  if (cut >= text.size()) return "\"" + text + "\"";
  return "\"" + text.substr(0, cut) + "...\" (" + std::to_string(text.size()) + " bytes)";
}

// Adds `text` to the line of the message this thread is handling (its arguments, what it made).
void detail(const std::string& text) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (t_last_line < r.calls.size()) r.calls[t_last_line] += " " + text;
}

template <class T>
T* make(const char* type, void (*destroy)(Obj*) = nullptr) {
  T* obj = new T();
  obj->isa = classes().at(type);
  obj->type = type;
  obj->destroy = destroy;
  obj->destruct = &fake_metal::destruct<T>;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.live.insert(type);
  return obj;
}

// The object a metal-cpp pointer stands for (any of our classes).
template <class T>
T* as(const void* p) {
  return static_cast<T*>(const_cast<Obj*>(static_cast<const Obj*>(p)));
}

void retain(Obj* o) {
  if (o != nullptr) ++o->refs;
}

// Last reference gone: release what it holds, destroy its members, and keep a header in its
// memory as a zombie (the memory is never freed, so any later message finds the zombie).
void release(Obj* o) {
  if (o == nullptr || --o->refs > 0) return;
  if (o->destroy != nullptr) o->destroy(o);
  const char* type = o->type;
  const bool counted = o->counted;
  o->destruct(o);
  Obj* zombie = new (o) Obj();
  zombie->isa = g_zombie;
  zombie->refs = 0;
  zombie->type = type;
  if (!counted) return;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.live.erase(r.live.find(type));
}

// ---- autorelease pools (per thread, innermost last) ----

struct Pool : Obj {
  std::vector<Obj*> objects;
};
thread_local std::vector<Pool*> t_pools;

Obj* autorelease(Obj* o, const char* why) {
  if (t_pools.empty())
    refuse(std::string(why) + " returns an autoreleased " + o->type +
           " but this thread has no NSAutoreleasePool: on a Mac it leaks");
  t_pools.back()->objects.push_back(o);
  return o;
}

void drain(Pool* pool) {
  auto it = std::find(t_pools.begin(), t_pools.end(), pool);
  if (it == t_pools.end()) refuse("an NSAutoreleasePool drained on a thread that did not make it");
  // inner pools first, as Cocoa does when an outer pool drains
  while (!t_pools.empty()) {
    Pool* inner = t_pools.back();
    t_pools.pop_back();
    for (Obj* o : inner->objects) release(o);
    inner->objects.clear();
    if (inner == pool) break;
  }
}

// ---- Foundation ----

struct String : Obj {
  std::string text;
};
struct Error : Obj {
  std::string message;
  NS::Integer code = 1;
};
struct Array : Obj {
  std::vector<Obj*> items;
};
struct Dictionary : Obj {
  std::vector<std::pair<Obj*, Obj*>> entries;
};

void destroy_array(Obj* o) {
  for (Obj* item : as<Array>(o)->items) release(item);
  as<Array>(o)->items.clear();
}
void destroy_dictionary(Obj* o) {
  for (auto& [k, v] : as<Dictionary>(o)->entries) release(k), release(v);
  as<Dictionary>(o)->entries.clear();
}

String* new_string(const std::string& text) {
  String* s = make<String>("NSString");
  s->text = text;
  return s;
}

std::string text_of(const void* p, const char* what) {
  const Obj* o = static_cast<const Obj*>(p);
  if (o == nullptr) refuse(std::string(what) + ": a nil string");
  if (o->isa != classes().at("NSString")) refuse(std::string(what) + ": not an NSString");
  return static_cast<const String*>(o)->text;
}

// Sets *out (when given) to a new autoreleased NSError.
void set_error(NS::Error** out, const std::string& message, const char* why) {
  if (out == nullptr) return;
  Error* e = make<Error>("NSError");
  e->message = message;
  *out = reinterpret_cast<NS::Error*>(autorelease(e, why));
}

// ---- Metal objects ----

struct Device : Obj {};

struct Buffer : Obj {
  std::unique_ptr<uint8_t[]> owned;
  uint8_t* data = nullptr;
  size_t length = 0;
  MTL::StorageMode mode = MTL::StorageModeShared;
  uint64_t gpu_address = 0;
};

struct Library : Obj {
  std::string source;
};

struct Function : Obj {
  std::string name;
  bool specialized = false;  // made with constant values
  std::map<int32_t, int32_t> constants;
  std::string missing;  // the declared constants it has no value for ("" when none)
};

struct ConstantValues : Obj {
  std::map<int32_t, int32_t> values;
};

struct CompileOptions : Obj {
  NS::UInteger language_version = 0;
  bool fast_math = true;
  Dictionary* macros = nullptr;
};
void destroy_options(Obj* o) { release(as<CompileOptions>(o)->macros); }

struct Pipeline : Obj {
  std::string kernel;
  std::map<int32_t, int32_t> constants;
};

struct CommandBuffer;
struct Queue : Obj {};

// One encoded dispatch (or a barrier), with the objects it retains until the command buffer is
// done.
struct Encoded {
  bool barrier = false;
  DispatchRecord record;
  std::map<int, std::pair<Buffer*, size_t>> buffers;
  std::map<int, std::vector<uint8_t>> bytes;
  Pipeline* pipeline = nullptr;
};

struct Encoder : Obj {
  CommandBuffer* owner = nullptr;
  bool ended = false;
  Pipeline* pipeline = nullptr;
  std::map<int, std::pair<Buffer*, size_t>> buffers;
  std::map<int, std::vector<uint8_t>> bytes;
  std::map<int, size_t> threadgroup_memory;
};

struct CommandBuffer : Obj {
  Queue* queue = nullptr;
  std::vector<Encoded> work;
  Encoder* open = nullptr;  // the encoder not ended yet
  MTL::CommandBufferStatus status = MTL::CommandBufferStatusNotEnqueued;
  Error* error = nullptr;
};

void release_work(CommandBuffer* cb) {
  for (Encoded& e : cb->work) {
    for (auto& [index, b] : e.buffers) release(b.first);
    release(e.pipeline);
  }
  cb->work.clear();
}
void destroy_command_buffer(Obj* o) {
  auto* cb = as<CommandBuffer>(o);
  release_work(cb);
  release(cb->open);
  release(cb->error);
  release(cb->queue);
}
void destroy_encoder(Obj* o) {
  auto* enc = as<Encoder>(o);
  for (auto& [index, b] : enc->buffers) release(b.first);
  release(enc->pipeline);
}

std::atomic<uint64_t> g_next_buffer{1};

// Where a buffer's storage mode sits in its resource options (Apple's MTLResourceStorageModeShift).
constexpr int kStorageModeShift = 4;

Buffer* new_buffer(uint8_t* data, size_t length, MTL::StorageMode mode) {
  Buffer* b = make<Buffer>("MTLBuffer");
  b->data = data;
  b->length = length;
  b->mode = mode;
  // a GPU address that is no host address (bit 62 set), one 2^40-byte slot per buffer
  b->gpu_address = (uint64_t{1} << 62) + (g_next_buffer++ << 40);
  return b;
}

// ---- method registration: every method's IMP is wrapped to log the message first ----

void log_message(const Obj* self, SEL sel) {
  record(std::string("-[") + self->type + " " + sel_getName(sel) + "]");
}
void log_message(Class cls, SEL sel) {
  record(std::string("+[") + class_getName(cls) + " " + sel_getName(sel) + "]");
}

template <auto F>
struct Logged;
template <class R, class Self, class... A, R (*F)(Self*, SEL, A...)>
struct Logged<F> {
  static R call(Self* self, SEL sel, A... args) {
    log_message(self, sel);
    return F(self, sel, args...);
  }
};

// the type string is not used by the runtime's dispatch, but it must not be empty
template <auto F>
void method(Class cls, const char* selector) {
  class_addMethod(cls, sel_registerName(selector), reinterpret_cast<IMP>(&Logged<F>::call), "v@:");
}

template <auto F>
void method(const char* type, const char* selector) {
  method<F>(classes().at(type), selector);
}

template <auto F>
void class_method(const char* type, const char* selector) {
  method<F>(*reinterpret_cast<Class*>(classes().at(type)),
            selector);  // a class's isa: its metaclass
}

// Unknown selectors and messages to released objects land here (through __objc_msg_forward2).
void refuse_message(id receiver, SEL sel) {
  auto* o = reinterpret_cast<Obj*>(receiver);
  if (o->isa == g_zombie)
    refuse(describe(o, sel) +
           " sent to an object already released (released twice, or used after "
           "its last release)");
  refuse(std::string("-[") + class_getName(o->isa) + " " + sel_getName(sel) +
         "]: a selector the fake Metal framework does not implement");
}

IMP forward(id, SEL) { return reinterpret_cast<IMP>(&refuse_message); }

// ---- NSObject (the root of every class here) ----

Obj* obj_retain(Obj* self, SEL sel) {
  retain(self);
  return self;
}
void obj_release(Obj* self, SEL sel) { release(self); }
Obj* obj_autorelease(Obj* self, SEL sel) { return autorelease(self, "autorelease"); }
NS::UInteger obj_retain_count(Obj* self, SEL) { return self->refs.load(); }
bool obj_responds(Obj* self, SEL, SEL query) { return class_respondsToSelector(self->isa, query); }
void* obj_signature(Obj*, SEL, SEL) { return nullptr; }
NS::UInteger obj_hash(Obj* self, SEL) { return reinterpret_cast<uintptr_t>(self); }
bool obj_is_equal(Obj* self, SEL, Obj* other) { return self == other; }
Obj* obj_description(Obj* self, SEL sel) {
  return autorelease(new_string(self->type), sel_getName(sel));
}
Obj* obj_init(Obj* self, SEL sel) { return self; }

// +alloc of the classes a caller may allocate itself
Obj* class_alloc(Class cls, SEL) {
  const std::string name = class_getName(cls);
  if (name == "NSString") return make<String>("NSString");
  if (name == "NSAutoreleasePool") return make<Pool>("NSAutoreleasePool");
  if (name == "MTLCompileOptions")
    return make<CompileOptions>("MTLCompileOptions", destroy_options);
  if (name == "MTLFunctionConstantValues") return make<ConstantValues>("MTLFunctionConstantValues");
  if (name == "NSDictionary") return make<Dictionary>("NSDictionary", destroy_dictionary);
  if (name == "NSArray") return make<Array>("NSArray", destroy_array);
  refuse("+[" + name + " alloc]: the fake Metal framework does not make " + name + " objects");
}

// ---- NSString ----

Obj* string_with_cstring(Class, SEL sel, const char* text, NS::StringEncoding) {
  if (text == nullptr)
    refuse(std::string("+[NSString ") + sel_getName(sel) + "] with a NULL string");
  detail(quoted(text));
  return autorelease(new_string(text), sel_getName(sel));
}
Obj* string_with_utf8(Class cls, SEL sel, const char* text) {
  return string_with_cstring(cls, sel, text, NS::UTF8StringEncoding);
}
Obj* string_empty(Class, SEL sel) { return autorelease(new_string(""), sel_getName(sel)); }
Obj* string_with_string(Class, SEL sel, Obj* other) {
  return autorelease(new_string(text_of(other, "+[NSString stringWithString:]")), sel_getName(sel));
}
Obj* string_init_cstring(String* self, SEL sel, const char* text, NS::StringEncoding) {
  if (text == nullptr) refuse(describe(self, sel) + " with a NULL string");
  detail(quoted(text));
  self->text = text;
  return self;
}
Obj* string_init_utf8(String* self, SEL sel, const char* text) {
  return string_init_cstring(self, sel, text, NS::UTF8StringEncoding);
}
const char* string_utf8(String* self, SEL) { return self->text.c_str(); }
const char* string_cstring(String* self, SEL, NS::StringEncoding) { return self->text.c_str(); }
NS::UInteger string_length(String* self, SEL) { return self->text.size(); }
NS::UInteger string_bytes(String* self, SEL, NS::StringEncoding) { return self->text.size(); }
bool string_equal(String* self, SEL, Obj* other) {
  return other != nullptr && other->isa == self->isa &&
         static_cast<String*>(other)->text == self->text;
}

// ---- NSError ----

Obj* error_description(Error* self, SEL sel) {
  return autorelease(new_string(self->message), sel_getName(sel));
}
NS::Integer error_code(Error* self, SEL) { return self->code; }
Obj* error_domain(Error*, SEL sel) {
  return autorelease(new_string("MTLLibraryErrorDomain"), sel_getName(sel));
}
Obj* nil_result(Obj*, SEL) { return nullptr; }

// ---- NSArray / NSDictionary ----

NS::UInteger array_count(Array* self, SEL) { return self->items.size(); }
Obj* array_at(Array* self, SEL sel, NS::UInteger i) {
  if (i >= self->items.size())
    refuse(describe(self, sel) + ": index " + std::to_string(i) + " beyond its " +
           std::to_string(self->items.size()) + " objects");
  return self->items[i];
}

Dictionary* fill_dictionary(Dictionary* d, Obj* const* objects, Obj* const* keys,
                            NS::UInteger count) {
  for (NS::UInteger i = 0; i < count; ++i) {
    if (objects[i] == nullptr || keys[i] == nullptr)
      refuse("a nil key or value in an NSDictionary");
    retain(keys[i]), retain(objects[i]);
    d->entries.emplace_back(keys[i], objects[i]);
  }
  return d;
}
Obj* dictionary_with(Class, SEL sel, Obj* const* objects, Obj* const* keys, NS::UInteger count) {
  return autorelease(
      fill_dictionary(make<Dictionary>("NSDictionary", destroy_dictionary), objects, keys, count),
      sel_getName(sel));
}
Obj* dictionary_with_one(Class cls, SEL sel, Obj* object, Obj* key) {
  return dictionary_with(cls, sel, &object, &key, 1);
}
Obj* dictionary_empty(Class cls, SEL sel) { return dictionary_with(cls, sel, nullptr, nullptr, 0); }
Obj* dictionary_init(Dictionary* self, SEL, Obj* const* objects, Obj* const* keys,
                     NS::UInteger count) {
  return fill_dictionary(self, objects, keys, count);
}
NS::UInteger dictionary_count(Dictionary* self, SEL) { return self->entries.size(); }
Obj* dictionary_get(Dictionary* self, SEL, Obj* key) {
  for (auto& [k, v] : self->entries)
    if (k == key || (k->isa == key->isa && k->isa == classes().at("NSString") &&
                     static_cast<String*>(k)->text == static_cast<String*>(key)->text))
      return v;
  return nullptr;
}

// ---- NSAutoreleasePool ----

Obj* pool_init(Pool* self, SEL sel) {
  t_pools.push_back(self);
  return self;
}
void pool_release(Pool* self, SEL sel) {
  drain(self);
  release(self);
}

// ---- MTLCompileOptions, MTLFunctionConstantValues ----

void options_language(CompileOptions* self, SEL sel, NS::UInteger v) {
  detail(std::to_string(v));
  self->language_version = v;
}
NS::UInteger options_get_language(CompileOptions* self, SEL) { return self->language_version; }
void options_fast_math(CompileOptions* self, SEL sel, bool on) {
  detail(on ? "YES" : "NO");
  self->fast_math = on;
}
bool options_get_fast_math(CompileOptions* self, SEL) { return self->fast_math; }
void options_math_mode(CompileOptions* self, SEL sel, NS::Integer mode) {
  detail(std::to_string(mode));
  self->fast_math = mode == MTL::MathModeFast;
}
void options_macros(CompileOptions* self, SEL sel, Dictionary* macros) {
  detail(std::to_string(macros ? macros->entries.size() : 0) + " macros");
  retain(macros);
  release(self->macros);
  self->macros = macros;
}
Obj* options_get_macros(CompileOptions* self, SEL) { return self->macros; }

void constants_set(ConstantValues* self, SEL sel, const void* value, MTL::DataType type,
                   NS::UInteger index) {
  if (value == nullptr) refuse(describe(self, sel) + ": a NULL value pointer");
  int32_t v = 0;
  switch (type) {
    case MTL::DataTypeBool: v = *static_cast<const bool*>(value) ? 1 : 0; break;
    case MTL::DataTypeShort: v = *static_cast<const int16_t*>(value); break;
    case MTL::DataTypeUShort: v = *static_cast<const uint16_t*>(value); break;
    case MTL::DataTypeInt: v = *static_cast<const int32_t*>(value); break;
    case MTL::DataTypeUInt: v = static_cast<int32_t>(*static_cast<const uint32_t*>(value)); break;
    default:
      refuse(describe(self, sel) + ": data type " + std::to_string(type) +
             " (the fake takes bool, short, ushort, int, uint)");
  }
  detail(std::to_string(index) + " = " + std::to_string(v));
  self->values[static_cast<int32_t>(index)] = v;
}

// ---- MTLDevice ----

Obj* device_name(Device*, SEL sel) {
  return autorelease(new_string("ggml-kernels fake Metal device (emulated, Apple7+ features)"),
                     sel_getName(sel));
}
NS::UInteger device_tg_memory(Device*, SEL) { return kMaxThreadgroupMemory; }
NS::UInteger device_max_buffer(Device*, SEL) { return NS::UInteger{1} << 36; }
uint64_t device_working_set(Device*, SEL) { return uint64_t{1} << 36; }
bool device_unified(Device*, SEL) { return true; }
MTL::Size device_max_threads(Device*, SEL) { return MTL::Size(1024, 1024, 1024); }
bool device_supports_family(Device* self, SEL sel, MTL::GPUFamily family) {
  detail(std::to_string(family));
  switch (family) {
    case MTL::GPUFamilyApple1:
    case MTL::GPUFamilyApple2:
    case MTL::GPUFamilyApple3:
    case MTL::GPUFamilyApple4:
    case MTL::GPUFamilyApple5:
    case MTL::GPUFamilyApple6:
    case MTL::GPUFamilyApple7:
    case MTL::GPUFamilyCommon1:
    case MTL::GPUFamilyCommon2:
    case MTL::GPUFamilyCommon3:
    case MTL::GPUFamilyMetal3: return true;
    default: return false;  // Apple8+, Metal4, Mac families: as the emulated device, an Apple7
  }
}

Obj* device_new_buffer(Device* self, SEL sel, NS::UInteger length, MTL::ResourceOptions options) {
  detail(std::to_string(length) + " " + std::to_string(options));
  if (length == 0) refuse(describe(self, sel) + ": a zero-length buffer (Metal returns nil)");
  if (length > device_max_buffer(self, sel))
    refuse(describe(self, sel) + ": " + std::to_string(length) + " bytes, over maxBufferLength");
  auto mode = static_cast<MTL::StorageMode>((options >> kStorageModeShift) & 0xf);
  auto owned = std::make_unique<uint8_t[]>(length);  // zero-filled, as Metal's new buffers are
  Buffer* b = new_buffer(owned.get(), length, mode);
  b->owned = std::move(owned);
  return b;
}

uint64_t fnv1a(const std::string& text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

Obj* device_new_library(Device* self, SEL sel, Obj* source, CompileOptions* options,
                        NS::Error** error) {
  const std::string text = text_of(source, "-[MTLDevice newLibraryWithSource:options:error:]");
  const uint64_t hash = fnv1a(text);
  detail(std::to_string(text.size()) + " bytes, hash " + std::to_string(hash));
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) {
    set_error(error, "the library source is empty", "newLibraryWithSource");
    return nullptr;
  }
  (void)options;
  Library* lib = make<Library>("MTLLibrary");
  lib->source = text;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.source_hash = hash;
  ++r.libraries;
  return lib;
}

Obj* device_new_queue(Device* self, SEL sel) { return make<Queue>("MTLCommandQueue"); }

Obj* device_new_pipeline(Device* self, SEL sel, Function* fn, NS::Error** error) {
  if (fn == nullptr) refuse(describe(self, sel) + ": a nil function");
  detail(fn->name);
  if (!fn->missing.empty()) {
    set_error(error,
              "function " + fn->name + " has function constants without a value (indices " +
                  fn->missing + "): make it with newFunctionWithName:constantValues:error:",
              "newComputePipelineStateWithFunction");
    return nullptr;
  }
  Pipeline* p = make<Pipeline>("MTLComputePipelineState");
  p->kernel = fn->name;
  p->constants = fn->constants;
  return p;
}

// ---- MTLLibrary, MTLFunction ----

// What `kernel` reads (from upstream's sources), or nullptr for a kernel the table lacks.
const KernelFacts* kernel_facts(const std::string& kernel) {
  for (const KernelFacts* k = kKernelFacts; k->kernel != nullptr; ++k)
    if (kernel == k->kernel) return k;
  return nullptr;
}

bool known_kernel(const std::string& name) {
  if (emu::has_kernel(name)) return true;
  for (const char* const* n = emu::kUntranslatedKernels; *n != nullptr; ++n)
    if (name == *n) return true;
  return false;
}

// Whether the library's source names the kernel (as a [[host_name("...")]] or a kernel function).
bool source_defines(const Library* lib, const std::string& name) {
  return lib->source.find("\"" + name + "\"") != std::string::npos ||
         lib->source.find(" " + name + "(") != std::string::npos;
}

Function* new_function(Library* lib, const std::string& name, const ConstantValues* values,
                       NS::Error** error) {
  if (!known_kernel(name) || !source_defines(lib, name)) {
    set_error(error, "no function " + name + " in the library", "newFunctionWithName");
    return nullptr;
  }
  std::string missing;
  if (const KernelFacts* k = kernel_facts(name)) {
    for (int i = 0; i < k->constant_count; ++i)
      if (values == nullptr || values->values.count(k->constants[i]) == 0)
        missing += (missing.empty() ? "" : ", ") + std::to_string(k->constants[i]);
  }
  if (values != nullptr && !missing.empty()) {
    set_error(error,
              "function " + name + ": no value for its function constants at indices " + missing,
              "newFunctionWithName:constantValues:error:");
    return nullptr;
  }
  Function* fn = make<Function>("MTLFunction");
  fn->name = name;
  fn->specialized = values != nullptr;
  if (values != nullptr) fn->constants = values->values;
  fn->missing = missing;
  return fn;
}

Obj* library_function(Library* self, SEL sel, Obj* name) {
  const std::string n = text_of(name, "-[MTLLibrary newFunctionWithName:]");
  detail(n);
  return new_function(self, n, nullptr, nullptr);
}

Obj* library_function_with_constants(Library* self, SEL sel, Obj* name, ConstantValues* values,
                                     NS::Error** error) {
  const std::string n = text_of(name, "-[MTLLibrary newFunctionWithName:constantValues:error:]");
  detail(n);
  if (values == nullptr) refuse(describe(self, sel) + ": nil constant values");
  return new_function(self, n, values, error);
}

Obj* library_names(Library* self, SEL sel) {
  Array* a = make<Array>("NSArray", destroy_array);
  for (const auto& [name, info] : emu::kernels())
    if (source_defines(self, name)) a->items.push_back(new_string(name));
  return autorelease(a, sel_getName(sel));
}

Obj* function_name(Function* self, SEL sel) {
  return autorelease(new_string(self->name), sel_getName(sel));
}

// ---- MTLComputePipelineState ----

NS::UInteger pipeline_max_threads(Pipeline*, SEL) { return kMaxThreadsPerThreadgroup; }
NS::UInteger pipeline_width(Pipeline*, SEL) { return emu::kSimdWidth; }
NS::UInteger pipeline_static_tg(Pipeline*, SEL) { return 0; }

// ---- MTLBuffer ----

void* buffer_contents(Buffer* self, SEL sel) {
  return self->mode == MTL::StorageModePrivate ? nullptr : self->data;
}
NS::UInteger buffer_length(Buffer* self, SEL) { return self->length; }
uint64_t buffer_gpu_address(Buffer* self, SEL) { return self->gpu_address; }
void buffer_did_modify(Buffer* self, SEL sel, NS::Range range) {
  detail(std::to_string(range.location) + " " + std::to_string(range.length));
  if (range.location + range.length > self->length)
    refuse(describe(self, sel) + ": a range past the buffer's end");
}
MTL::StorageMode buffer_storage(Buffer* self, SEL) { return self->mode; }

// ---- MTLCommandQueue, MTLCommandBuffer ----

Obj* queue_command_buffer(Queue* self, SEL sel) {
  CommandBuffer* cb = make<CommandBuffer>("MTLCommandBuffer", destroy_command_buffer);
  retain(self);
  cb->queue = self;
  return autorelease(cb, sel_getName(sel));
}

Obj* command_buffer_encoder(CommandBuffer* self, SEL sel) {
  if (self->status != MTL::CommandBufferStatusNotEnqueued)
    refuse(describe(self, sel) + ": the command buffer is already committed");
  if (self->open != nullptr)
    refuse(describe(self, sel) +
           ": the previous encoder of this command buffer has not ended "
           "(endEncoding)");
  Encoder* enc = make<Encoder>("MTLComputeCommandEncoder", destroy_encoder);
  enc->owner = self;
  retain(enc);
  self->open = enc;
  return autorelease(enc, sel_getName(sel));
}

Obj* command_buffer_encoder_with_type(CommandBuffer* self, SEL sel, MTL::DispatchType type) {
  detail(type == MTL::DispatchTypeSerial ? "serial" : "concurrent");
  return command_buffer_encoder(self, sel_registerName("computeCommandEncoder"));
}

// Runs the encoded dispatches in order; a kernel's failure becomes the command buffer's error.
void execute(CommandBuffer* cb) {
  for (const Encoded& e : cb->work) {
    if (e.barrier) continue;  // dispatches run one after the other: every barrier is met
    emu::Launch launch;
    launch.kernel = e.record.kernel;
    launch.constants = e.record.constants;
    int max_index = -1;
    for (const auto& [i, b] : e.buffers) max_index = std::max(max_index, i);
    for (const auto& [i, b] : e.bytes) max_index = std::max(max_index, i);
    launch.buffers.assign(max_index + 1, nullptr);
    for (const auto& [i, b] : e.buffers) launch.buffers[i] = b.first->data + b.second;
    std::vector<std::vector<uint8_t>> copies;  // what the kernel reads: copies, 8-byte aligned
    copies.reserve(e.bytes.size());
    for (const auto& [i, bytes] : e.bytes) {
      copies.push_back(bytes);
      launch.buffers[i] = copies.back().data();
    }
    launch.threadgroup_memory = e.record.threadgroup_memory;
    std::copy(e.record.grid, e.record.grid + 3, launch.grid);
    std::copy(e.record.threads, e.record.threads + 3, launch.threads);
    const size_t overrun = emu::run(launch);
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (overrun > 0) r.overruns[e.record.kernel] = std::max(r.overruns[e.record.kernel], overrun);
    if (r.dispatches.size() >= kMaxDispatches) continue;  // a model's run makes many more
    r.dispatches.push_back(e.record);
    r.dispatches.back().threadgroup_overrun = overrun;
  }
}

void command_buffer_commit(CommandBuffer* self, SEL sel) {
  detail(std::to_string(self->work.size()) + " commands");
  if (self->status != MTL::CommandBufferStatusNotEnqueued)
    refuse(describe(self, sel) + ": committed twice");
  if (self->open != nullptr)
    refuse(describe(self, sel) + ": an encoder of this command buffer has not ended (endEncoding)");
  self->status = MTL::CommandBufferStatusCommitted;
  try {
    execute(self);
    self->status = MTL::CommandBufferStatusCompleted;
  } catch (const Misuse&) {
    throw;
  } catch (const std::exception& e) {
    self->status = MTL::CommandBufferStatusError;
    self->error = make<Error>("NSError");
    self->error->message = e.what();
  }
  release_work(self);
}

void command_buffer_wait(CommandBuffer* self, SEL sel) {
  if (self->status == MTL::CommandBufferStatusNotEnqueued)
    refuse(describe(self, sel) + " before commit: on a Mac it waits forever");
}
MTL::CommandBufferStatus command_buffer_status(CommandBuffer* self, SEL) { return self->status; }
Obj* command_buffer_error(CommandBuffer* self, SEL) { return self->error; }

// ---- MTLComputeCommandEncoder ----

void check_open(Encoder* self, SEL sel) {
  if (self->ended) refuse(describe(self, sel) + " after endEncoding");
}

void check_index(Encoder* self, SEL sel, NS::UInteger index) {
  if (index >= kBufferSlots)
    refuse(describe(self, sel) + ": argument index " + std::to_string(index) +
           " (Metal has buffer indices 0.." + std::to_string(kBufferSlots - 1) + ")");
}

void encoder_set_pipeline(Encoder* self, SEL sel, Pipeline* p) {
  check_open(self, sel);
  if (p == nullptr) refuse(describe(self, sel) + ": a nil pipeline");
  detail(p->kernel);
  retain(p);
  release(self->pipeline);
  self->pipeline = p;
}

void encoder_set_bytes(Encoder* self, SEL sel, const void* bytes, NS::UInteger length,
                       NS::UInteger index) {
  check_open(self, sel);
  check_index(self, sel, index);
  detail(std::to_string(length) + " @" + std::to_string(index));
  if (bytes == nullptr || length == 0) refuse(describe(self, sel) + ": no bytes");
  if (length > kMaxSetBytesLength)
    refuse(describe(self, sel) + ": " + std::to_string(length) +
           " bytes (setBytes takes at most 4 KiB; use a buffer)");
  auto it = self->buffers.find(index);
  if (it != self->buffers.end()) release(it->second.first), self->buffers.erase(it);
  const auto* p = static_cast<const uint8_t*>(bytes);
  self->bytes[index].assign(p, p + length);
}

void encoder_set_buffer(Encoder* self, SEL sel, Buffer* buffer, NS::UInteger offset,
                        NS::UInteger index) {
  check_open(self, sel);
  check_index(self, sel, index);
  detail(std::to_string(offset) + " @" + std::to_string(index));
  if (buffer != nullptr && offset > buffer->length)
    refuse(describe(self, sel) + ": offset " + std::to_string(offset) + " past the end of a " +
           std::to_string(buffer->length) + "-byte buffer");
  self->bytes.erase(index);
  auto& slot = self->buffers[index];
  retain(buffer);
  release(slot.first);
  slot = {buffer, offset};
  if (buffer == nullptr) self->buffers.erase(index);
}

// The threadgroup memory a threadgroup may use: the device's, or less under the test hook
// kThreadgroupMemoryLimitEnv (fake_mps.h).
size_t threadgroup_memory_limit() {
  const char* text = std::getenv(kThreadgroupMemoryLimitEnv);
  if (text == nullptr || *text == '\0') return kMaxThreadgroupMemory;
  char* end = nullptr;
  const unsigned long long limit = std::strtoull(text, &end, 10);
  if (*end != '\0' || text[0] == '-' || limit == 0 || limit > kMaxThreadgroupMemory)
    refuse(std::string(kThreadgroupMemoryLimitEnv) + "=" + text + ": not a byte count from 1 to " +
           std::to_string(kMaxThreadgroupMemory));
  return static_cast<size_t>(limit);
}

void encoder_set_tg_memory(Encoder* self, SEL sel, NS::UInteger length, NS::UInteger index) {
  check_open(self, sel);
  check_index(self, sel, index);
  detail(std::to_string(length) + " @" + std::to_string(index));
  const size_t limit = threadgroup_memory_limit();
  if (length > limit)
    refuse(describe(self, sel) + ": " + std::to_string(length) + " bytes, over the device's " +
           std::to_string(limit) + "-byte threadgroup memory");
  self->threadgroup_memory[static_cast<int>(index)] = length;
}

// Every argument and threadgroup memory the kernel reads is bound (Metal's validation refuses a
// dispatch that leaves one out; on the emulator the kernel would read through a null pointer).
void check_arguments(Encoder* self, SEL sel) {
  const KernelFacts* k = kernel_facts(self->pipeline->kernel);
  if (k == nullptr) return;
  for (size_t i = 0; i < kBufferSlots; ++i) {
    if ((k->buffers >> i & 1) && self->buffers.count(i) == 0 && self->bytes.count(i) == 0)
      refuse(describe(self, sel) + ": " + k->kernel + " reads argument " + std::to_string(i) +
             ", and no buffer or bytes are bound there");
    if ((k->threadgroups >> i & 1) && self->threadgroup_memory.count(i) == 0)
      refuse(describe(self, sel) + ": " + k->kernel + " uses threadgroup memory " +
             std::to_string(i) + ", and none was set (setThreadgroupMemoryLength)");
  }
}

void encoder_dispatch(Encoder* self, SEL sel, MTL::Size grid, MTL::Size threads) {
  check_open(self, sel);
  detail(std::to_string(grid.width) + "x" + std::to_string(grid.height) + "x" +
         std::to_string(grid.depth) + " of " + std::to_string(threads.width) + "x" +
         std::to_string(threads.height) + "x" + std::to_string(threads.depth));
  if (self->pipeline == nullptr) refuse(describe(self, sel) + " without a pipeline state");
  const NS::UInteger total = threads.width * threads.height * threads.depth;
  if (total == 0 || total > kMaxThreadsPerThreadgroup)
    refuse(describe(self, sel) + ": " + std::to_string(total) +
           " threads per threadgroup (the pipeline takes 1.." +
           std::to_string(kMaxThreadsPerThreadgroup) + ")");
  size_t tg_total = 0;
  for (const auto& [index, length] : self->threadgroup_memory) tg_total += length;
  const size_t limit = threadgroup_memory_limit();
  if (tg_total > limit)
    refuse(describe(self, sel) + ": " + std::to_string(tg_total) +
           " bytes of threadgroup memory in all, over the device's " + std::to_string(limit));
  check_arguments(self, sel);
  Encoded e;
  e.record.kernel = self->pipeline->kernel;
  e.record.constants = self->pipeline->constants;
  const NS::UInteger g[3] = {grid.width, grid.height, grid.depth};
  const NS::UInteger t[3] = {threads.width, threads.height, threads.depth};
  for (int i = 0; i < 3; ++i)
    e.record.grid[i] = static_cast<uint32_t>(g[i]),
    e.record.threads[i] = static_cast<uint32_t>(t[i]);
  for (const auto& [index, b] : self->buffers) e.record.buffer_offsets[index] = b.second;
  for (const auto& [index, bytes] : self->bytes) e.record.bytes_lengths[index] = bytes.size();
  e.record.threadgroup_memory = self->threadgroup_memory;
  e.buffers = self->buffers;
  for (auto& [index, b] : e.buffers) retain(b.first);  // the command buffer keeps them alive
  e.bytes = self->bytes;
  e.pipeline = self->pipeline;
  retain(e.pipeline);
  self->owner->work.push_back(std::move(e));
}

void encoder_barrier(Encoder* self, SEL sel, MTL::BarrierScope scope) {
  check_open(self, sel);
  detail(std::to_string(scope));
  Encoded e;
  e.barrier = true;
  self->owner->work.push_back(std::move(e));
}

void encoder_end(Encoder* self, SEL sel) {
  check_open(self, sel);
  self->ended = true;
  CommandBuffer* cb = self->owner;
  if (cb->open == self) {
    cb->open = nullptr;
    release(self);
  }
}

void encoder_debug_group(Encoder* self, SEL sel, Obj*) { check_open(self, sel); }
void encoder_pop_debug_group(Encoder* self, SEL sel) { check_open(self, sel); }

// ---- class registration: before any static initialiser of metal-cpp looks a class up ----

// Why the classes could not be registered ("" when they were): every entry point refuses then.
const char* g_load_error = "";

Class define_class(const char* name, Class super) {
  Class cls = objc_allocateClassPair(super, name, 0);
  if (cls == nullptr)  // a second copy of the framework in the process: its classes exist
    throw std::runtime_error(std::string("class ") + name + " already exists");
  if (super == nullptr)  // the GNU runtime sizes instances from their ivars: a root needs its isa
    class_addIvar(cls, "isa", sizeof(Class), 3, "#");
  return cls;
}

void register_classes() {
  // Foundation and Metal classes a caller names (alloc / class methods) keep Apple's names; the
  // others are private classes behind Metal's protocols, as on a Mac.
  const std::pair<const char*, const char*> kClasses[] = {
      {"NSString", "NSString"},
      {"NSError", "NSError"},
      {"NSArray", "NSArray"},
      {"NSDictionary", "NSDictionary"},
      {"NSAutoreleasePool", "NSAutoreleasePool"},
      {"MTLCompileOptions", "MTLCompileOptions"},
      {"MTLFunctionConstantValues", "MTLFunctionConstantValues"},
      {"MTLDevice", "GKFakeMTLDevice"},
      {"MTLBuffer", "GKFakeMTLBuffer"},
      {"MTLLibrary", "GKFakeMTLLibrary"},
      {"MTLFunction", "GKFakeMTLFunction"},
      {"MTLComputePipelineState", "GKFakeMTLComputePipelineState"},
      {"MTLCommandQueue", "GKFakeMTLCommandQueue"},
      {"MTLCommandBuffer", "GKFakeMTLCommandBuffer"},
      {"MTLComputeCommandEncoder", "GKFakeMTLComputeCommandEncoder"},
  };
  Class root = define_class("GKFakeObject", nullptr);
  classes()["NSObject"] = root;
  method<&obj_retain>(root, "retain");
  method<&obj_release>(root, "release");
  method<&obj_autorelease>(root, "autorelease");
  method<&obj_retain_count>(root, "retainCount");
  method<&obj_responds>(root, "respondsToSelector:");
  method<&obj_signature>(root, "methodSignatureForSelector:");
  method<&obj_hash>(root, "hash");
  method<&obj_is_equal>(root, "isEqual:");
  method<&obj_description>(root, "description");
  method<&obj_init>(root, "init");
  Class root_meta = *reinterpret_cast<Class*>(root);
  method<&class_alloc>(root_meta, "alloc");
  objc_registerClassPair(root);

  std::vector<std::pair<const char*, Class>> made;
  for (const auto& [type, name] : kClasses) made.emplace_back(type, define_class(name, root));
  for (const auto& [type, cls] : made) classes()[type] = cls;
  g_zombie = define_class("GKFakeReleasedObject", nullptr);  // no methods: every message refused

  method<&string_init_cstring>("NSString", "initWithCString:encoding:");
  method<&string_init_utf8>("NSString", "initWithUTF8String:");
  method<&string_utf8>("NSString", "UTF8String");
  method<&string_cstring>("NSString", "cStringUsingEncoding:");
  method<&string_length>("NSString", "length");
  method<&string_bytes>("NSString", "lengthOfBytesUsingEncoding:");
  method<&string_equal>("NSString", "isEqualToString:");
  class_method<&string_with_cstring>("NSString", "stringWithCString:encoding:");
  class_method<&string_with_utf8>("NSString", "stringWithUTF8String:");
  class_method<&string_empty>("NSString", "string");
  class_method<&string_with_string>("NSString", "stringWithString:");
  method<&error_description>("NSError", "localizedDescription");
  method<&error_code>("NSError", "code");
  method<&error_domain>("NSError", "domain");
  method<&nil_result>("NSError", "userInfo");
  method<&nil_result>("NSError", "localizedFailureReason");
  method<&nil_result>("NSError", "localizedRecoverySuggestion");
  method<&array_count>("NSArray", "count");
  method<&array_at>("NSArray", "objectAtIndex:");
  class_method<&dictionary_with>("NSDictionary", "dictionaryWithObjects:forKeys:count:");
  class_method<&dictionary_with_one>("NSDictionary", "dictionaryWithObject:forKey:");
  class_method<&dictionary_empty>("NSDictionary", "dictionary");
  method<&dictionary_init>("NSDictionary", "initWithObjects:forKeys:count:");
  method<&dictionary_count>("NSDictionary", "count");
  method<&dictionary_get>("NSDictionary", "objectForKey:");
  method<&pool_init>("NSAutoreleasePool", "init");
  method<&pool_release>("NSAutoreleasePool", "release");
  method<&pool_release>("NSAutoreleasePool", "drain");
  method<&options_language>("MTLCompileOptions", "setLanguageVersion:");
  method<&options_get_language>("MTLCompileOptions", "languageVersion");
  method<&options_fast_math>("MTLCompileOptions", "setFastMathEnabled:");
  method<&options_get_fast_math>("MTLCompileOptions", "fastMathEnabled");
  method<&options_math_mode>("MTLCompileOptions", "setMathMode:");
  method<&options_macros>("MTLCompileOptions", "setPreprocessorMacros:");
  method<&options_get_macros>("MTLCompileOptions", "preprocessorMacros");
  method<&constants_set>("MTLFunctionConstantValues", "setConstantValue:type:atIndex:");
  method<&device_name>("MTLDevice", "name");
  method<&device_tg_memory>("MTLDevice", "maxThreadgroupMemoryLength");
  method<&device_max_buffer>("MTLDevice", "maxBufferLength");
  method<&device_working_set>("MTLDevice", "recommendedMaxWorkingSetSize");
  method<&device_unified>("MTLDevice", "hasUnifiedMemory");
  method<&device_max_threads>("MTLDevice", "maxThreadsPerThreadgroup");
  method<&device_supports_family>("MTLDevice", "supportsFamily:");
  method<&device_new_buffer>("MTLDevice", "newBufferWithLength:options:");
  method<&device_new_library>("MTLDevice", "newLibraryWithSource:options:error:");
  method<&device_new_queue>("MTLDevice", "newCommandQueue");
  method<&device_new_pipeline>("MTLDevice", "newComputePipelineStateWithFunction:error:");
  method<&library_function>("MTLLibrary", "newFunctionWithName:");
  method<&library_function_with_constants>("MTLLibrary",
                                           "newFunctionWithName:constantValues:error:");
  method<&library_names>("MTLLibrary", "functionNames");
  method<&function_name>("MTLFunction", "name");
  method<&pipeline_max_threads>("MTLComputePipelineState", "maxTotalThreadsPerThreadgroup");
  method<&pipeline_width>("MTLComputePipelineState", "threadExecutionWidth");
  method<&pipeline_static_tg>("MTLComputePipelineState", "staticThreadgroupMemoryLength");
  method<&buffer_contents>("MTLBuffer", "contents");
  method<&buffer_length>("MTLBuffer", "length");
  method<&buffer_gpu_address>("MTLBuffer", "gpuAddress");
  method<&buffer_did_modify>("MTLBuffer", "didModifyRange:");
  method<&buffer_storage>("MTLBuffer", "storageMode");
  method<&queue_command_buffer>("MTLCommandQueue", "commandBuffer");
  method<&command_buffer_encoder>("MTLCommandBuffer", "computeCommandEncoder");
  method<&command_buffer_encoder_with_type>("MTLCommandBuffer",
                                            "computeCommandEncoderWithDispatchType:");
  method<&command_buffer_commit>("MTLCommandBuffer", "commit");
  method<&command_buffer_wait>("MTLCommandBuffer", "waitUntilCompleted");
  method<&command_buffer_status>("MTLCommandBuffer", "status");
  method<&command_buffer_error>("MTLCommandBuffer", "error");
  method<&encoder_set_pipeline>("MTLComputeCommandEncoder", "setComputePipelineState:");
  method<&encoder_set_bytes>("MTLComputeCommandEncoder", "setBytes:length:atIndex:");
  method<&encoder_set_buffer>("MTLComputeCommandEncoder", "setBuffer:offset:atIndex:");
  method<&encoder_set_tg_memory>("MTLComputeCommandEncoder", "setThreadgroupMemoryLength:atIndex:");
  method<&encoder_dispatch>("MTLComputeCommandEncoder",
                            "dispatchThreadgroups:threadsPerThreadgroup:");
  method<&encoder_barrier>("MTLComputeCommandEncoder", "memoryBarrierWithScope:");
  method<&encoder_end>("MTLComputeCommandEncoder", "endEncoding");
  method<&encoder_debug_group>("MTLComputeCommandEncoder", "pushDebugGroup:");
  method<&encoder_pop_debug_group>("MTLComputeCommandEncoder", "popDebugGroup");

  for (const auto& [type, cls] : made) objc_registerClassPair(cls);
  objc_registerClassPair(g_zombie);
  __objc_msg_forward2 = &forward;
}

// Priority 101: before the default-priority static initialisers of metal-cpp's
// MTL_PRIVATE_IMPLEMENTATION unit (which look the classes up) in the same library or a dependent.
__attribute__((constructor(101))) void load() {
  try {
    register_classes();
  } catch (const std::exception& e) {
    static std::string error;
    error = std::string("fake Metal: the framework's classes could not be registered (") +
            e.what() + "): one copy of libggml-kernels-fake-metal.so per process";
    g_load_error = error.c_str();
  }
}

void check_loaded() {
  if (*g_load_error != '\0') throw Misuse(g_load_error);
}

}  // namespace

// ---- the fake's own API (fake_mps.h) ----

MTL::Buffer* wrap_host_memory(void* data, size_t length, bool private_storage) {
  check_loaded();
  if (data == nullptr || length == 0) refuse("wrap_host_memory: no memory to wrap");
  record("wrap_host_memory " + std::to_string(length));
  Buffer* b = new_buffer(static_cast<uint8_t*>(data), length,
                         private_storage ? MTL::StorageModePrivate : MTL::StorageModeShared);
  return reinterpret_cast<MTL::Buffer*>(b);
}

MTL::Buffer* storage_buffer(void* data, size_t length) {
  static std::mutex mutex;
  static std::map<void*, Buffer*> by_storage;
  std::lock_guard<std::mutex> lock(mutex);
  Buffer*& b = by_storage[data];
  if (b != nullptr && b->length == length) return reinterpret_cast<MTL::Buffer*>(b);
  release(b);  // (a command buffer still using it keeps it alive)
  b = reinterpret_cast<Buffer*>(wrap_host_memory(data, length, true));
  b->counted = false;
  auto& r = registry();
  std::lock_guard<std::mutex> registry_lock(r.mutex);
  r.live.erase(r.live.find(b->type));
  return reinterpret_cast<MTL::Buffer*>(b);
}

std::vector<std::string> calls() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.calls;
}

void reset_calls() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.calls.clear();
}

std::vector<DispatchRecord> dispatches() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.dispatches;
}

void reset_dispatches() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.dispatches.clear();
  r.overruns.clear();
}

std::map<std::string, size_t> threadgroup_overruns() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.overruns;
}

void set_lane_schedule(bool reverse, bool lane_zero_convergence) {
  emu::set_schedule(reverse ? emu::Schedule::Reverse : emu::Schedule::Forward);
  emu::set_lane_zero_convergence(lane_zero_convergence);
}

std::map<std::string, int> live_objects() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::map<std::string, int> counts;
  for (const std::string& type : r.live) ++counts[type];
  return counts;
}

void check_no_leaks(const std::map<std::string, int>& before, const char* what) {
  std::string grew;
  for (const auto& [type, n] : live_objects()) {
    auto it = before.find(type);
    const int was = it == before.end() ? 0 : it->second;
    if (n > was) grew += (grew.empty() ? "" : ", ") + std::to_string(n - was) + " " + type;
  }
  if (!grew.empty()) refuse(std::string(what) + " leaked " + grew);
}

uint64_t last_library_source_hash() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.source_hash;
}

int libraries_made() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.libraries;
}

}  // namespace fake_metal

// ---- the framework's C entry points ----

extern "C" __attribute__((visibility("default"))) MTL::Device* MTLCreateSystemDefaultDevice() {
  fake_metal::check_loaded();
  fake_metal::record("MTLCreateSystemDefaultDevice");
  return reinterpret_cast<MTL::Device*>(
      fake_metal::make<fake_metal::Device>("MTLDevice"));  // +1: a Create function
}

// What metal-cpp's block-taking wrappers reference. The fake takes no blocks (no completion
// handlers, no device observers): copying one is refused.
extern "C" __attribute__((visibility("default"))) void* _NSConcreteStackBlock[32] = {};
extern "C" __attribute__((visibility("default"))) void* _NSConcreteGlobalBlock[32] = {};
extern "C" __attribute__((visibility("default"))) void _Block_object_assign(void*, const void*,
                                                                            const int) {
  throw fake_metal::Misuse("fake Metal: blocks (completion handlers) are not supported");
}
extern "C" __attribute__((visibility("default"))) void _Block_object_dispose(const void*,
                                                                             const int) {}
