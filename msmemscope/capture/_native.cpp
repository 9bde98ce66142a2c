// The native capture source: msmemscope's default events (MALLOC, FREE, OP_LAUNCH) recorded in
// C++, so that the per-op and per-allocation work never enters Python.
//
//  * a wrapper around the CPU allocator records every allocation and free (address, size, the
//    bytes in use after it) and keeps the block's original deleter in a side table keyed by the
//    data pointer (context == data, so raw_deleter() keeps working for raw_allocate users);
//  * a global RecordFunction callback (FUNCTION scope: dispatcher ops) records the start and end
//    of each top-level op of a thread; nested ops only move a nesting counter, and allocations
//    are attributed to the top-level op running on their thread. RecordFunctions named by a
//    string (the autograd engine's per-node wrappers) are not ops: the ops inside them are.
//
//  * access events (when asked at install): the inputs of each top-level op (READ, or WRITE where
//    the schema's alias info says the op writes that argument) and the outputs it allocated
//    (WRITE), each resolved to its block through the side table;
//  * Python call stacks (when asked): taken once per top-level op, on a thread Python knows, by
//    walking the interpreter's frames with the GIL; (code object, instruction) pairs and whole
//    stacks are interned, so a record holds a stack id and the text is built once, at drain.
//
// Records go into one vector under a mutex (a step boundary too: a STEP record); Python drains it
// (at flushes, before each Python-side row so that the order holds, and from the op exit when it
// grows past a bound) into row tuples shaped like the Python source's.
// libtorch is built with NDEBUG, and RecordFunction's layout depends on it (a debug-only field
// before its inputs): built without it, inputs() would read the wrong member.
#ifndef NDEBUG
#define NDEBUG
#endif
// the headers this file uses, not <torch/extension.h> (all of libtorch's C++ API, twice the build time)
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/engine.h>
#include <c10/core/GradMode.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/CPUAllocator.h>
#include <Python.h>
#include <structmember.h>
#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

inline bool py_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// FREE_UNTRACED: a counted block freed while the session does not record (stopped, or a step
// outside --steps): its FREE row is still written, flagged, so that `used` stays the running sum.
// MALLOC_BEFORE_OP: a block allocated outside the traced window, counted when a traced op first
// reads it (access events on), as the dispatch-mode source registers it ("origin": "before_op").
enum Kind : int32_t { OP_START = 0, OP_END = 1, MALLOC = 2, FREE = 3, ALLOC_FAILED = 4, FREE_UNTRACED = 5,
                      MALLOC_BEFORE_OP = 6, ACCESS_READ = 7, ACCESS_WRITE = 8, STEP_END = 9 };

struct Rec {
  int64_t ts;
  uint64_t tid;
  uint64_t ptr;
  int64_t size;
  int64_t used;   // ACCESS: the absolute offset of the tensor's shape in `shapes`
  int64_t aid;
  int32_t kind;
  int32_t op;     // index into op names, -1 outside any op
  int32_t stack;  // MALLOC, OP_START: interned Python stack, -1 none
  int32_t extra;  // ACCESS: scalar type | ndim << 8
};

struct Block {
  void* ctx;
  c10::DeleterFnPtr deleter;
  int64_t size;
  int64_t aid;
  bool counted;  // allocated while recording: its free is counted and recorded
};

// Heap objects that are never destroyed: storages outlive static destructors at exit.
std::mutex& mu = *new std::mutex();
std::vector<Rec>& recs = *new std::vector<Rec>();
// drain's batch: the records are swapped out into it (not copied) and go back to the head of
// `recs` if the drain fails; both vectors keep their capacity, so neither grows again each step
std::vector<Rec>& drained = *new std::vector<Rec>();
uint64_t recs_epoch = 0;  // bumped where `recs` is cleared: a failed drain then puts nothing back
// The blocks the wrapper handed out, by data pointer: dense entries and an index of open addressing
// (linear probing, deletion by backward shift), both mapped from the system, not taken from the heap. A node-based map
// allocated a node per block and freed it with the block, from inside the program's own
// allocations: those small chunks between its tensors changed where glibc put the tensors, and
// how often they landed on fresh pages (BENCHMARKS.md, twenty-first session). Under mu.
class LiveTable {
 public:
  // the entries are dense (iteration reads only them: the owner labels ask for every live id at
  // each step end); an index of open addressing finds them by pointer
  struct Entry {
    void* key;
    Block b;
  };
  // (a null pointer is never a block: raw_deallocate(nullptr) reaches traced_delete)
  Block* find(const void* k) {
    size_t i;
    return k == nullptr || !locate(k, &i) ? nullptr : &ents_[idx_[i] - 1].b;
  }
  void put(void* k, const Block& b) {  // k not null
    size_t i;
    if (locate(k, &i)) {
      ents_[idx_[i] - 1].b = b;
      return;
    }
    if (count_ == ent_cap_) grow_entries();
    if ((count_ + 1) * 2 > idx_cap_) grow_index();
    ents_[count_] = {k, b};
    ++count_;
    index_put(k, (uint32_t)count_);
  }
  bool take(const void* k, Block* out) {
    size_t i;
    if (k == nullptr || !locate(k, &i)) return false;
    size_t e = idx_[i] - 1;
    *out = ents_[e].b;
    index_remove(i);
    size_t last = count_ - 1;
    if (e != last) {  // the last entry fills the hole; its index slot follows it
      ents_[e] = ents_[last];
      size_t j;
      locate(ents_[e].key, &j);
      idx_[j] = (uint32_t)(e + 1);
    }
    --count_;
    return true;
  }
  size_t size() const { return count_; }
  template <typename F>
  void each(F f) {
    for (size_t e = 0; e < count_; ++e) f(ents_[e].key, ents_[e].b);
  }

 private:
  size_t home(const void* k) const {
    uint64_t x = (uint64_t)k;  // blocks are aligned: mix the high bits down
    x ^= x >> 29;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 32;
    return (size_t)x & (idx_cap_ - 1);
  }
  // the index slot of k; false: none
  bool locate(const void* k, size_t* at) const {
    if (count_ == 0) return false;
    for (size_t i = home(k);; i = (i + 1) & (idx_cap_ - 1)) {
      uint32_t v = idx_[i];
      if (v == 0) return false;
      if (ents_[v - 1].key == k) {
        *at = i;
        return true;
      }
    }
  }
  void index_put(const void* k, uint32_t v) {
    size_t i = home(k);
    while (idx_[i] != 0) i = (i + 1) & (idx_cap_ - 1);
    idx_[i] = v;
  }
  // linear probing's deletion by backward shift: a slot after the hole moves into it unless its
  // home lies in (hole, slot]
  void index_remove(size_t i) {
    size_t mask = idx_cap_ - 1;
    for (size_t j = (i + 1) & mask; idx_[j] != 0; j = (j + 1) & mask) {
      size_t h = home(ents_[idx_[j] - 1].key);
      if (((j - h) & mask) >= ((j - i) & mask)) {
        idx_[i] = idx_[j];
        i = j;
      }
    }
    idx_[i] = 0;
  }
  static void* map(size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    return p;  // zero-filled
  }
  void grow_entries() {
    size_t n = ent_cap_ == 0 ? 2048 : ent_cap_ * 2;
    Entry* e = static_cast<Entry*>(map(n * sizeof(Entry)));
    if (ents_ != nullptr) {
      std::memcpy(e, ents_, count_ * sizeof(Entry));
      munmap(ents_, ent_cap_ * sizeof(Entry));
    }
    ents_ = e;
    ent_cap_ = n;
  }
  void grow_index() {
    size_t old = idx_cap_, n = old == 0 ? 4096 : old * 2;
    if (idx_ != nullptr) munmap(idx_, old * sizeof(uint32_t));
    idx_ = static_cast<uint32_t*>(map(n * sizeof(uint32_t)));
    idx_cap_ = n;
    for (size_t e = 0; e < count_; ++e) index_put(ents_[e].key, (uint32_t)(e + 1));
  }
  Entry* ents_ = nullptr;
  size_t ent_cap_ = 0, count_ = 0;
  uint32_t* idx_ = nullptr;  // entry index + 1; 0: empty
  size_t idx_cap_ = 0;
};
LiveTable& live = *new LiveTable();
// op names. A dispatcher op's name and overload strings live in its schema for the process's
// life, so their pointers key a cache; the text map gives one index per name whatever the
// pointers (an op registered again after a library reload).
std::unordered_map<const char*, std::unordered_map<const char*, int32_t>>& op_index =
    *new std::unordered_map<const char*, std::unordered_map<const char*, int32_t>>();
std::unordered_map<std::string, int32_t>& op_index_by_text = *new std::unordered_map<std::string, int32_t>();
std::vector<std::string>& op_names = *new std::vector<std::string>();  // "torch._ops.aten.add.Tensor"
std::vector<PyObject*>& op_strs = *new std::vector<PyObject*>();  // Python names made so far
// per op index, from its schema: the argument positions it writes (alias info with a write), and
// whether it is a view (every return aliases an input, nothing written): no access rows then,
// as the dispatch-mode source does
struct OpInfo {
  uint64_t writes;
  bool is_view;
};
std::vector<OpInfo>& op_info = *new std::vector<OpInfo>();
// shapes of the ACCESS records' tensors; a record holds the absolute offset of its shape
// (shape_base + index), so draining the head keeps the offsets of the rest valid
std::vector<int64_t>& shapes = *new std::vector<int64_t>();
int64_t shape_base = 0;

std::atomic<bool> recording{false};   // ops tracked, allocation failures noted
// count: new blocks are counted (their MALLOC row is in the dump when emit_alloc); emit_free: a
// counted block's free is recorded as traced; free_untraced: otherwise it is recorded flagged.
bool count_new = false, emit_alloc = false, emit_free = false, free_untraced = false, emit_launch = false;
bool emit_access = false;  // ACCESS records (only when the callback was installed with inputs/outputs)
bool with_io = false;      // the installed callback asks for inputs and outputs
int py_depth = 0;          // Python frames per stack, 0: no stacks
// top-level ops whose OP_START was recorded and whose OP_END is not yet: thread -> op. Closed (an
// OP_END recorded now) when the source stops or hands over, so a dump never has an op left open.
// (a few threads: a small array, no allocation per op once it has room; under mu)
struct InFlight {
  std::vector<std::pair<uint64_t, int32_t>> v;
  InFlight() { v.reserve(64); }
  bool empty() const { return v.empty(); }
  void set(uint64_t t, int32_t op) {
    for (auto& e : v)
      if (e.first == t) {
        e.second = op;
        return;
      }
    v.emplace_back(t, op);
  }
  // thread t's op taken out; false: none
  bool take(uint64_t t) {
    for (size_t i = 0; i < v.size(); ++i)
      if (v[i].first == t) {
        v[i] = v.back();
        v.pop_back();
        return true;
      }
    return false;
  }
  void clear() { v.clear(); }
};
InFlight& in_flight = *new InFlight();
bool draining = false;                // one drain() at a time (building tuples may run Python)
// The session went over to the dispatch-mode source (watch, owner labels): this source only
// records the frees of the blocks it counted, and keeps the one bytes-in-use counter.
bool handed_over = false;
int64_t used_bytes = 0, peak_bytes = 0, next_aid = 0;
size_t drain_at = 1 << 16;            // records before the op exit asks Python to drain
PyObject* on_full = nullptr;          // Python callable: drain now
at::CallbackHandle handle = 0;
// c10 keeps an allocator set with a priority at least the current one's, and the priority is a
// uint8_t: the highest, every time, so that each install and restore takes. (A counter raised at
// each set wrapped to 0 after ~155 sets in a process, and from then on the wrapper was silently
// not installed: no allocation recorded, tests/test_native_source.py.)
constexpr uint8_t kAllocPriority = 255;

thread_local int nest = 0;         // RecordFunctions (FUNCTION scope) open on this thread
thread_local int top_nest = 0;     // the nesting level of the top-level op, 0 when none runs
thread_local int32_t top_op = -1;  // its name index
thread_local bool in_drain_call = false;
thread_local int32_t top_stack = -1;   // the running top-level op's Python stack
// owner labels: the user labels / framework component open on this thread (an id the Python
// labeler gives, 0: none); the blocks counted under one are listed for it (alloc id, tag)
thread_local int32_t owner_tag = 0;
std::vector<std::pair<int64_t, int32_t>>& tagged = *new std::vector<std::pair<int64_t, int32_t>>();
thread_local bool top_access = false;  // the running top-level op records accesses at its exit
thread_local int64_t top_first_aid = 0;  // allocation ids above this one were made by that op
// the accesses noted at the op's start (its inputs), emitted at its exit with its outputs'
struct Acc {
  uint64_t ptr;
  int64_t size;
  int64_t aid;
  bool write;
  int32_t extra;                // scalar type | ndim << 8
  size_t shape_at;              // offset in acc_shapes
};
thread_local std::vector<Acc> acc;
thread_local std::vector<int64_t> acc_shapes;

inline int64_t now_ns() {
  // the clock of Python's time.time_ns(): rows from both sources sort together
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch()).count();
}

inline uint64_t tid() { return (uint64_t)pthread_self(); }  // threading.get_ident()

std::string python_name(const std::string& name, const std::string& overload) {
  // "aten::add" + "Tensor" -> "torch._ops.aten.add.Tensor", the dispatch-mode source's name
  std::string n = name;
  auto sep = n.find("::");
  if (sep != std::string::npos) n.replace(sep, 2, ".");
  return "torch._ops." + n + "." + (overload.empty() ? "default" : overload);
}

OpInfo schema_info(const at::RecordFunction& fn) {
  // once per op (the schema is copied): which arguments it writes, and whether it is a view
  OpInfo info{0, false};
  auto schema = fn.operator_schema();
  if (!schema.has_value()) return info;
  const auto& args = schema->arguments();
  for (size_t i = 0; i < args.size() && i < 64; ++i) {
    const c10::AliasInfo* a = args[i].alias_info();
    if (a != nullptr && a->isWrite()) info.writes |= uint64_t(1) << i;
  }
  const auto& rets = schema->returns();
  bool all_alias = !rets.empty();
  for (const auto& r : rets) {
    const c10::AliasInfo* a = r.alias_info();
    if (a == nullptr || a->isWrite()) all_alias = false;
  }
  info.is_view = all_alias && info.writes == 0;
  return info;
}

int32_t add_name(std::string text) {
  int32_t i = (int32_t)op_names.size();
  op_names.push_back(std::move(text));
  return i;
}

// The name index of a dispatcher op, or -1 for a RecordFunction named by a string (the autograd
// engine's "evaluate_function: ...Backward0" wrappers and the like): those are not ops, and
// the ops they run count as top-level, as the dispatch-mode source sees them.
int32_t intern(const at::RecordFunction& fn) {
  const char* name = fn.name();
  const char* overload = fn.overload_name();
  auto hit = op_index.find(name);
  if (hit != op_index.end()) {
    auto it = hit->second.find(overload);
    if (it != hit->second.end()) return it->second;
  }
  if (!fn.operator_name().has_value()) return -1;  // a string name: nothing to copy or keep
  std::string text = python_name(name, overload ? overload : "");
  auto t = op_index_by_text.find(text);
  int32_t i;
  if (t != op_index_by_text.end()) {
    i = t->second;
  } else {
    i = op_index_by_text[text] = add_name(text);
    op_info.push_back(schema_info(fn));
  }
  op_index[name][overload] = i;  // schema-owned strings: stable pointers
  return i;
}

void maybe_ask_drain() {
  // At the end of a top-level op, outside the lock. Ops run with the GIL released, so it is
  // taken back here, but only on a thread that runs Python (it released the GIL around the op);
  // threads Python does not know (intra-op pools, the autograd engine's) leave it to the next.
  if (on_full == nullptr || in_drain_call || PyGILState_GetThisThreadState() == nullptr) return;
  {
    std::lock_guard<std::mutex> g(mu);
    if (recs.size() < drain_at) return;
  }
  in_drain_call = true;
  PyGILState_STATE gil = PyGILState_Ensure();
  if (on_full != nullptr) {  // uninstall() may have run while this thread waited for the GIL
    PyObject* r = PyObject_CallNoArgs(on_full);
    if (r == nullptr) PyErr_WriteUnraisable(on_full);
    Py_XDECREF(r);
  }
  PyGILState_Release(gil);
  in_drain_call = false;
}

// ---------------------------------------------------------------- Python stacks
// Touched only with the GIL held (capture and drain): no lock of ours is needed for them.
struct Frame {
  PyObject* code;  // strong reference: a (code, instruction) key never dangles
  int line;
  bool skip;       // the tracer's own frames (and torch's dispatch-mode glue) are left out
};
struct FrameKey {
  PyObject* code;
  int lasti;
  bool operator==(const FrameKey& o) const { return code == o.code && lasti == o.lasti; }
};
struct FrameKeyHash {
  size_t operator()(const FrameKey& k) const { return std::hash<void*>()(k.code) * 31 + (size_t)k.lasti; }
};
std::unordered_map<FrameKey, int32_t, FrameKeyHash>& frame_ids = *new std::unordered_map<FrameKey, int32_t, FrameKeyHash>();
std::vector<Frame>& frames = *new std::vector<Frame>();
std::vector<PyObject*>& frame_strs = *new std::vector<PyObject*>();   // "file:line(func)", made at drain
std::unordered_map<std::string, int32_t>& stack_ids = *new std::unordered_map<std::string, int32_t>();
std::vector<std::vector<int32_t>>& stack_frames = *new std::vector<std::vector<int32_t>>();
std::vector<PyObject*>& stack_strs = *new std::vector<PyObject*>();   // the row's text, made at drain
std::string& skip_prefix = *new std::string();  // the msmemscope package's folder
std::string& skip_suffix = *new std::string();  // torch/utils/_python_dispatch.py

int32_t frame_id(PyFrameObject* f) {
  PyCodeObject* code = PyFrame_GetCode(f);  // new reference
  FrameKey k{(PyObject*)code, PyFrame_GetLasti(f)};
  auto it = frame_ids.find(k);
  if (it != frame_ids.end()) {
    Py_DECREF(code);
    return it->second;
  }
  bool skip = false;
  const char* fn = PyUnicode_AsUTF8(code->co_filename);
  if (fn == nullptr) {
    PyErr_Clear();
  } else {
    std::string name(fn);
    skip = (!skip_prefix.empty() && name.compare(0, skip_prefix.size(), skip_prefix) == 0) ||
           (!skip_suffix.empty() && name.size() >= skip_suffix.size() &&
            name.compare(name.size() - skip_suffix.size(), skip_suffix.size(), skip_suffix) == 0);
  }
  int32_t id = (int32_t)frames.size();
  frames.push_back({(PyObject*)code, PyFrame_GetLineNumber(f), skip});  // keeps the reference
  frame_ids.emplace(k, id);
  return id;
}

// With the GIL: the interned stack of this thread's Python frames, innermost first.
int32_t walk_stack() {
  thread_local std::vector<int32_t> ids;
  ids.clear();
  PyFrameObject* f = PyEval_GetFrame();  // borrowed
  Py_XINCREF(f);
  while (f != nullptr && (int)ids.size() < py_depth) {
    int32_t id = frame_id(f);
    if (!frames[id].skip) ids.push_back(id);
    PyFrameObject* back = PyFrame_GetBack(f);  // new reference
    Py_DECREF(f);
    f = back;
  }
  Py_XDECREF(f);
  std::string key((const char*)ids.data(), ids.size() * sizeof(int32_t));
  auto it = stack_ids.find(key);
  if (it != stack_ids.end()) return it->second;
  int32_t sid = (int32_t)stack_frames.size();
  stack_frames.push_back(ids);
  stack_ids.emplace(std::move(key), sid);
  return sid;
}

// The Python stack of this thread now, or -1: only on a thread Python knows, never while the
// interpreter shuts down. Ops run with the GIL released, so it is taken back for the walk (the
// dispatch-mode source holds it for the whole op). Never called with our mutex held.
int32_t take_stack() {
  if (py_depth <= 0 || !Py_IsInitialized() || py_finalizing()) return -1;
  if (PyGILState_GetThisThreadState() == nullptr) return -1;  // intra-op pools, the autograd engine's
  if (PyGILState_Check()) return walk_stack();
  PyGILState_STATE g = PyGILState_Ensure();
  int32_t sid = walk_stack();
  PyGILState_Release(g);
  return sid;
}

PyObject* frame_str(int32_t id) {
  if ((size_t)id < frame_strs.size() && frame_strs[id] != nullptr) return frame_strs[id];
  if (frame_strs.size() <= (size_t)id) frame_strs.resize(id + 1, nullptr);
  PyCodeObject* c = (PyCodeObject*)frames[id].code;
  frame_strs[id] = PyUnicode_FromFormat("%U:%d(%U)", c->co_filename, frames[id].line, c->co_name);
  return frame_strs[id];
}

// "file:line(func);..." of an interned stack, made once (with the GIL)
PyObject* stack_str(int32_t sid) {
  if ((size_t)sid < stack_strs.size() && stack_strs[sid] != nullptr) return stack_strs[sid];
  const auto& ids = stack_frames[sid];
  PyObject* parts = PyList_New((Py_ssize_t)ids.size());
  if (parts == nullptr) return nullptr;
  for (size_t i = 0; i < ids.size(); ++i) {
    PyObject* t = frame_str(ids[i]);
    if (t == nullptr) {
      Py_DECREF(parts);
      return nullptr;
    }
    Py_INCREF(t);
    PyList_SET_ITEM(parts, (Py_ssize_t)i, t);
  }
  PyObject* sep = PyUnicode_FromString(";");
  PyObject* text = sep == nullptr ? nullptr : PyUnicode_Join(sep, parts);
  Py_XDECREF(sep);
  Py_DECREF(parts);
  if (text == nullptr) return nullptr;
  if (stack_strs.size() <= (size_t)sid) stack_strs.resize(sid + 1, nullptr);
  stack_strs[sid] = text;
  return text;
}

// ---------------------------------------------------------------- access events
// Under the lock: the block behind a tensor's storage, counted now if it was allocated outside
// the traced window (MALLOC origin before_op, as the dispatch-mode source registers it). Null for
// a tensor without a CPU storage of ours.
// A block enters the count: its allocation id, the bytes in use and its MALLOC record (at its
// allocation, or when a traced op first sees a block made before tracing). Under mu.
void count_block_locked(Block& b, const void* data, int32_t kind, int32_t op, int32_t stack) {
  b.counted = true;
  b.aid = ++next_aid;
  used_bytes += b.size;
  if (used_bytes > peak_bytes) peak_bytes = used_bytes;
  if (emit_alloc)
    recs.push_back({now_ns(), tid(), (uint64_t)data, b.size, used_bytes, b.aid, kind, op, stack, 0});
  if (owner_tag != 0) tagged.emplace_back(b.aid, owner_tag);
}

Block* block_of_locked(const at::Tensor& t, int32_t op, int32_t stack) {
  // a Python number made a tensor for the op (wrapped number) is an argument value, not memory the
  // program holds: the dispatch-mode source sees the number
  if (!t.defined() || !t.unsafeGetTensorImpl()->has_storage() || !t.device().is_cpu() ||
      t.unsafeGetTensorImpl()->is_wrapped_number())
    return nullptr;
  const void* data = t.storage().data();
  if (data == nullptr) return nullptr;
  Block* found = live.find(data);
  if (found == nullptr) return nullptr;
  Block& b = *found;
  if (!b.counted) {
    if (!count_new || b.size == 0) return nullptr;
    count_block_locked(b, data, MALLOC_BEFORE_OP, op, stack);
  }
  return &b;
}

void note_access(const at::Tensor& t, bool write, int32_t op, int32_t stack, bool only_new) {
  Block* b = block_of_locked(t, op, stack);
  if (b == nullptr || (only_new && b->aid <= top_first_aid)) return;
  auto sizes = t.sizes();
  size_t at = acc_shapes.size();
  acc_shapes.insert(acc_shapes.end(), sizes.begin(), sizes.end());
  const void* data = t.storage().data();
  acc.push_back({(uint64_t)data, b->size, b->aid, write, (int32_t)t.scalar_type() | ((int32_t)sizes.size() << 8), at});
}

// Under the lock: the tensors in op arguments or results (plain, lists, optional lists)
template <typename F>
void each_tensor(const c10::IValue& v, F f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isList()) {
    for (const c10::IValue& x : v.toListRef())
      if (x.isTensor()) f(x.toTensor());
  }
}

// Under the lock, at the op's exit: one ACCESS record per block (WRITE wins over READ; the
// first sight keeps its place), as the dispatch-mode source writes them
void emit_accesses_locked(uint64_t t, int32_t op) {
  if (acc.empty()) return;
  int64_t ts = now_ns();
  thread_local std::unordered_map<int64_t, size_t> seen;
  thread_local std::vector<size_t> order;
  seen.clear();
  order.clear();
  for (size_t i = 0; i < acc.size(); ++i) {
    auto it = seen.find(acc[i].aid);
    if (it == seen.end()) {
      seen.emplace(acc[i].aid, order.size());
      order.push_back(i);
    } else if (acc[i].write && !acc[order[it->second]].write) {
      order[it->second] = i;
    }
  }
  for (size_t i : order) {
    const Acc& a = acc[i];
    int ndim = a.extra >> 8;
    int64_t off = shape_base + (int64_t)shapes.size();
    shapes.insert(shapes.end(), acc_shapes.begin() + a.shape_at, acc_shapes.begin() + a.shape_at + ndim);
    recs.push_back({ts, t, a.ptr, a.size, off, a.aid, a.write ? ACCESS_WRITE : ACCESS_READ, op, -1, a.extra});
  }
  acc.clear();
  acc_shapes.clear();
}

// Under the lock, at a top-level op's start: its OP_START, and the inputs it reads or writes
void record_start_locked(const at::RecordFunction& fn, int32_t op) {
  uint64_t t = tid();
  if (emit_launch) {
    recs.push_back({now_ns(), t, 0, 0, 0, 0, OP_START, op, top_stack, 0});
    in_flight.set(t, op);
  }
  if (emit_access && with_io && !op_info[op].is_view) {
    top_access = true;
    top_first_aid = next_aid;
    acc.clear();
    acc_shapes.clear();
    uint64_t writes = op_info[op].writes;
    auto in = fn.inputs();
    for (size_t i = 0; i < in.size(); ++i) {
      bool w = i < 64 && ((writes >> i) & 1);
      each_tensor(in[i], [&](const at::Tensor& x) { note_access(x, w, op, top_stack, false); });
    }
  }
}

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  ++nest;
  if (top_nest != 0 || !recording.load(std::memory_order_relaxed)) return nullptr;  // inside an op
  int32_t op;
  bool stacks;
  {
    std::lock_guard<std::mutex> g(mu);
    op = intern(fn);
    if (op < 0) return nullptr;
    top_nest = nest;
    top_op = op;
    top_stack = -1;
    top_access = false;
    stacks = py_depth > 0 && (emit_launch || emit_alloc);
    if (!stacks) record_start_locked(fn, op);
  }
  if (stacks) {
    // the stack is taken with the GIL, outside the lock (the drain takes the GIL, then the lock)
    int32_t sid = take_stack();
    std::lock_guard<std::mutex> g(mu);
    top_stack = sid;
    record_start_locked(fn, op);
  }
  return nullptr;
}

void on_exit(const at::RecordFunction& fn, at::ObserverContext*) {
  if (nest-- != top_nest) return;
  int32_t op = top_op;
  top_nest = 0;
  top_op = -1;
  top_stack = -1;
  bool ask = false;
  {
    std::lock_guard<std::mutex> g(mu);
    uint64_t t = tid();
    if (top_access) {
      top_access = false;
      if (recording.load(std::memory_order_relaxed) && emit_access) {
        // the outputs the op allocated were written by it (outputs it was given were inputs)
        for (const c10::IValue& v : fn.outputs())
          each_tensor(v, [&](const at::Tensor& x) { note_access(x, true, op, -1, true); });
        emit_accesses_locked(t, op);
      }
      acc.clear();
      acc_shapes.clear();
    }
    // the OP_END of an op whose OP_START is recorded, whatever the flags are now (a step
    // boundary on another thread); none when stop()/handover() closed it already
    if (!in_flight.empty() && in_flight.take(t)) recs.push_back({now_ns(), t, 0, 0, 0, 0, OP_END, op, -1, 0});
    ask = recs.size() >= drain_at;
  }
  if (ask) maybe_ask_drain();
}

void traced_delete(void* data) {
  Block b;
  {
    std::lock_guard<std::mutex> g(mu);
    if (!live.take(data, &b)) return;  // not ours: nothing we may call
    if (b.counted) {
      used_bytes -= b.size;
      if (emit_free)
        recs.push_back({now_ns(), tid(), (uint64_t)data, b.size, used_bytes, b.aid, FREE, top_op, -1, 0});
      else if (free_untraced)
        recs.push_back({now_ns(), tid(), (uint64_t)data, b.size, used_bytes, b.aid, FREE_UNTRACED, -1, -1, 0});
    }
  }
  b.deleter(b.ctx);
}

struct TracingAllocator final : c10::Allocator {
  c10::Allocator* inner = nullptr;

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr d;
    try {
      d = inner->allocate(n);
    } catch (...) {
      // an allocation failure: noted (the session writes an OOM snapshot there), then raised
      std::lock_guard<std::mutex> g(mu);
      if (recording.load(std::memory_order_relaxed))
        recs.push_back({now_ns(), tid(), 0, (int64_t)n, used_bytes, peak_bytes, ALLOC_FAILED, top_op, -1, 0});
      throw;
    }
    void* data = d.get();
    if (data == nullptr || d.get_deleter() == nullptr) return d;
    c10::Device dev = d.device();
    Block b{d.get_context(), d.get_deleter(), (int64_t)n, 0, false};
    d.release_context();
    // the op's stack; outside any op, this thread's own when it holds the GIL (a tensor made by
    // C code called from Python), never waiting for the GIL inside the allocator
    int32_t stack = top_stack;
    if (stack < 0 && top_nest == 0 && py_depth > 0 && count_new && !py_finalizing() &&
        PyGILState_GetThisThreadState() != nullptr && PyGILState_Check())
      stack = walk_stack();
    {
      std::lock_guard<std::mutex> g(mu);
      if (count_new) count_block_locked(b, data, MALLOC, top_op, stack);
      live.put(data, b);
    }
    return c10::DataPtr(data, data, &traced_delete, dev);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &traced_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

TracingAllocator& tracing_allocator = *new TracingAllocator();

PyObject* op_str(int32_t i) {
  // with the GIL (op_strs is only touched here); op_names grows under the lock
  if ((size_t)i < op_strs.size() && op_strs[i] != nullptr) return op_strs[i];
  std::string text;
  {
    std::lock_guard<std::mutex> g(mu);
    text = op_names[i];
  }
  if (op_strs.size() <= (size_t)i) op_strs.resize(i + 1, nullptr);
  op_strs[i] = PyUnicode_InternFromString(text.c_str());
  return op_strs[i];
}

// fork: the forking thread takes the lock first, so no other thread holds it (mid-update) in
// the child's copy; both sides release it after. The child records nothing (it is not traced).
void before_fork() { mu.lock(); }
void after_fork_parent() { mu.unlock(); }
void after_fork_child() {
  recording = false;
  count_new = emit_alloc = emit_free = free_untraced = emit_launch = emit_access = false;
  py_depth = 0;
  recs.clear();
  drained.clear();
  draining = false;
  ++recs_epoch;
  shape_base += (int64_t)shapes.size();
  shapes.clear();
  in_flight.clear();
  mu.unlock();
}

// Under the lock: an OP_END now for every top-level op whose OP_START was recorded.
void close_in_flight_locked() {
  int64_t t = now_ns();
  for (auto& kv : in_flight.v) recs.push_back({t, kv.first, 0, 0, 0, 0, OP_END, kv.second, -1, 0});
  in_flight.clear();
}

// Under the lock: nothing new is recorded (ops, blocks); frees of counted blocks still are,
// flagged per the flags the session gives.
void stop_recording_locked() {
  recording = false;
  count_new = false;
  emit_alloc = false;
  emit_launch = false;
  emit_access = false;
  close_in_flight_locked();
}

// keep_allocator: the op callback goes, the allocator wrapper stays (a stop/start gap: the blocks
// made in it enter the side table uncounted, so that a traced op's first read counts them after
// start(), as the dispatch-mode source does by their storages)
void detach(bool keep_allocator = false) {
  // blocks allocated through the wrapper keep its deleter: the wrapper and the side table stay
  Py_XDECREF(on_full);  // called with the GIL (from Python)
  on_full = nullptr;
  if (handle != 0) {
    at::removeCallback(handle);
    handle = 0;
  }
  if (!keep_allocator && c10::GetCPUAllocator() == &tracing_allocator)
    c10::SetCPUAllocator(tracing_allocator.inner, kAllocPriority);
}

}  // namespace

// Records before the op exit asks for a drain, less the rows the session still holds: after a
// flush that wrote only part of its buffer (a held step 1), so that the buffer stays bounded.
void set_drain_at(int64_t rows) {
  std::lock_guard<std::mutex> g(mu);
  drain_at = (size_t)std::max<int64_t>(1, rows);
}

// access: the callback asks for each op's inputs and outputs (access events; boxing them costs
// every op, so only then); depth: Python frames per stack (0: none); skip_prefix / skip_suffix:
// frames of files under the tracer's folder, or ending so, are left out of stacks.
void install(int64_t drain_rows, py::object full_callback, bool access, int depth, std::string prefix,
             std::string suffix) {
  drain_at = (size_t)drain_rows;
  Py_XDECREF(on_full);
  on_full = full_callback.is_none() ? nullptr : full_callback.release().ptr();
  skip_prefix = std::move(prefix);  // with the GIL: the stack tables' guard
  skip_suffix = std::move(suffix);
  if (tracing_allocator.inner == nullptr) {
    tracing_allocator.inner = c10::GetCPUAllocator();
    pthread_atfork(&before_fork, &after_fork_parent, &after_fork_child);
  }
  if (c10::GetCPUAllocator() != &tracing_allocator)
    c10::SetCPUAllocator(&tracing_allocator, kAllocPriority);
  if (handle != 0 && with_io != access) {
    at::removeCallback(handle);
    handle = 0;
  }
  {
    std::lock_guard<std::mutex> g(mu);
    with_io = access;
    py_depth = depth;
  }
  if (handle == 0)
    handle = at::addGlobalCallback(
        at::RecordFunctionCallback(on_enter, on_exit).needsInputs(access).needsOutputs(access)
            .needsIds(false).scopes({at::RecordScope::FUNCTION}));
}

// rec: ops tracked; count: new blocks counted; alloc: their MALLOC recorded; free_: frees recorded
// as traced; free_later: frees of counted blocks recorded flagged when not as traced; launch: ops;
// access: ACCESS records.
void set_flags(bool rec, bool count, bool alloc, bool free_, bool free_later, bool launch, bool access) {
  std::lock_guard<std::mutex> g(mu);
  bool on = !handed_over;
  recording = rec && on;
  count_new = count && on;
  emit_alloc = alloc && on;
  emit_free = free_;
  free_untraced = free_later;
  emit_launch = launch && on;
  emit_access = access && on;  // recorded where the installed callback sees inputs (with_io)
}

// stop(): one critical section ends recording (closing the ops in flight), then the hooks go.
void uninstall(bool keep_allocator) {
  {
    std::lock_guard<std::mutex> g(mu);
    stop_recording_locked();
  }
  detach(keep_allocator);
}

PyObject* dtype_strs[256] = {nullptr};  // "float32", as str(torch.float32) less "torch."

// The dtype's name, made once (nullptr on no memory). With the GIL.
PyObject* dtype_str(int st) {
  if (dtype_strs[st] == nullptr) {
    auto n = c10::getDtypeNames((at::ScalarType)st).first;
    dtype_strs[st] = PyUnicode_FromStringAndSize(n.data(), (Py_ssize_t)n.size());
  }
  return dtype_strs[st];
}

// ---------------------------------------------------------------- the rows as marshal bytes (issue 22d)
// The hand-off to the dump's writer process (io/spool.py) sends each batch marshalled; the rows a
// drain makes are written here, from the records, as the bytes marshal.dumps(list_of_rows, 2) would
// give (no back-references: a piece loads on its own), so the traced process does not marshal
// them again item by item. marshal.loads of these bytes equals the row tuples the drain appends
// (tests/test_handoff.py). Little-endian, as marshal's own format.
struct Marshal {
  // written straight into a bytes object, cut to length at the end (take()): no copy of a
  // flush's megabyte into a new one (GPT-2: 0.15 M instructions a step). With the GIL.
  PyObject* obj = nullptr;
  char* data = nullptr;
  size_t len = 0, cap = 0;
  bool ok = true;
  ~Marshal() { Py_XDECREF(obj); }
  // room for n more bytes; false (and ok = false) when memory runs out
  inline bool room(size_t n) { return len + n <= cap || grow(n); }
  __attribute__((noinline)) bool grow(size_t n) {
    size_t want = std::max(cap * 2, len + n + 4096);
    if (obj == nullptr) {
      obj = PyBytes_FromStringAndSize(nullptr, (Py_ssize_t)want);
    } else if (_PyBytes_Resize(&obj, (Py_ssize_t)want) != 0) {
      obj = nullptr;  // (the resize freed it)
    }
    if (obj == nullptr) {
      PyErr_Clear();
      data = nullptr;
      len = cap = 0;
      return ok = false;
    }
    data = PyBytes_AS_STRING(obj);
    cap = want;
    return true;
  }
  // the bytes written (a new reference), or nullptr with ok false
  PyObject* take() {
    if (!ok) return nullptr;
    if (obj == nullptr && !room(1)) return nullptr;
    if (_PyBytes_Resize(&obj, (Py_ssize_t)len) != 0) {
      obj = nullptr;
      PyErr_Clear();
      return nullptr;
    }
    PyObject* out = obj;
    obj = nullptr;
    data = nullptr;
    len = cap = 0;
    return out;
  }
  void byte(char c) {
    if (room(1)) data[len++] = c;
  }
  inline void put_i32(char* p, int32_t v) {
    uint32_t u = (uint32_t)v;
    p[0] = (char)(u & 0xff);
    p[1] = (char)((u >> 8) & 0xff);
    p[2] = (char)((u >> 16) & 0xff);
    p[3] = (char)(u >> 24);
  }
  void i32(int32_t v) {
    if (!room(4)) return;
    put_i32(data + len, v);
    len += 4;
  }
  void integer(unsigned long long mag, bool neg) {
    if (!room(16)) return;
    char* p = data + len;
    if ((!neg && mag <= 0x7fffffffULL) || (neg && mag <= 0x80000000ULL)) {
      p[0] = 'i';
      put_i32(p + 1, neg ? (int32_t)(-(long long)mag) : (int32_t)mag);
      len += 5;
      return;
    }
    // TYPE_LONG: the digit count (negative for a negative number), then 15-bit digits, low first
    int n = 0;
    char* d = p + 5;
    while (mag != 0) {
      unsigned v = (unsigned)(mag & 0x7fff);
      d[2 * n] = (char)(v & 0xff);
      d[2 * n + 1] = (char)(v >> 8);
      ++n;
      mag >>= 15;
    }
    p[0] = 'l';
    put_i32(p + 1, neg ? -n : n);
    len += 5 + 2 * (size_t)n;
  }
  void i64(long long v) { v < 0 ? integer((unsigned long long)(-(v + 1)) + 1, true) : integer((unsigned long long)v, false); }
  void u64(unsigned long long v) { integer(v, false); }
  void none() { byte('N'); }
  void raw(const char* s, size_t n) {
    if (!room(n)) return;
    std::memcpy(data + len, s, n);
    len += n;
  }
  // A string met again is written as a reference to its first writing (marshal's TYPE_REF): the
  // rows repeat a few names (event, pool, op, device, owner, module) thousands of times. A small
  // table by address; a string whose slot another took is written again, with a new reference.
  struct RefSlot {
    PyObject* o;
    int32_t idx;
  };
  RefSlot refs[512] = {};
  int32_t nrefs = 0;
  void str(PyObject* o) {
    RefSlot& slot = refs[((uintptr_t)o >> 4) & 511];
    if (o != nullptr && slot.o == o) {
      if (!room(5)) return;
      data[len++] = 'r';
      put_i32(data + len, slot.idx);
      len += 4;
      return;
    }
    Py_ssize_t n = 0;
    const char* u = o == nullptr ? nullptr : PyUnicode_AsUTF8AndSize(o, &n);
    if (u == nullptr) {  // not UTF-8 encodable (a lone surrogate in a path): no bytes for this batch
      PyErr_Clear();
      ok = false;
      return;
    }
    if (!room((size_t)n + 5)) return;
    slot.o = o;
    slot.idx = nrefs++;
    if (PyUnicode_IS_ASCII(o) && n < 256) {
      data[len++] = (char)('z' | 0x80);  // FLAG_REF: the loader keeps it for the references
      data[len++] = (char)(unsigned char)n;
    } else {
      data[len++] = (char)('u' | 0x80);
      put_i32(data + len, (int32_t)n);
      len += 4;
    }
    std::memcpy(data + len, u, (size_t)n);
    len += (size_t)n;
  }
  void small_tuple(int n) {
    if (!room(2)) return;
    data[len++] = ')';
    data[len++] = (char)(unsigned char)n;
  }
};

// Rows and their attrs hold only ints, strings, None and such tuples: no cycle can go through them.
// The collector would find that out itself (it untracks such tuples when it first walks them), but
// only after walking them: a drain of thousands of rows, held in the buffer until the flush, made
// every collection that came before the flush walk all of them (GPT-2, access events: ~0.5 ms a
// step, and the collections of the older generations it brings on). Untracked when made instead.
inline void untrack_if_atomic(PyObject* t) {
  if (t == nullptr || !PyTuple_CheckExact(t) || !PyObject_GC_IsTracked(t)) return;
  for (Py_ssize_t j = 0, n = PyTuple_GET_SIZE(t); j < n; ++j) {
    PyObject* x = PyTuple_GET_ITEM(t, j);
    if (PyObject_IS_GC(x) && PyObject_GC_IsTracked(x)) return;
  }
  PyObject_GC_UnTrack(t);
}

// The names drain() is given (see there), by role.
struct RowNames {
  PyObject *ev_launch, *ev_start, *ev_end, *ev_malloc, *ev_free, *pool, *device, *na, *ev_failed, *untraced_key,
      *ev_access, *acc_read, *acc_write, *origin_key, *before_op, *ev_system, *sys_step, *step_key;
  explicit RowNames(const py::tuple& n)
      : ev_launch(n[0].ptr()), ev_start(n[1].ptr()), ev_end(n[2].ptr()), ev_malloc(n[3].ptr()), ev_free(n[4].ptr()),
        pool(n[5].ptr()), device(n[6].ptr()), na(n[7].ptr()), ev_failed(n[8].ptr()), untraced_key(n[9].ptr()),
        ev_access(n[10].ptr()), acc_read(n[11].ptr()), acc_write(n[12].ptr()), origin_key(n[13].ptr()),
        before_op(n[14].ptr()), ev_system(n[15].ptr()), sys_step(n[16].ptr()), step_key(n[17].ptr()) {
    if (n.size() < 18) throw py::value_error("names: 18 items");
  }
};

// One thread's module marks as a flush's spec gives them (capture/modules.py ModuleTracker.spec):
// marks[tid] = ([times], [states]), base[tid] = its state before the first (a state: (module,
// phase), or None). `at(ts)`: the state at a time (borrowed; the base before the first mark, and
// where the thread has no marks). Read by label_batch and fold::attribute.
struct ThreadMarks {
  std::vector<int64_t> ts;
  PyObject* states = nullptr;  // borrowed: the list in the marks
  PyObject* base = nullptr;    // borrowed or nullptr
  ThreadMarks(PyObject* m, PyObject* base_) : base(base_) {
    if (m == nullptr || !PyTuple_Check(m) || PyTuple_GET_SIZE(m) < 2) return;
    PyObject* tl = PyTuple_GET_ITEM(m, 0);
    states = PyTuple_GET_ITEM(m, 1);
    if (!PyList_Check(tl) || !PyList_Check(states)) throw std::invalid_argument("marks: (list, list)");
    Py_ssize_t k = PyList_GET_SIZE(tl);
    ts.reserve((size_t)k);
    for (Py_ssize_t j = 0; j < k; ++j) {
      int64_t v = PyLong_AsLongLong(PyList_GET_ITEM(tl, j));
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      ts.push_back(v);
    }
  }
  PyObject* at(int64_t t) const {
    if (states == nullptr) return base;
    size_t j = (size_t)(std::upper_bound(ts.begin(), ts.end(), t) - ts.begin());
    if (j == 0 || j > (size_t)PyList_GET_SIZE(states)) return base;
    return PyList_GET_ITEM(states, (Py_ssize_t)j - 1);
  }
};

// Owner labels and module attribution given to a batch's MALLOC records before any row is made of
// them: the row passes of capture/owners.py NativeLabeler.before_flush (``relabel_mallocs``) and of
// capture/modules.py ModuleTracker.attribute (fold ``attribute``), on the records instead of on row
// tuples, so the tuples and the marshal bytes are made once, labelled (the hand-off then sends the
// bytes as they are). Per record index: the owner text (nullptr: the empty one), the module and
// phase (module nullptr: none). Borrowed, kept alive by the dicts they come from or by `keep`.
struct BatchLabels {
  std::vector<PyObject*> owner, module, phase;
  py::list keep;
  Py_ssize_t attributed = 0;  // records given a module
  PyObject* owner_of(size_t i, PyObject* empty) const { return owner.empty() || owner[i] == nullptr ? empty : owner[i]; }
  PyObject* module_of(size_t i) const { return module.empty() ? nullptr : module[i]; }
};

// `spec` = (owners, modules, in_buf). owners: None or (owner, info, cats, plain, prev_upto, owner_of),
// the labeller's: a block's label is owner[aid]; not there, and made after prev_upto: plain, unless
// info or cats know it (then owner_of(aid), a Python call); made up to prev_upto: none (its row
// keeps the empty label, as the row pass leaves a row it labelled at an earlier flush). Every id
// labelled goes into in_buf (None: the labeller has no use for them, no label having changed). modules: None or (marks, base, owned, cats), the module tracker's:
// the thread's state at the record's time (marks: tid -> (times, states), base: tid -> state before
// them; a state is (module, phase)), the owning module (owned[aid]) winning; a MALLOC without owner
// label whose owning module is known gets "<pool>@<category>" (cats[aid]).
void label_batch(const std::vector<Rec>& batch, const py::tuple& spec, const RowNames& nm, BatchLabels& lb) {
  if (spec.size() < 3) throw py::value_error("labels: (owners, modules, in_buf)");
  py::object owners = spec[0], mods = spec[1];
  PyObject* in_buf = spec[2].ptr();
  if (in_buf == Py_None) in_buf = nullptr;
  else if (!PySet_Check(in_buf)) throw py::type_error("labels: in_buf is a set or None");
  const bool do_own = !owners.is_none(), do_mod = !mods.is_none();
  PyObject *owner_d = nullptr, *info_d = nullptr, *cats_d = nullptr, *plain = nullptr, *owner_fn = nullptr;
  int64_t prev_upto = 0;
  PyObject *marks_d = nullptr, *base_d = nullptr, *owned_d = nullptr, *mcats_d = nullptr;
  py::tuple ow, md;
  if (do_own) {
    ow = owners.cast<py::tuple>();
    if (ow.size() < 6) throw py::value_error("owners: 6 items");
    owner_d = ow[0].ptr(); info_d = ow[1].ptr(); cats_d = ow[2].ptr(); plain = ow[3].ptr();
    prev_upto = ow[4].cast<int64_t>();
    owner_fn = ow[5].ptr();
    if (!PyDict_Check(owner_d) || !PyDict_Check(info_d) || !PyDict_Check(cats_d)) throw py::type_error("owners: dicts");
    lb.owner.assign(batch.size(), nullptr);
  }
  if (do_mod) {
    md = mods.cast<py::tuple>();
    if (md.size() < 4) throw py::value_error("modules: 4 items");
    marks_d = md[0].ptr(); base_d = md[1].ptr(); owned_d = md[2].ptr(); mcats_d = md[3].ptr();
    if (!PyDict_Check(marks_d) || !PyDict_Check(base_d) || !PyDict_Check(owned_d) || !PyDict_Check(mcats_d))
      throw py::type_error("modules: dicts");
    lb.module.assign(batch.size(), nullptr);
    lb.phase.assign(batch.size(), nullptr);
  }
  if (!do_own && !do_mod) return;
  std::unordered_map<uint64_t, ThreadMarks> threads;
  uint64_t last_tid = 0;
  const ThreadMarks* last = nullptr;  // the marks of the thread of the record before (most are one thread's)
  auto state_at = [&](uint64_t tid, int64_t ts) -> PyObject* {  // borrowed; nullptr: none
    if (last != nullptr && tid == last_tid) {
      PyObject* st = last->at(ts);
      return st == Py_None ? nullptr : st;
    }
    auto it = threads.find(tid);
    if (it == threads.end()) {
      py::object key = py::reinterpret_steal<py::object>(PyLong_FromUnsignedLongLong(tid));
      if (!key) throw py::error_already_set();
      PyObject* m = PyDict_GetItemWithError(marks_d, key.ptr());
      if (m == nullptr && PyErr_Occurred()) throw py::error_already_set();
      PyObject* b = PyDict_GetItemWithError(base_d, key.ptr());
      if (b == nullptr && PyErr_Occurred()) throw py::error_already_set();
      it = threads.emplace(tid, ThreadMarks(m, b)).first;
    }
    last_tid = tid;
    last = &it->second;  // (an unordered_map's elements stay where they are as it grows)
    PyObject* st = it->second.at(ts);
    return st == Py_None ? nullptr : st;
  };
  for (size_t i = 0; i < batch.size(); ++i) {
    const Rec& r = batch[i];
    if (r.kind != MALLOC && r.kind != MALLOC_BEFORE_OP) continue;
    py::object aid = py::reinterpret_steal<py::object>(PyLong_FromLongLong(r.aid));
    if (!aid) throw py::error_already_set();
    PyObject* label = nullptr;
    if (do_own) {
      label = PyDict_GetItemWithError(owner_d, aid.ptr());
      if (label == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        if (r.aid > prev_upto) {
          int known = PyDict_GET_SIZE(info_d) ? PyDict_Contains(info_d, aid.ptr()) : 0;
          if (known == 0 && PyDict_GET_SIZE(cats_d)) known = PyDict_Contains(cats_d, aid.ptr());
          if (known < 0) throw py::error_already_set();
          if (known) {
            py::object o = py::reinterpret_borrow<py::object>(owner_fn)(aid);
            lb.keep.append(o);
            label = o.ptr();
          } else {
            label = plain;
          }
        }
      }
      if (label != nullptr) {
        if (in_buf != nullptr && PySet_Add(in_buf, aid.ptr()) != 0) throw py::error_already_set();
        lb.owner[i] = label;
      }
    }
    if (do_mod) {
      PyObject* state = state_at(r.tid, r.ts);
      PyObject* own = PyDict_GET_SIZE(owned_d) ? PyDict_GetItemWithError(owned_d, aid.ptr()) : nullptr;
      if (own == nullptr && PyErr_Occurred()) throw py::error_already_set();
      if (own == Py_None) own = nullptr;
      if (state == nullptr && own == nullptr) continue;
      if (state != nullptr && (!PyTuple_Check(state) || PyTuple_GET_SIZE(state) < 2))
        throw std::invalid_argument("a module state is (module, phase)");
      lb.module[i] = own != nullptr ? own : PyTuple_GET_ITEM(state, 0);
      lb.phase[i] = state != nullptr ? PyTuple_GET_ITEM(state, 1) : Py_None;
      ++lb.attributed;
      if (r.kind == MALLOC && own != nullptr) {
        int has = label == nullptr ? 0 : PyObject_IsTrue(label);
        if (has < 0) throw py::error_already_set();
        if (!has) {
          PyObject* cat = PyDict_GetItemWithError(mcats_d, aid.ptr());
          if (cat == nullptr && PyErr_Occurred()) throw py::error_already_set();
          if (cat != nullptr) {
            py::object o = py::reinterpret_steal<py::object>(PyUnicode_FromFormat("%S@%S", nm.pool, cat));
            if (!o) throw py::error_already_set();
            lb.keep.append(o);
            if (lb.owner.empty()) lb.owner.assign(batch.size(), nullptr);
            lb.owner[i] = o.ptr();
          }
        }
      }
    }
  }
}

// The batch's rows as marshal bytes, as drain() makes them into tuples (a failed-allocation marker
// has no bytes: the caller makes none for a batch with one); None when a text is not UTF-8
// encodable. With the GIL.
py::object marshal_rows(const std::vector<Rec>& batch, const RowNames& nm, PyObject* empty,
                        const std::vector<int64_t>& batch_shapes, int64_t batch_shape_base,
                        const BatchLabels* lb = nullptr) {
  // the same rows as marshal bytes, from the same records and string objects (see Marshal)
  Marshal m;
  m.room(batch.size() * 96 + 16);
  m.byte('[');
  m.i32((int32_t)batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const Rec& r = batch[i];
    PyObject* name = r.op >= 0 ? op_str(r.op) : nm.na;
    PyObject* stack = nullptr;
    if ((r.kind == OP_START || r.kind == MALLOC || r.kind == MALLOC_BEFORE_OP) && r.stack >= 0)
      stack = stack_str(r.stack);
    m.small_tuple(10);
    bool launch = r.kind == OP_START || r.kind == OP_END;
    bool access = r.kind == ACCESS_READ || r.kind == ACCESS_WRITE;
    bool step = r.kind == STEP_END;
    m.str(step ? nm.ev_system : launch ? nm.ev_launch : access ? nm.ev_access : (r.kind == MALLOC || r.kind == MALLOC_BEFORE_OP) ? nm.ev_malloc : nm.ev_free);
    m.str(step ? nm.sys_step : launch ? (r.kind == OP_START ? nm.ev_start : nm.ev_end) : access ? (r.kind == ACCESS_WRITE ? nm.acc_write : nm.acc_read) : nm.pool);
    m.str(name);
    m.i64(r.ts);
    m.u64(r.tid);
    m.str(nm.device);
    if (launch) {
      m.none();
      m.none();
    } else if (step) {  // no address; Attr {"step": the step that ended}
      m.none();
      m.byte('{');
      m.str(nm.step_key);
      m.i64(r.aid);
      m.byte('0');
    } else if (access) {
      m.u64(r.ptr);
      int st = r.extra & 0xff, ndim = r.extra >> 8;
      size_t at = (size_t)(r.used - batch_shape_base);
      m.small_tuple(4);
      m.str(dtype_strs[st]);
      m.small_tuple(ndim);
      for (int k = 0; k < ndim; ++k) m.i64(batch_shapes[at + k]);
      m.i64(r.size);
      m.i64(r.aid);
    } else if (r.kind == FREE_UNTRACED || r.kind == MALLOC_BEFORE_OP) {
      m.u64(r.ptr);
      m.byte('{');
      const char* keys[5] = {"allocation_id", "addr", "size", "used", "total"};
      for (int k = 0; k < 5; ++k) {
        m.byte('z');
        m.byte((char)strlen(keys[k]));
        m.raw(keys[k], strlen(keys[k]));
        if (k == 0) m.i64(r.aid);
        else if (k == 1) m.u64(r.ptr);
        else if (k == 2) m.i64(r.size);
        else m.i64(r.used);
      }
      if (r.kind == MALLOC_BEFORE_OP) {
        m.byte('z');
        m.byte((char)5);
        m.raw("owner", 5);
        m.str(lb != nullptr ? lb->owner_of(i, empty) : empty);
        m.str(nm.origin_key);
        m.str(nm.before_op);
        PyObject* mod = lb != nullptr ? lb->module_of(i) : nullptr;
        if (mod != nullptr) {  // after the others, as the module tracker adds them to a dict attr
          m.byte('z');
          m.byte((char)6);
          m.raw("module", 6);
          m.str(mod);
          if (lb->phase[i] != Py_None) {
            m.byte('z');
            m.byte((char)5);
            m.raw("phase", 5);
            m.str(lb->phase[i]);
          }
        }
      } else {
        m.str(nm.untraced_key);
        m.byte('T');
      }
      m.byte('0');
    } else {
      m.u64(r.ptr);
      PyObject* mod = r.kind == MALLOC && lb != nullptr ? lb->module_of(i) : nullptr;
      m.small_tuple(r.kind == MALLOC ? (mod != nullptr ? 8 : 6) : 5);
      m.i64(r.aid);
      m.u64(r.ptr);
      m.i64(r.size);
      m.i64(r.used);
      m.i64(r.used);
      if (r.kind == MALLOC) m.str(lb != nullptr ? lb->owner_of(i, empty) : empty);
      if (mod != nullptr) {  // (alloc_id, addr, size, used, total, owner, module, phase)
        m.str(mod);
        if (lb->phase[i] == Py_None) m.none();
        else m.str(lb->phase[i]);
      }
    }
    if (stack != nullptr) m.str(stack);
    else m.none();
    m.none();
    if (!m.ok) break;
  }
  PyObject* b = m.take();
  if (b == nullptr) return py::none();  // no memory: the records go back for drain()
  return py::reinterpret_steal<py::object>(b);

}

// The collector paused while a drain makes objects: a collection would walk them, and the
// finalizers it runs could let another thread in (which would find the drain in progress).
struct GcPause {
#if PY_VERSION_HEX >= 0x030A0000
  bool was;
  GcPause() : was(PyGC_Disable() != 0) {}
  ~GcPause() {
    if (was) PyGC_Enable();
  }
#endif
};

// A drain's way out (drain, take_packed): the records back at the head of `recs` unless used, the
// drain flag cleared
struct DrainDone {
  uint64_t epoch;
  bool used = false;
  // every row made: the records go (those appended meanwhile stay), and the shapes their ACCESS
  // records used (the first ``shapes_used`` of ``shapes``)
  void taken(size_t shapes_used) {
    std::lock_guard<std::mutex> g(mu);
    used = true;
    if (shapes_used > 0 && epoch == recs_epoch) {
      shapes.erase(shapes.begin(), shapes.begin() + shapes_used);
      shape_base += (int64_t)shapes_used;
    }
  }
  ~DrainDone() {
    std::lock_guard<std::mutex> g(mu);
    if (!used && epoch == recs_epoch) recs.insert(recs.begin(), drained.begin(), drained.end());
    drained.clear();
    draining = false;
  }
};

// Returns (rows appended, failed-allocation markers among them).
// Append the recorded rows to `out` as the Python source's row tuples:
// (event, event_type, name, ts, tid, device, ptr, attr, py_stack, c_stack).
// `names` = (OP_LAUNCH, ATEN_START, ATEN_END, MALLOC, FREE, PTA, "cpu", "N/A", marker of a failed
// allocation).
// `labels` (None, or the spec of label_batch): the MALLOC rows made with their owner labels and
// modules; returns then two more items: the number of rows given a module, and the last allocation
// id when the records were taken (every block up to it has its MALLOC row in this drain or before).
py::tuple drain(py::list out, py::tuple names, bool want_bytes, py::object labels) {
  // The records are taken out, made into tuples, and only then dropped: a tuple that cannot be
  // made (no memory) raises with every record put back for the next drain. Records added while
  // the tuples are built (frees on other threads) go to `recs` and stay after the taken ones.
  int64_t failed = 0;
  std::vector<Rec>& batch = drained;
  std::vector<int64_t> batch_shapes;
  int64_t batch_shape_base;
  uint64_t epoch;
  int64_t last_aid;
  {
    std::lock_guard<std::mutex> g(mu);
    last_aid = next_aid;
    if (draining || recs.empty()) {
      if (!labels.is_none()) return py::make_tuple((int64_t)0, (int64_t)0, py::none(), (int64_t)0, last_aid);
      return py::make_tuple((int64_t)0, (int64_t)0, py::none());
    }
    draining = true;
    batch.clear();
    batch.swap(recs);
    epoch = recs_epoch;
    batch_shapes.assign(shapes.begin(), shapes.end());
    batch_shape_base = shape_base;
  }
  DrainDone done{epoch};
  const size_t nrec = batch.size();
  RowNames nm(names);
  BatchLabels lb;
  const bool labelled = !labels.is_none();
  if (labelled) label_batch(batch, labels.cast<py::tuple>(), nm, lb);  // (may call Python: before the pause)
  // the tuples, appended to `out` once all are made (slots not reached on a failure stay NULL,
  // which the list's release skips)
  py::list made = py::reinterpret_steal<py::list>(PyList_New((Py_ssize_t)nrec));
  PyObject* lst = made.ptr();
  if (lst == nullptr) throw py::error_already_set();
  Py_ssize_t made_n = 0;
  py::str empty("");
  size_t shapes_used = 0;  // shapes consumed by the batch's ACCESS records
  uint64_t tid_last = 0;
  PyObject* tid_obj = nullptr;
  // The rows are tuples of ints and strings (no cycles): the collector is paused while thousands
  // are made (each ~700 new tuples would start a collection that walks the young objects).
  GcPause gc_pause;
  struct TidRef {  // the shared id object is released on every way out
    PyObject*& o;
    ~TidRef() { Py_XDECREF(o); }
  } tid_ref{tid_obj};
  for (size_t i = 0; i < nrec; ++i) {
    const Rec& r = batch[i];
    PyObject* name = r.op >= 0 ? op_str(r.op) : nm.na;
    if (name == nullptr) throw py::error_already_set();
    PyObject* ev;
    PyObject* type;
    PyObject* ptr;
    PyObject* attr;
    PyObject* stack = Py_None;
    if ((r.kind == OP_START || r.kind == MALLOC || r.kind == MALLOC_BEFORE_OP) && r.stack >= 0) {
      stack = stack_str(r.stack);
      if (stack == nullptr) throw py::error_already_set();
    }
    if (r.kind == OP_START || r.kind == OP_END) {
      ev = nm.ev_launch;
      type = r.kind == OP_START ? nm.ev_start : nm.ev_end;
      ptr = Py_None;
      attr = Py_None;
      Py_INCREF(ptr);
      Py_INCREF(attr);
    } else if (r.kind == ACCESS_READ || r.kind == ACCESS_WRITE) {
      // (dtype, shape, block size, alloc_id)
      ev = nm.ev_access;
      type = r.kind == ACCESS_WRITE ? nm.acc_write : nm.acc_read;
      ptr = PyLong_FromUnsignedLongLong(r.ptr);
      int st = r.extra & 0xff, ndim = r.extra >> 8;
      dtype_str(st);
      PyObject* shape = PyTuple_New(ndim);
      size_t at = (size_t)(r.used - batch_shape_base);
      if (shape != nullptr)
        for (int k = 0; k < ndim; ++k) PyTuple_SET_ITEM(shape, k, PyLong_FromLongLong(batch_shapes[at + k]));
      shapes_used = at + ndim;
      attr = (shape == nullptr || dtype_strs[st] == nullptr) ? nullptr
          : Py_BuildValue("(OOLL)", dtype_strs[st], shape, (long long)r.size, (long long)r.aid);
      if (shape != nullptr) PyObject_GC_UnTrack(shape);  // ints only
      Py_XDECREF(shape);
    } else if (r.kind == STEP_END) {
      // the session's SYSTEM/STEP row: Attr {"step": the step that ended}
      ev = nm.ev_system;
      type = nm.sys_step;
      ptr = Py_None;
      Py_INCREF(ptr);
      attr = Py_BuildValue("{O:L}", nm.step_key, (long long)r.aid);
    } else if (r.kind == ALLOC_FAILED) {
      ++failed;
      // not a dump row: the session turns it into the OOM snapshot (used and peak at the failure)
      ev = nm.ev_failed;
      type = nm.pool;
      ptr = Py_None;
      Py_INCREF(ptr);
      attr = Py_BuildValue("(LLL)", (long long)r.size, (long long)r.used, (long long)r.aid);
    } else if (r.kind == FREE_UNTRACED) {
      // FREE of a counted block freed while not recording: Attr is a dict with the flag
      ev = nm.ev_free;
      type = nm.pool;
      ptr = PyLong_FromUnsignedLongLong(r.ptr);
      attr = Py_BuildValue("{s:L,s:K,s:L,s:L,s:L,O:O}", "allocation_id", (long long)r.aid, "addr",
                           (unsigned long long)r.ptr, "size", (long long)r.size, "used", (long long)r.used,
                           "total", (long long)r.used, nm.untraced_key, Py_True);
    } else if (r.kind == MALLOC_BEFORE_OP) {
      // a block allocated before the traced window, first read by a traced op: a dict with its origin
      ev = nm.ev_malloc;
      type = nm.pool;
      ptr = PyLong_FromUnsignedLongLong(r.ptr);
      attr = Py_BuildValue("{s:L,s:K,s:L,s:L,s:L,s:O,O:O}", "allocation_id", (long long)r.aid, "addr",
                           (unsigned long long)r.ptr, "size", (long long)r.size, "used", (long long)r.used,
                           "total", (long long)r.used, "owner", lb.owner_of(i, empty.ptr()), nm.origin_key,
                           nm.before_op);
      PyObject* mod = lb.module_of(i);
      if (attr != nullptr && mod != nullptr &&  // after the others, as the module tracker adds them
          (PyDict_SetItemString(attr, "module", mod) != 0 ||
           (lb.phase[i] != Py_None && PyDict_SetItemString(attr, "phase", lb.phase[i]) != 0))) {
        Py_DECREF(attr);
        attr = nullptr;
      }
    } else {
      ev = r.kind == MALLOC ? nm.ev_malloc : nm.ev_free;
      type = nm.pool;
      ptr = PyLong_FromUnsignedLongLong(r.ptr);
      // MALLOC: (alloc_id, addr, size, used, total, owner); FREE: the same without the owner.
      // The CPU allocator reserves nothing beyond what it hands out: total == used (one object,
      // as the address is the row's ptr: fewer ints to make, and marshal writes a reference).
      // Built item by item: Py_BuildValue parses its format on every row.
      PyObject* mod = r.kind == MALLOC ? lb.module_of(i) : nullptr;
      attr = PyTuple_New(r.kind == MALLOC ? (mod != nullptr ? 8 : 6) : 5);
      PyObject* used = PyLong_FromLongLong(r.used);
      PyObject* aid = PyLong_FromLongLong(r.aid);
      PyObject* size = PyLong_FromLongLong(r.size);
      if (attr == nullptr || used == nullptr || aid == nullptr || size == nullptr || ptr == nullptr) {
        Py_XDECREF(attr);
        Py_XDECREF(used);
        Py_XDECREF(aid);
        Py_XDECREF(size);
        attr = nullptr;
      } else {
        PyTuple_SET_ITEM(attr, 0, aid);
        Py_INCREF(ptr);
        PyTuple_SET_ITEM(attr, 1, ptr);
        PyTuple_SET_ITEM(attr, 2, size);
        Py_INCREF(used);
        PyTuple_SET_ITEM(attr, 3, used);
        PyTuple_SET_ITEM(attr, 4, used);
        if (r.kind == MALLOC) {  // (..., owner) or (..., owner, module, phase)
          PyObject* owner = lb.owner_of(i, empty.ptr());
          Py_INCREF(owner);
          PyTuple_SET_ITEM(attr, 5, owner);
          if (mod != nullptr) {
            Py_INCREF(mod);
            PyTuple_SET_ITEM(attr, 6, mod);
            Py_INCREF(lb.phase[i]);
            PyTuple_SET_ITEM(attr, 7, lb.phase[i]);
          }
        }
      }
    }
    PyObject* t = nullptr;
    if (ptr != nullptr && attr != nullptr) {
      // the thread's id object is shared by its rows (most rows of a batch are one thread's)
      if (tid_obj == nullptr || r.tid != tid_last) {
        Py_XDECREF(tid_obj);
        tid_obj = PyLong_FromUnsignedLongLong(r.tid);
        tid_last = r.tid;
      }
      PyObject* ts = PyLong_FromLongLong(r.ts);
      t = (ts == nullptr || tid_obj == nullptr) ? nullptr : PyTuple_New(10);
      if (t == nullptr) {
        Py_XDECREF(ts);
      } else {
        PyObject* items[10] = {ev, type, name, ts, tid_obj, nm.device, ptr, attr, stack, Py_None};
        for (int k = 0; k < 10; ++k) {
          if (k != 3 && k != 6 && k != 7) Py_INCREF(items[k]);  // ts, ptr, attr: references made here
          PyTuple_SET_ITEM(t, k, items[k]);
        }
        // made here of ints, strings, None and such tuples (untracked as made): no cycle can go
        // through them (a dict attr of ints and strings is untracked by Python as it is made)
        if (PyTuple_CheckExact(attr)) untrack_if_atomic(attr);
        if (!PyObject_GC_IsTracked(attr)) PyObject_GC_UnTrack(t);
        ptr = attr = nullptr;  // now the tuple's
      }
    }
    Py_XDECREF(ptr);
    Py_XDECREF(attr);
    if (t == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(lst, made_n++, t);  // steals t
  }
  py::object blob = py::none();
  if (want_bytes && failed == 0)
    blob = marshal_rows(batch, nm, empty.ptr(), batch_shapes, batch_shape_base, labelled ? &lb : nullptr);
  done.taken(shapes_used);
  // appending cannot fail half-way on memory: the list is grown once by the slice assignment
  Py_ssize_t n = PyList_GET_SIZE(out.ptr());
  if (PyList_SetSlice(out.ptr(), n, n, lst) != 0) throw py::error_already_set();
  if (labelled) return py::make_tuple((int64_t)nrec, failed, blob, (int64_t)lb.attributed, last_aid);
  return py::make_tuple((int64_t)nrec, failed, blob);
}

// Codes of texts into one list of distinct strings, by a key of ours (an op index, a stack id): a
// key's string is made (``make``) and appended the first time the key is met only.
struct TextCodes {
  py::list& uniq;
  std::unordered_map<int32_t, uint32_t> seen;
  explicit TextCodes(py::list& u) : uniq(u) {}
  template <class Make>
  uint32_t code(int32_t key, Make make) {
    auto it = seen.find(key);
    if (it != seen.end()) return it->second;
    PyObject* o = make();
    if (o == nullptr) throw py::error_already_set();
    uint32_t c = (uint32_t)PyList_GET_SIZE(uniq.ptr());
    if (PyList_Append(uniq.ptr(), o) != 0) throw py::error_already_set();
    seen.emplace(key, c);
    return c;
  }
};

// The inefficient analysis' chunk columns of a batch of records, as chunk_columns() (below, the
// reference) makes them from the same rows' tuples: kinds 1 op start, 2 op end, 3 MALLOC, 4 FREE,
// 5 ACCESS; int64 pos, int8 kind, int64 alloc_id + uint8 valid, int64 size + uint8 valid, int8
// before (-1 none), int32 codes (-1 none) into the distinct op names and stacks. take_packed's
// records hold no block counted before an op (before is 0 or none) and no other kind of row.
py::tuple chunk_of_records(const std::vector<Rec>& batch, int64_t first, const RowNames& nm) {
  size_t k = 0;
  for (const Rec& r : batch)
    if (r.kind != STEP_END) ++k;
  std::string pos(k * 8, '\0'), kind(k, '\0'), aid(k * 8, '\0'), aid_ok(k, '\0'), size(k * 8, '\0'),
      size_ok(k, '\0'), before(k, '\0'), name_codes(k * 4, '\0'), stack_codes(k * 4, '\0');
  int64_t* posv = (int64_t*)&pos[0];
  int64_t* aidv = (int64_t*)&aid[0];
  int64_t* sizev = (int64_t*)&size[0];
  int32_t* namev = (int32_t*)&name_codes[0];
  int32_t* stackv = (int32_t*)&stack_codes[0];
  py::list names, stacks;
  TextCodes name_of(names), stack_of(stacks);  // by op index (-1: "N/A"), by stack id
  auto op_name = [&](const Rec& r) {
    return (int32_t)name_of.code(r.op >= 0 ? r.op : -1, [&] { return r.op >= 0 ? op_str(r.op) : nm.na; });
  };
  size_t j = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const Rec& r = batch[i];
    if (r.kind == STEP_END) continue;
    int8_t kd;
    bool has_aid = false, has_size = false;
    int8_t bf = -1;
    int32_t nc = -1, sc = -1;
    switch (r.kind) {
      case OP_START:
        kd = 1;
        nc = op_name(r);
        break;
      case OP_END:
        kd = 2;
        break;
      case ACCESS_READ:
      case ACCESS_WRITE:
        kd = 5;
        has_aid = true;
        break;
      case MALLOC:
        kd = 3;
        has_aid = has_size = true;
        bf = 0;
        nc = op_name(r);
        if (r.stack >= 0) sc = (int32_t)stack_of.code(r.stack, [&] { return stack_str(r.stack); });
        break;
      default:  // FREE
        kd = 4;
        has_aid = has_size = true;
        break;
    }
    posv[j] = first + (int64_t)i;
    kind[j] = (char)kd;
    aidv[j] = has_aid ? r.aid : 0;
    aid_ok[j] = (char)has_aid;
    sizev[j] = has_size ? r.size : 0;
    size_ok[j] = (char)has_size;
    before[j] = (char)bf;
    namev[j] = nc;
    stackv[j] = sc;
    ++j;
  }
  return py::make_tuple(py::bytes(pos), py::bytes(kind), py::bytes(aid), py::bytes(aid_ok), py::bytes(size),
                        py::bytes(size_ok), py::bytes(before), py::bytes(name_codes), names, py::bytes(stack_codes),
                        stacks);
}

// take_packed(first, names, buf, wants): the records as a flush writes them and its sinks read them,
// with no row tuple made (DEVELOPING.md, the C++ records): (rows, bytes, columns, steps, chunk), or None
// (nothing taken: no records, a drain in progress, a record of a kind only drain() makes rows of (a
// failed allocation, the dict Attr of an untraced free or a block counted before an op), a text
// that marshal cannot write). ``first``: the first row's ID. ``bytes``: every row as drain()'s
// marshal bytes. ``wants``: PACK_LEAK | PACK_CHUNK, the columns the sinks read.
// ``columns`` (PACK_LEAK, else None): the MALLOC, FREE and STEP rows as the leak rule's column loop
// (leak_columns) and replay_rows take them: (id, event, event_type, name, tid, device, alloc_id,
// addr, size, used, owner, py_stack), texts as (uint32 codes, the strings by code; a null code past
// them), numbers as (int64 values, None), the codes and values each a bytes object (native order).
// ``steps``: {index in the columns: the STEP row's tuple}. ``chunk`` (PACK_CHUNK, else None): the
// inefficient analysis' chunk columns of the rows, as chunk_columns() makes them from the tuples.
enum PackWants : int { PACK_LEAK = 1, PACK_CHUNK = 2 };

// `labels` (None, or the spec of label_batch): the MALLOC rows with their owner labels and modules,
// in the bytes and the leak columns (owner), and the modules' columns beside them: the result then
// has three more items, (module codes, phase codes) in the leak columns' strings, the number of
// rows given a module, and the last allocation id when the records were taken (as drain()'s).
py::object take_packed(int64_t first, py::tuple names, py::list buf, int wants, py::object labels) {
  RowNames nm(names);
  const bool labelled = !labels.is_none();
  int64_t last_aid = 0;
  std::vector<Rec>& batch = drained;
  std::vector<int64_t> batch_shapes;
  int64_t batch_shape_base;
  uint64_t epoch;
  // ``buf``: the session's rows waiting. Only with none there: a row another thread drains and
  // appends (with the GIL) comes before these records or after all of them, never between the
  // caller's look at ``buf`` and the take (nothing here lets another thread run)
  if (PyList_GET_SIZE(buf.ptr()) != 0) return py::none();
  {
    std::lock_guard<std::mutex> g(mu);
    if (draining || recs.empty()) return py::none();
    bool access = false;
    for (const Rec& r : recs) {
      if (r.kind == ACCESS_READ || r.kind == ACCESS_WRITE) access = true;
      else if (r.kind != OP_START && r.kind != OP_END && r.kind != MALLOC && r.kind != FREE && r.kind != STEP_END)
        return py::none();
    }
    draining = true;
    batch.clear();
    batch.swap(recs);
    epoch = recs_epoch;
    batch_shape_base = shape_base;
    last_aid = next_aid;
    if (access) batch_shapes.assign(shapes.begin(), shapes.end());
  }
  DrainDone done{epoch};
  BatchLabels lb;
  if (labelled) label_batch(batch, labels.cast<py::tuple>(), nm, lb);  // (may call Python: before the pause)
  GcPause gc_pause;
  const size_t nrec = batch.size();
  py::str empty("");
  size_t shapes_used = 0;  // shapes consumed by the batch's ACCESS records
  for (const Rec& r : batch)
    if (r.kind == ACCESS_READ || r.kind == ACCESS_WRITE) {
      if (dtype_str(r.extra & 0xff) == nullptr) throw py::error_already_set();
      shapes_used = (size_t)(r.used - batch_shape_base) + (size_t)(r.extra >> 8);
    }
  py::object cols_out = py::none(), chunk_out = py::none(), mods_out = py::none();
  py::dict steps;
  if (wants & PACK_LEAK) {
    size_t k = 0;  // the rows of the columns
    for (const Rec& r : batch)
      if (r.kind == MALLOC || r.kind == FREE || r.kind == STEP_END) ++k;
    enum { ID, EV, ET, NAME, TID, DEV, AID, ADDR, SIZE, USED, OWNER, STACK, NCOLS };
    static const bool is_text[NCOLS] = {false, true, true, true, false, true, false, false, false, false, true, true};
    // each column one bytes object, written in place (the column loop reads them through the buffer
    // protocol; numpy.frombuffer reads them too)
    py::object data[NCOLS];
    int64_t* iv[NCOLS] = {nullptr};
    uint32_t* cv[NCOLS] = {nullptr};
    for (int j = 0; j < NCOLS; ++j) {
      PyObject* b = PyBytes_FromStringAndSize(nullptr, (Py_ssize_t)(k * (is_text[j] ? 4 : 8)));
      if (b == nullptr) throw py::error_already_set();
      data[j] = py::reinterpret_steal<py::object>(b);
      if (is_text[j]) cv[j] = (uint32_t*)PyBytes_AS_STRING(b);
      else iv[j] = (int64_t*)PyBytes_AS_STRING(b);
    }
    // the strings by code: the fixed ones, then each op name and stack as first met
    enum : uint32_t { C_MALLOC, C_FREE, C_SYSTEM, C_POOL, C_STEP, C_DEVICE, C_NA, C_EMPTY, C_FIXED };
    const uint32_t C_NULL = 0xffffffffu;
    py::list values;
    for (PyObject* o : {nm.ev_malloc, nm.ev_free, nm.ev_system, nm.pool, nm.sys_step, nm.device, nm.na, empty.ptr()})
      values.append(py::reinterpret_borrow<py::object>(o));
    TextCodes op_code(values), stack_code(values);  // (one list: the fixed strings, then these)
    // the labels' strings by object (a flush has a few dozen): owners, modules, phases
    std::unordered_map<PyObject*, uint32_t> label_code;
    auto code_of = [&](PyObject* o) -> uint32_t {
      if (o == nullptr || o == Py_None) return C_NULL;
      auto it = label_code.find(o);
      if (it != label_code.end()) return it->second;
      uint32_t c = (uint32_t)PyList_GET_SIZE(values.ptr());
      values.append(py::reinterpret_borrow<py::object>(o));
      label_code.emplace(o, c);
      return c;
    };
    py::object mod_bytes, phase_bytes;
    uint32_t *mv = nullptr, *pv = nullptr;
    if (labelled) {
      PyObject* mb = PyBytes_FromStringAndSize(nullptr, (Py_ssize_t)(k * 4));
      if (mb == nullptr) throw py::error_already_set();
      mod_bytes = py::reinterpret_steal<py::object>(mb);
      PyObject* pb = PyBytes_FromStringAndSize(nullptr, (Py_ssize_t)(k * 4));
      if (pb == nullptr) throw py::error_already_set();
      phase_bytes = py::reinterpret_steal<py::object>(pb);
      mv = (uint32_t*)PyBytes_AS_STRING(mb);
      pv = (uint32_t*)PyBytes_AS_STRING(pb);
    }
    size_t j = 0;
    for (size_t i = 0; i < nrec; ++i) {
      const Rec& r = batch[i];
      if (r.kind != MALLOC && r.kind != FREE && r.kind != STEP_END) continue;
      iv[ID][j] = first + (int64_t)i;
      iv[TID][j] = (int64_t)r.tid;
      cv[DEV][j] = C_DEVICE;
      cv[NAME][j] = r.op >= 0 ? op_code.code(r.op, [&] { return op_str(r.op); }) : C_NA;
      if (r.kind == STEP_END) {
        // the session's SYSTEM/STEP row, made here as drain() makes it (a few a flush)
        cv[EV][j] = C_SYSTEM;
        cv[ET][j] = C_STEP;
        cv[OWNER][j] = cv[STACK][j] = C_NULL;
        if (labelled) mv[j] = pv[j] = C_NULL;
        iv[AID][j] = iv[ADDR][j] = iv[SIZE][j] = iv[USED][j] = 0;
        PyObject* name = PyList_GET_ITEM(values.ptr(), cv[NAME][j]);
        py::object attr = py::reinterpret_steal<py::object>(Py_BuildValue("{O:L}", nm.step_key, (long long)r.aid));
        py::object ts = py::reinterpret_steal<py::object>(PyLong_FromLongLong(r.ts));
        py::object tid = py::reinterpret_steal<py::object>(PyLong_FromUnsignedLongLong(r.tid));
        if (!attr || !ts || !tid) throw py::error_already_set();
        py::tuple row = py::make_tuple(py::handle(nm.ev_system), py::handle(nm.sys_step), py::handle(name), ts, tid,
                                       py::handle(nm.device), py::none(), attr, py::none(), py::none());
        steps[py::int_(j)] = row;
      } else {
        bool is_malloc = r.kind == MALLOC;
        cv[EV][j] = is_malloc ? C_MALLOC : C_FREE;
        cv[ET][j] = C_POOL;
        cv[OWNER][j] = !is_malloc ? C_NULL : labelled && lb.owner_of(i, nullptr) != nullptr ? code_of(lb.owner[i]) : C_EMPTY;
        if (labelled) {
          PyObject* mod = is_malloc ? lb.module_of(i) : nullptr;
          mv[j] = code_of(mod);
          pv[j] = mod != nullptr ? code_of(lb.phase[i]) : C_NULL;
        }
        cv[STACK][j] = is_malloc && r.stack >= 0 ? stack_code.code(r.stack, [&] { return stack_str(r.stack); }) : C_NULL;
        iv[AID][j] = r.aid;
        iv[ADDR][j] = (int64_t)r.ptr;
        iv[SIZE][j] = r.size;
        iv[USED][j] = r.used;
      }
      ++j;
    }
    py::list cols;
    for (int c = 0; c < NCOLS; ++c) cols.append(py::make_tuple(data[c], is_text[c] ? py::object(values) : py::none()));
    cols_out = py::tuple(cols);
    if (labelled) mods_out = py::make_tuple(mod_bytes, phase_bytes);
  }
  if (wants & PACK_CHUNK) chunk_out = chunk_of_records(batch, first, nm);
  py::object blob = marshal_rows(batch, nm, empty.ptr(), batch_shapes, batch_shape_base, labelled ? &lb : nullptr);
  if (blob.is_none()) return py::none();  // the records go back for drain()
  done.taken(shapes_used);
  if (labelled)
    return py::make_tuple((int64_t)nrec, blob, cols_out, steps, chunk_out, mods_out, (int64_t)lb.attributed, last_aid);
  return py::make_tuple((int64_t)nrec, blob, cols_out, steps, chunk_out);
}

// The session goes over to the dispatch-mode source: ops and new blocks are no longer recorded
// here; the frees of the blocks counted so far still are. Returns the last allocation id.
// One critical section: from it on no op or new block is recorded here and every free of a
// counted block is (so none lowers the counter without a row), and the ops in flight get OP_END.
int64_t handover() {
  int64_t last;
  {
    std::lock_guard<std::mutex> g(mu);
    handed_over = true;
    stop_recording_locked();
    last = next_aid;
  }
  detach();  // the blocks counted so far keep this wrapper's deleter
  return last;
}

// A new session starts from a clean recorder: nothing recorded, nothing counted (blocks of an
// earlier session in this process are no longer reported), no handover.
void reset() {
  {
    std::lock_guard<std::mutex> g(mu);
    stop_recording_locked();
    handed_over = false;
    emit_free = free_untraced = false;
    recs.clear();
    ++recs_epoch;
    tagged.clear();
    shape_base += (int64_t)shapes.size();
    shapes.clear();
    used_bytes = peak_bytes = 0;
    next_aid = 0;
    live.each([](void*, Block& b) { b.counted = false; });
  }
  detach();
}

// After the handover the dispatch-mode source's blocks share the bytes-in-use counter:
// (used after the change, its time), taken together so that rows order by time.
// No Python object is made while ``mu`` is held, here or anywhere: making one may run the
// collector, which may free a tensor, whose free takes ``mu`` in traced_delete (a thread
// deadlocked itself so in counters(), and every other thread with it, at the first free).
py::tuple account(int64_t delta) {
  int64_t used, ts;
  {
    std::lock_guard<std::mutex> g(mu);
    used_bytes += delta;
    if (used_bytes > peak_bytes) peak_bytes = used_bytes;
    used = used_bytes;
    ts = now_ns();
  }
  return py::make_tuple(used, ts);
}

// A step boundary recorded among the records (aid: the step that ended), so that a boundary
// whose flush waits needs no drain: its SYSTEM/STEP row comes out of the next drain in the order
// things happened. Called with the GIL, by the thread that ends the step.
void step_end(int64_t step) {
  std::lock_guard<std::mutex> g(mu);
  recs.push_back({now_ns(), tid(), 0, 0, 0, step, STEP_END, -1, -1, 0});
}

// (alloc_id, size) of the counted block starting at this address, or None
py::object counted_block(uint64_t addr) {
  int64_t aid, size;
  {
    std::lock_guard<std::mutex> g(mu);  // no Python object made under it (account)
    const Block* b = live.find((void*)addr);
    if (b == nullptr || !b->counted) return py::none();
    aid = b->aid;
    size = b->size;
  }
  return py::make_tuple(aid, size);
}

// the data pointer of a CPU tensor's storage, nullptr: none (no storage, another device, a
// wrapper subclass whose storage cannot be reached)
const void* cpu_data(const at::Tensor& t) {
  try {
    if (t.defined() && t.unsafeGetTensorImpl()->has_storage() && t.device().is_cpu()) return t.storage().data();
  } catch (...) {
  }
  return nullptr;
}

// the allocation ids of the counted blocks at these data pointers (-1: none, or no pointer)
std::vector<int64_t> counted_ids(const std::vector<const void*>& ptrs) {
  std::vector<int64_t> ids(ptrs.size(), -1);
  std::lock_guard<std::mutex> g(mu);
  for (size_t i = 0; i < ptrs.size(); ++i) {
    if (ptrs[i] == nullptr) continue;
    const Block* b = live.find(ptrs[i]);
    if (b != nullptr && b->counted) ids[i] = b->aid;
  }
  return ids;
}

// The alloc ids of the counted blocks behind these tensors' storages (-1: none), in one call: the
// owner labels and the module attribution resolve every parameter, gradient and optimizer state at
// each flush, and a call per tensor (storage object, data_ptr, lookup) cost ~1.5 us each.
py::list block_ids(py::sequence tensors) {
  std::vector<const void*> ptrs;
  Py_ssize_t n = (Py_ssize_t)py::len(tensors);
  ptrs.reserve((size_t)n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = PySequence_GetItem(tensors.ptr(), i);
    if (o == nullptr) throw py::error_already_set();
    const void* data = THPVariable_Check(o) ? cpu_data(THPVariable_Unpack(o)) : nullptr;
    Py_DECREF(o);
    ptrs.push_back(data);
  }
  std::vector<int64_t> ids = counted_ids(ptrs);
  py::list out(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) out[i] = py::int_(ids[i]);
  return out;
}

// (bytes in use, peak) of the blocks allocated while recording
py::tuple counters() {
  int64_t used, peak;
  {
    std::lock_guard<std::mutex> g(mu);  // no Python object made under it (account)
    used = used_bytes;
    peak = peak_bytes;
  }
  return py::make_tuple(used, peak);
}

void reset_peak() {
  std::lock_guard<std::mutex> g(mu);
  peak_bytes = used_bytes;
}

// alloc ids of the counted blocks still allocated (the leak rule's check of a suspect)
py::set live_alloc_ids() {
  std::vector<int64_t> ids;
  {
    std::lock_guard<std::mutex> g(mu);
    ids.reserve(live.size());
    live.each([&](void*, const Block& b) {
      if (b.counted) ids.push_back(b.aid);
    });
  }
  py::set s;
  for (int64_t i : ids) s.add(py::int_(i));
  return s;
}

// The allocation ids of the FREE records not yet in a flush's rows (waiting, or in a drain that is
// building its tuples on another thread): what the session's live set of a flush's step ends adds
// without draining them (a drain there would make the next flush drain too, not take_packed).
py::set waiting_free_ids() {
  std::vector<int64_t> ids;
  {
    std::lock_guard<std::mutex> g(mu);
    for (const std::vector<Rec>* v : {&recs, &drained})
      for (const Rec& r : *v)
        if (r.kind == FREE || r.kind == FREE_UNTRACED) ids.push_back(r.aid);
  }
  py::set s;
  for (int64_t i : ids) s.add(py::int_(i));
  return s;
}

// the owner tag of this thread's new blocks from now on (0: none)
void set_owner_tag(int32_t tag) { owner_tag = tag; }

// [(alloc_id, tag)] of the blocks counted under a tag since the last call
py::list take_tagged() {
  std::vector<std::pair<int64_t, int32_t>> got;
  {
    std::lock_guard<std::mutex> g(mu);
    got.swap(tagged);
  }
  py::list out;
  for (auto& p : got) out.append(py::make_tuple(p.first, p.second));
  return out;
}

// ---------------------------------------------------------------- the live objects' blocks
// The owner labeller's walk of the live objects (capture/owners.py walk_live_objects) and module
// attribution's owning modules (capture/modules.py ModuleTracker.owned_blocks), in C++: run at
// every flush, their Python loops over parameters, gradients, buffers and optimizer state cost
// more than the rest of a small model's flush. Same order, same "first one wins" per allocation
// id. None (the caller walks in Python) where a tensor is not a plain Tensor or Parameter (a
// wrapper subclass: plain_tensors unwraps it) or a module is FSDP2's (its own storages first).
struct Walk {
  std::vector<const void*> ptrs;
  std::vector<PyObject*> vals;  // borrowed: the caller's values outlive the call
  bool plain = true;
  void tensor(const at::Tensor& t, PyObject* v) {
    ptrs.push_back(cpu_data(t));
    vals.push_back(v);
  }
  void add(PyObject* o, PyObject* v) {  // a tensor, or None
    if (o == nullptr || o == Py_None) return;
    if (!THPVariable_CheckExact(o)) {
      plain = false;
      return;
    }
    tensor(THPVariable_Unpack(o), v);
  }
  // the tensors among an optimizer's per-parameter state (a dict: moments, step counters)
  void state_tensors(PyObject* st, PyObject* v) {
    if (!PyDict_Check(st)) return;
    PyObject *k, *x;
    Py_ssize_t pos = 0;
    while (PyDict_Next(st, &pos, &k, &x))
      if (THPVariable_Check(x)) add(x, v);
  }
  void grad_of(PyObject* p, PyObject* v) {
    if (!THPVariable_CheckExact(p)) {
      plain = false;
      return;
    }
    const at::Tensor& g = THPVariable_Unpack(p).grad();
    if (g.defined()) tensor(g, v);
  }
  // {alloc_id: value} of the counted blocks, the first value given to each
  py::dict resolve() {
    std::vector<int64_t> ids = counted_ids(ptrs);
    py::dict out;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0) continue;
      py::int_ k(ids[i]);
      if (!PyDict_Contains(out.ptr(), k.ptr())) out[k] = py::reinterpret_borrow<py::object>(vals[i]);
    }
    return out;
  }
};

// new reference or nullptr (no error left set): a module's own dict of parameters or buffers
PyObject* own_dict(PyObject* module, const char* name) {
  PyObject* d = PyObject_GetAttrString(module, name);
  if (d == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  if (!PyDict_Check(d)) {
    Py_DECREF(d);
    return nullptr;
  }
  return d;
}

bool is_fsdp2(PyObject* module) {
  static PyObject* name = PyUnicode_InternFromString("_get_fsdp_state");
  return _PyType_Lookup(Py_TYPE(module), name) != nullptr;
}

// an optimizer's param_groups' params, each with the callback; false: not walkable here
template <class F>
bool each_group_param(PyObject* opt, F f) {
  py::object groups = py::reinterpret_steal<py::object>(PyObject_GetAttrString(opt, "param_groups"));
  if (!groups) {
    PyErr_Clear();
    return false;
  }
  py::list gl = py::list(groups);
  for (auto g : gl) {
    if (!PyDict_Check(g.ptr())) return false;
    PyObject* ps = PyDict_GetItemString(g.ptr(), "params");  // borrowed
    if (ps == nullptr) continue;
    py::list pl = py::list(py::reinterpret_borrow<py::object>(ps));
    for (auto p : pl) f(p.ptr());
  }
  return true;
}

// {id: state dict} of an optimizer, as (param, state) pairs; false: not walkable here
bool opt_state(PyObject* opt, std::vector<std::pair<py::object, py::object>>& out) {
  py::object st = py::reinterpret_steal<py::object>(PyObject_GetAttrString(opt, "state"));
  if (!st) {
    PyErr_Clear();
    return false;
  }
  if (!PyDict_Check(st.ptr())) return false;
  PyObject *k, *v;
  Py_ssize_t pos = 0;
  while (PyDict_Next(st.ptr(), &pos, &k, &v))
    out.emplace_back(py::reinterpret_borrow<py::object>(k), py::reinterpret_borrow<py::object>(v));
  return true;
}

// walk_live_objects' categories: trees (one list of modules per root), optimizers, and the
// values for (weight, gradient, optimizer state) -> {alloc_id: value} or None
py::object live_categories(py::list trees, py::list optimizers, py::tuple vals) {
  PyObject *weight = vals[0].ptr(), *grad = vals[1].ptr(), *state = vals[2].ptr();
  Walk w;
  for (auto mods_h : trees) {
    py::list mods = py::list(py::reinterpret_borrow<py::object>(mods_h));
    std::vector<py::object> params;
    for (auto sub : mods) {
      if (is_fsdp2(sub.ptr())) return py::none();
      PyObject* d = own_dict(sub.ptr(), "_parameters");
      if (d == nullptr) return py::none();
      PyObject *k, *v;
      Py_ssize_t pos = 0;
      while (PyDict_Next(d, &pos, &k, &v))
        if (v != Py_None) params.push_back(py::reinterpret_borrow<py::object>(v));
      Py_DECREF(d);
    }
    for (auto& p : params) w.add(p.ptr(), weight);
    for (auto sub : mods) {
      PyObject* d = own_dict(sub.ptr(), "_buffers");
      if (d == nullptr) return py::none();
      PyObject *k, *v;
      Py_ssize_t pos = 0;
      while (PyDict_Next(d, &pos, &k, &v)) w.add(v, weight);
      Py_DECREF(d);
    }
    for (auto& p : params) w.grad_of(p.ptr(), grad);
  }
  for (auto opt : optimizers) {
    bool ok = each_group_param(opt.ptr(), [&](PyObject* p) {
      w.add(p, weight);
      if (THPVariable_Check(p)) w.grad_of(p, grad);
    });
    std::vector<std::pair<py::object, py::object>> st;
    if (!ok || !opt_state(opt.ptr(), st)) return py::none();
    for (auto& kv : st) w.state_tensors(kv.second.ptr(), state);
  }
  if (!w.plain) return py::none();
  return w.resolve();
}

// ModuleTracker.owned_blocks: tree [(path, module)], optimizers, (weight, gradient, optimizer
// state) names -> {alloc_id: (path, category)} or None
py::object owning_modules(py::list tree, py::list optimizers, py::tuple cats) {
  Walk w;
  std::vector<py::object> keep;  // the (path, category) values
  std::unordered_map<PyObject*, size_t> by_param;  // parameter -> its module's entry in `paths`
  std::vector<py::object> paths;
  auto value = [&](const py::object& path, size_t c) {
    keep.push_back(py::make_tuple(path, cats[c]));
    return keep.back().ptr();
  };
  for (auto item : tree) {
    py::tuple pm = py::reinterpret_borrow<py::tuple>(item);
    py::object path = pm[0], sub = pm[1];
    if (sub.is_none()) continue;
    if (is_fsdp2(sub.ptr())) return py::none();
    paths.push_back(path);
    PyObject *wv = value(path, 0), *gv = value(path, 1);
    PyObject* d = own_dict(sub.ptr(), "_parameters");
    if (d == nullptr) return py::none();
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(d, &pos, &k, &v)) {
      if (v == Py_None) continue;
      by_param.emplace(v, paths.size() - 1);
      w.add(v, wv);
      if (THPVariable_Check(v)) w.grad_of(v, gv);
    }
    Py_DECREF(d);
    d = own_dict(sub.ptr(), "_buffers");
    if (d == nullptr) return py::none();
    pos = 0;
    while (PyDict_Next(d, &pos, &k, &v))
      if (v != Py_None) w.add(v, wv);
    Py_DECREF(d);
  }
  for (auto opt : optimizers) {
    std::vector<std::pair<py::object, py::object>> st;
    if (!opt_state(opt.ptr(), st)) return py::none();
    for (auto& kv : st) {
      auto it = by_param.find(kv.first.ptr());
      if (it != by_param.end() && PyDict_Check(kv.second.ptr()))
        w.state_tensors(kv.second.ptr(), value(paths[it->second], 2));
    }
  }
  if (!w.plain) return py::none();
  return w.resolve();
}

// A weak reference's object (borrowed), or the object itself; nullptr: the object is gone.
PyObject* deref(PyObject* o) {
  if (!PyWeakref_Check(o)) return o;
  PyObject* x = PyWeakref_GetObject(o);
  return x == Py_None ? nullptr : x;
}

// A step end's walks in one call (capture/owners.py NativeLabeler._walk_all): the labeller's
// categories (live_categories over ``trees``, lists of weak references to each root's modules, and
// ``opts``, weak references to optimizers), module attribution's owning modules (owning_modules over
// ``tree``, (path, weak reference) pairs, and ``mopts``; ``tree`` None: none wanted) and the live
// ids. Three calls from Python before, each with its own preparation: at a step end of a small
// model every call and Python loop there costs several times what it does warm (the MLP: ~130 us
// a step for the two walks). None where a module or optimizer of the labeller's is gone (its
// caller prepares the walk again); a walk's None as live_categories' and owning_modules'.
py::object live_walks(py::list trees, py::list opts, py::tuple vals, py::object tree, py::list mopts,
                      py::tuple names) {
  py::list ltrees, lopts;
  for (auto refs_h : trees) {
    py::list refs = py::reinterpret_borrow<py::list>(refs_h);
    py::list mods(refs.size());
    for (size_t i = 0; i < refs.size(); ++i) {
      PyObject* m = deref(refs[i].ptr());
      if (m == nullptr) return py::none();
      mods[i] = py::reinterpret_borrow<py::object>(m);
    }
    ltrees.append(mods);
  }
  for (auto r : opts) {
    PyObject* o = deref(r.ptr());
    if (o == nullptr) return py::none();
    lopts.append(py::reinterpret_borrow<py::object>(o));
  }
  py::object cats = live_categories(ltrees, lopts, vals);
  py::object owned = py::none();
  if (!tree.is_none()) {
    py::list mtree, mo;
    for (auto item : py::reinterpret_borrow<py::list>(tree)) {
      py::tuple pr = py::reinterpret_borrow<py::tuple>(item);
      PyObject* m = deref(pr[1].ptr());  // a module gone: skipped, as owning_modules skips None
      mtree.append(py::make_tuple(pr[0], m == nullptr ? py::none() : py::reinterpret_borrow<py::object>(m)));
    }
    for (auto r : mopts) {
      PyObject* o = deref(r.ptr());
      if (o != nullptr) mo.append(py::reinterpret_borrow<py::object>(o));
    }
    owned = owning_modules(mtree, mo, names);
  }
  return py::make_tuple(cats, owned, live_alloc_ids());
}

// the last allocation id given
int64_t last_alloc_id() {
  std::lock_guard<std::mutex> g(mu);
  return next_aid;
}


namespace {

// a new tuple: ``t`` with item k replaced by v (rows and their attrs are tuples: shared, never
// changed); nullptr with the error set
PyObject* with_item(PyObject* t, Py_ssize_t k, PyObject* v) {
  Py_ssize_t n = PyTuple_GET_SIZE(t);
  PyObject* out = PyTuple_New(n);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t j = 0; j < n; ++j) {
    PyObject* x = j == k ? v : PyTuple_GET_ITEM(t, j);
    Py_INCREF(x);
    PyTuple_SET_ITEM(out, j, x);
  }
  untrack_if_atomic(out);
  return out;
}

}  // namespace

// The owner labeller's row loop (capture/owners.py NativeLabeler.before_flush), over the MALLOC rows
// of the buffer with a tuple attr: each gets its block's owner, owner[aid]; a block not there (freed
// since it was made) gets ``plain`` unless ``info`` or ``cats`` know it (those rows, and rows with
// another attr, are returned by index for the Python loop); blocks labelled at an earlier flush
// and freed since (aid <= prev_upto) keep their row. Every allocation id that reaches a label goes
// into ``in_buf``. consts = (MALLOC, EVENT, ATTR, A_ALLOC_ID, A_OWNER).
py::list relabel_mallocs(py::list buf, py::dict owner, py::dict info, py::dict cats, py::object plain,
                         py::set in_buf, int64_t prev_upto, py::tuple consts) {
  PyObject* ev_malloc = consts[0].ptr();
  Py_ssize_t ev_i = consts[1].cast<Py_ssize_t>(), attr_i = consts[2].cast<Py_ssize_t>();
  Py_ssize_t aid_i = consts[3].cast<Py_ssize_t>(), owner_i = consts[4].cast<Py_ssize_t>();
  py::list todo;
  PyObject* lst = buf.ptr();
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(lst); ++i) {
    PyObject* r = PyList_GET_ITEM(lst, i);
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) <= std::max(ev_i, attr_i)) {
      todo.append(i);
      continue;
    }
    PyObject* ev = PyTuple_GET_ITEM(r, ev_i);
    if (ev != ev_malloc) {
      int eq = PyObject_RichCompareBool(ev, ev_malloc, Py_EQ);
      if (eq < 0) throw py::error_already_set();
      if (!eq) continue;
    }
    PyObject* a = PyTuple_GET_ITEM(r, attr_i);
    if (!PyTuple_Check(a) || PyTuple_GET_SIZE(a) <= std::max(aid_i, owner_i)) {
      todo.append(i);  // a dict attr (or none): the Python loop's general path
      continue;
    }
    PyObject* aid = PyTuple_GET_ITEM(a, aid_i);
    PyObject* label = PyDict_GetItemWithError(owner.ptr(), aid);
    if (label == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      long long id = PyLong_AsLongLong(aid);
      if (id == -1 && PyErr_Occurred()) throw py::error_already_set();
      if (id <= prev_upto) continue;
      int known = PyDict_Contains(info.ptr(), aid);
      if (known == 0) known = PyDict_Contains(cats.ptr(), aid);
      if (known < 0) throw py::error_already_set();
      if (known) {
        todo.append(i);
        continue;
      }
      label = plain.ptr();
    }
    if (PySet_Add(in_buf.ptr(), aid) != 0) throw py::error_already_set();
    PyObject* was = PyTuple_GET_ITEM(a, owner_i);
    if (was == label) continue;
    int same = PyObject_RichCompareBool(was, label, Py_EQ);
    if (same < 0) throw py::error_already_set();
    if (same) continue;
    // the row again with the new owner in its attr
    PyObject* a2 = with_item(a, owner_i, label);
    if (a2 == nullptr) throw py::error_already_set();
    PyObject* r2 = with_item(r, attr_i, a2);
    Py_DECREF(a2);
    if (r2 == nullptr) throw py::error_already_set();
    PyList_SetItem(lst, i, r2);  // steals r2, drops the old row
  }
  return todo;
}

// NativeLabeler._label_live's loop over the live blocks (capture/owners.py), for the blocks nothing
// particular is known of (most: not in ``info``): their owner is the labeller's cached plain
// answer for (pool, category); a block whose owner changes gets it in ``owner``, and is in
// ``changed`` when its MALLOC row has its label already (id <= prev_upto, or in ``at_step``), else
// (at a step end) in ``at_step``. Returns (changed, todo): ``todo`` the blocks the Python loop
// answers (in ``info``, or a (pool, category) not in the cache yet). GPT-2 with decompose: ~600
// live blocks at every step end.
py::tuple label_live(py::iterable live, py::dict owner, py::dict at_step, py::dict info, py::dict cats,
                     py::dict plain, py::object pool, int64_t prev_upto, bool at_step_end) {
  py::list changed, todo;
  std::vector<std::pair<PyObject*, PyObject*>> memo;  // category object -> its plain label (both borrowed)
  for (auto h : live) {
    PyObject* aid = h.ptr();
    int known = PyDict_Contains(info.ptr(), aid);
    if (known < 0) throw py::error_already_set();
    if (known) {
      todo.append(h);
      continue;
    }
    PyObject* cat = PyDict_GetItemWithError(cats.ptr(), aid);
    if (cat == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      cat = Py_None;
    }
    PyObject* label = nullptr;
    for (auto& m : memo)
      if (m.first == cat) {
        label = m.second;
        break;
      }
    if (label == nullptr) {
      py::tuple key = py::make_tuple(pool, py::handle(cat));
      label = PyDict_GetItemWithError(plain.ptr(), key.ptr());
      if (label == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        todo.append(h);
        continue;
      }
      if (memo.size() < 32) memo.emplace_back(cat, label);
    }
    PyObject* was = PyDict_GetItemWithError(owner.ptr(), aid);
    if (was == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (was != nullptr) {
      if (was == label) continue;
      int same = PyObject_RichCompareBool(was, label, Py_EQ);
      if (same < 0) throw py::error_already_set();
      if (same) continue;
    }
    if (PyDict_SetItem(owner.ptr(), aid, label) != 0) throw py::error_already_set();
    long long id = PyLong_AsLongLong(aid);
    if (id == -1 && PyErr_Occurred()) throw py::error_already_set();
    int pending = PyDict_Contains(at_step.ptr(), aid);
    if (pending < 0) throw py::error_already_set();
    if (id <= prev_upto || pending) {
      changed.append(h);
    } else if (at_step_end && PyDict_SetItem(at_step.ptr(), aid, label) != 0) {
      throw py::error_already_set();
    }
  }
  return py::make_tuple(changed, todo);
}

// ================================================================ module attribution (issue 25)
// The hot half of capture/modules.py ModuleTracker, in C++: the global module forward hooks are
// the C functions `mt_pre` / `mt_post`, and the backward moments of a module call are pre-hooks on
// the autograd nodes of its inputs and outputs (MtHook), so no Python runs per module call or per
// backward node. State, per thread: the stack of (path, phase) open now and the marks (ts, state)
// at each change of its top, on the rows' clock and thread ids. Python names the modules (once
// each, `namer`), handles leaves (a tensor without a node keeps the multi-grad hook, `leaf`), and
// reads the marks at each flush (`mt_marks`). ModuleTracker's Python hooks are the reference
// (MSMEMSCOPE_FOLD=python), held equal by tests/test_modules.py.
//
// Locking: mt_mu guards the stacks, marks and path texts; it is never held while Python runs
// (a hook holding it while Python switches threads would wait on a thread that waits on it). The
// module -> path cache is touched only by the forward hooks, which hold the GIL.
namespace modtrack {

using torch::autograd::Node;

enum Phase : int32_t { FWD = 0, BWD = 1 };
inline int32_t state_of(int32_t path, int32_t phase) { return path * 2 + phase; }

struct Thread {
  std::vector<int32_t> stack;  // states open now, innermost last
  std::vector<int64_t> ts;     // marks since the last prune
  std::vector<int32_t> st;     // their states (-1: no module)
  int32_t base = -1;           // state before the first mark kept
};

std::mutex& mt_mu = *new std::mutex();
std::unordered_map<uint64_t, Thread>& threads = *new std::unordered_map<uint64_t, Thread>();
std::vector<std::string>& paths = *new std::vector<std::string>();
std::unordered_map<std::string, int32_t>& path_ids = *new std::unordered_map<std::string, int32_t>();
std::vector<PyObject*>& state_objs = *new std::vector<PyObject*>();  // state -> (path, phase) tuple, made at export
std::atomic<bool> on{false};          // the session traces: hooks act
bool callback_queued = false;         // the end-of-backward callback of this pass is queued
// the owner labeller's view of forwards (all threads together, as capture/owners.py Labeler): the
// depth of forwards running, and the first allocation id of the outermost one
int depth = 0;
int64_t fwd_first_aid = -1;
// the forwards running on this thread (its roots: on_root); reset with ``depth`` (a new epoch: the
// other threads' counts are theirs to drop when they next look)
std::atomic<uint32_t> depth_epoch{0};
thread_local struct { uint32_t epoch = 0; int n = 0; } thread_forwards;
inline int& thread_depth() {
  uint32_t e = depth_epoch.load(std::memory_order_relaxed);
  if (thread_forwards.epoch != e) {
    thread_forwards.epoch = e;
    thread_forwards.n = 0;
  }
  return thread_forwards.n;
}
inline void reset_depth() {
  depth = 0;
  depth_epoch.fetch_add(1, std::memory_order_relaxed);
}
std::vector<int64_t>& saved_aids = *new std::vector<int64_t>();  // blocks saved for backward since the last take

// GIL-guarded
struct Known { PyObject* ref; int32_t path; };   // a weak reference to the module, its path id
std::unordered_map<PyObject*, Known>& known = *new std::unordered_map<PyObject*, Known>();
PyObject* namer = nullptr;     // namer(module, parent path or None) -> path text
PyObject* leaf = nullptr;      // leaf(tensors, path, "any" | "all"): a leaf among them
PyObject* on_root = nullptr;   // on_root(module): an outermost forward begins (or None)
PyObject* pack_py = nullptr;   // the labeller's Python pack hook, for tensors that are not plain
PyObject* str_fwd = nullptr;
PyObject* str_bwd = nullptr;
bool forked_handlers = false;

void mt_before_fork() { mt_mu.lock(); }
void mt_after_fork_parent() { mt_mu.unlock(); }
void mt_after_fork_child() {
  on = false;
  mt_mu.unlock();
}

// under mt_mu
int32_t intern_path_locked(const std::string& p) {
  auto it = path_ids.find(p);
  if (it != path_ids.end()) return it->second;
  int32_t id = (int32_t)paths.size();
  paths.push_back(p);
  path_ids.emplace(p, id);
  return id;
}

inline void mark_locked(Thread& th, int64_t ts, int32_t state) {
  th.ts.push_back(ts);
  th.st.push_back(state);
}

// ModuleTracker._push: a module's forward or backward begins on this thread
void push_locked(uint64_t t, int32_t path, int32_t phase) {
  Thread& th = threads[t];
  int32_t state = state_of(path, phase);
  auto& stk = th.stack;
  if (phase == BWD && !stk.empty()) {
    // hooks on one tensor fire in registration order: a parent whose output is its last child's
    // output (GPT and GPT.head) enters after it; it still encloses it
    const std::string& me = paths[path];
    size_t i = stk.size();
    while (i > 0 && (stk[i - 1] & 1) == BWD) {
      const std::string& other = paths[stk[i - 1] >> 1];
      if (other.size() > me.size() && other.compare(0, me.size(), me) == 0 && other[me.size()] == '.') --i;
      else break;
    }
    stk.insert(stk.begin() + (std::ptrdiff_t)i, state);
    state = stk.back();
  } else {
    stk.push_back(state);
  }
  mark_locked(th, now_ns(), state);
}

// ModuleTracker._pop: it ends (the innermost one, or wherever it is in the stack)
void pop_locked(uint64_t t, int32_t path, int32_t phase) {
  auto it = threads.find(t);
  if (it == threads.end() || it->second.stack.empty()) return;
  Thread& th = it->second;
  auto& stk = th.stack;
  int32_t state = state_of(path, phase);
  if (stk.back() == state) {
    stk.pop_back();
  } else {
    bool found = false;
    for (size_t i = stk.size() - 1; i-- > 0;) {
      if (stk[i] == state) {
        stk.erase(stk.begin() + (std::ptrdiff_t)i);
        found = true;
        break;
      }
    }
    if (!found) return;
  }
  mark_locked(th, now_ns(), stk.empty() ? -1 : stk.back());
}

// the backward pass ended: every module still in backward ends (those whose inputs needed no gradient)
void bw_done() {
  std::lock_guard<std::mutex> g(mt_mu);
  callback_queued = false;
  int64_t ts = now_ns();
  for (auto& kv : threads) {
    auto& stk = kv.second.stack;
    size_t before = stk.size();
    stk.erase(std::remove_if(stk.begin(), stk.end(), [](int32_t s) { return (s & 1) == BWD; }), stk.end());
    if (stk.size() != before) mark_locked(kv.second, ts, stk.empty() ? -1 : stk.back());
  }
}

// a module's backward begins (ModuleTracker._bw_enter): under mt_mu, inside the backward pass
void enter_locked(int32_t path) {
  if (!callback_queued) {
    callback_queued = true;
    torch::autograd::Engine::get_default_engine().queue_callback(&bw_done);
  }
  push_locked(tid(), path, BWD);
}

// torch._C._will_engine_execute_node: the node is in this backward pass's graph and runs
bool will_run(Node* n) {
  auto* in_graph = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (in_graph == nullptr || in_graph->find(n) == in_graph->end()) return false;
  auto* exec = torch::autograd::get_current_graph_task_exec_info();
  if (exec == nullptr || exec->empty()) return true;
  auto it = exec->find(n);
  return it != exec->end() && it->second.should_execute();
}

// the backward moments of one module call over the nodes of its tensors (capture/modules.py
// _on_first_grad / _on_all_grads)
struct Group {
  int32_t path;
  bool all;                                           // all gradients (its end) or the first (its start)
  std::vector<c10::weak_intrusive_ptr<Node>> nodes;  // weak: a hook must not keep its graph alive
  std::vector<std::pair<int, int>> seen;              // backward pass -> (first: 1 ran; all: nodes still to run)
};

void fire(Group& g) {
  int gid = torch::autograd::get_current_graph_task_id();
  if (!g.all) {
    std::lock_guard<std::mutex> lk(mt_mu);
    for (auto& s : g.seen)
      if (s.first == gid) return;
    g.seen.emplace_back(gid, 1);
    enter_locked(g.path);
    return;
  }
  if (g.nodes.size() == 1) {
    std::lock_guard<std::mutex> lk(mt_mu);
    pop_locked(tid(), g.path, BWD);
    return;
  }
  std::lock_guard<std::mutex> lk(mt_mu);
  auto it = std::find_if(g.seen.begin(), g.seen.end(), [gid](const std::pair<int, int>& s) { return s.first == gid; });
  int runs = 0;  // nodes of the call still to run in this pass: which run is known once the pass runs
  if (it != g.seen.end()) {
    runs = it->second;
  } else {
    for (auto& w : g.nodes) {
      auto n = w.lock();
      if (n && will_run(n.get())) ++runs;
    }
  }
  if (runs <= 1) {
    if (it != g.seen.end()) g.seen.erase(it);
    pop_locked(tid(), g.path, BWD);
  } else if (it != g.seen.end()) {
    it->second = runs - 1;
  } else {
    g.seen.emplace_back(gid, runs - 1);
  }
}

struct Hook final : torch::autograd::FunctionPreHook {
  std::shared_ptr<Group> g;
  explicit Hook(std::shared_ptr<Group> g_) : g(std::move(g_)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (on.load(std::memory_order_relaxed)) {
      try {
        fire(*g);
      } catch (...) {  // never the program's backward
      }
    }
    return grads;
  }
  // compiled autograd traces only the hooks it knows: ours are left out of its graph (no backward
  // marks there) rather than failing the program's backward
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs&) const override {}
};

// the tensors that require grad in a module's inputs or outputs (tuples, lists, dicts, 3 levels)
void grad_tensors(PyObject* o, std::vector<PyObject*>& out, int level) {
  if (THPVariable_Check(o)) {
    if (THPVariable_Unpack(o).requires_grad()) out.push_back(o);
  } else if (level < 3) {
    if (PyTuple_Check(o)) {
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o); ++i) grad_tensors(PyTuple_GET_ITEM(o, i), out, level + 1);
    } else if (PyList_Check(o)) {
      for (Py_ssize_t i = 0; i < PyList_GET_SIZE(o); ++i) grad_tensors(PyList_GET_ITEM(o, i), out, level + 1);
    } else if (PyDict_Check(o)) {
      PyObject *k, *v;
      Py_ssize_t pos = 0;
      while (PyDict_Next(o, &pos, &k, &v)) grad_tensors(v, out, level + 1);
    }
  }
}

// hooks for one module call's backward moment; false with a Python error set
bool on_grads(const std::vector<PyObject*>& tensors, int32_t path, bool all) {
  std::vector<Node*> raw;
  auto g = std::make_shared<Group>();
  g->path = path;
  g->all = all;
  for (PyObject* o : tensors) {
    const auto& fn = THPVariable_Unpack(o).grad_fn();
    if (!fn) {  // a leaf: its gradient is accumulated, the multi-grad hook (Python) sees it
      if (leaf == nullptr) return true;
      PyObject* lst = PyList_New((Py_ssize_t)tensors.size());
      if (lst == nullptr) return false;
      for (size_t i = 0; i < tensors.size(); ++i) {
        Py_INCREF(tensors[i]);
        PyList_SET_ITEM(lst, (Py_ssize_t)i, tensors[i]);
      }
      std::string p;
      {
        std::lock_guard<std::mutex> lk(mt_mu);
        p = paths[path];
      }
      PyObject* r = PyObject_CallFunction(leaf, "Oss", lst, p.c_str(), all ? "all" : "any");
      Py_DECREF(lst);
      Py_XDECREF(r);
      return r != nullptr;
    }
    if (std::find(raw.begin(), raw.end(), fn.get()) == raw.end()) {
      raw.push_back(fn.get());
      g->nodes.emplace_back(fn);
    }
  }
  for (auto& w : g->nodes) {
    auto n = w.lock();
    if (n) n->add_pre_hook(std::make_unique<Hook>(g));
  }
  return true;
}

// path_of's answer for a module call that is not the program's (a backend's graph run where no
// forward runs: a compiled optimizer step under aot_eager): the hooks do nothing for it, not even
// the forwards' depth (it is no forward)
constexpr int32_t NOT_A_MODULE = -3;

// the path id of a module, named by Python the first time (parent: the innermost forward's path)
int32_t path_of(PyObject* module, bool may_name) {
  auto it = known.find(module);
  if (it != known.end()) {
    if (PyWeakref_GetObject(it->second.ref) == module) return it->second.path;
    Py_DECREF(it->second.ref);  // a module that died; another now lives at its address
    known.erase(it);
  }
  if (!may_name || namer == nullptr) return -1;
  std::string parent;
  bool has_parent = false;
  {
    std::lock_guard<std::mutex> lk(mt_mu);
    auto th = threads.find(tid());
    if (th != threads.end())
      for (auto s = th->second.stack.rbegin(); s != th->second.stack.rend(); ++s)
        if ((*s & 1) == FWD) {
          parent = paths[*s >> 1];
          has_parent = true;
          break;
        }
  }
  PyObject* r = has_parent ? PyObject_CallFunction(namer, "Os", module, parent.c_str())
                           : PyObject_CallFunctionObjArgs(namer, module, Py_None, nullptr);
  if (r == nullptr) return -2;
  int32_t id = NOT_A_MODULE;  // the namer's None: kept, so that later calls skip it at once
  if (r != Py_None) {
    const char* text = PyUnicode_AsUTF8(r);
    if (text == nullptr) {
      Py_DECREF(r);
      return -2;
    }
    std::lock_guard<std::mutex> lk(mt_mu);
    id = intern_path_locked(text);
  }
  Py_DECREF(r);
  PyObject* ref = PyWeakref_NewRef(module, nullptr);
  if (ref == nullptr) {  // no weak references: named again at each call (rare: modules have them)
    PyErr_Clear();
    return id;
  }
  if (known.size() > 4096 && known.size() % 4096 == 0) {  // forget the modules that died
    for (auto k = known.begin(); k != known.end();) {
      if (PyWeakref_GetObject(k->second.ref) != k->first) {
        Py_DECREF(k->second.ref);
        k = known.erase(k);
      } else {
        ++k;
      }
    }
  }
  known[module] = {ref, id};
  return id;
}

inline bool in_backward() { return torch::autograd::get_current_graph_task_id() != -1; }

// register_module_forward_pre_hook(mt_pre): hook(module, args)
PyObject* mt_pre(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n < 2 || !on.load(std::memory_order_relaxed)) Py_RETURN_NONE;
  try {
    PyObject* module = a[0];
    int32_t path = path_of(module, true);
    if (path == NOT_A_MODULE) Py_RETURN_NONE;
    if (depth == 0) fwd_first_aid = last_alloc_id() + 1;
    ++depth;
    // a root on this thread, whatever other threads run: a model run by a second thread while the
    // first was inside a forward was never the labeller's root (its weights were temporaries)
    if (thread_depth()++ == 0 && on_root != nullptr) {
      PyObject* r = PyObject_CallFunctionObjArgs(on_root, module, nullptr);
      if (r == nullptr) PyErr_Clear();
      Py_XDECREF(r);
    }
    if (path < 0) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
    bool bw = in_backward();  // a forward run again inside backward (checkpointing) serves the backward
    {
      std::lock_guard<std::mutex> g(mt_mu);
      push_locked(tid(), path, bw ? BWD : FWD);
    }
    if (!bw && c10::GradMode::is_enabled()) {
      std::vector<PyObject*> ins;
      grad_tensors(a[1], ins, 0);
      if (!ins.empty() && !on_grads(ins, path, true)) PyErr_Clear();  // else it ends with the backward pass
    }
  } catch (...) {
    PyErr_Clear();
  }
  Py_RETURN_NONE;
}

// register_module_forward_hook(mt_post, always_call=True): hook(module, args, output)
PyObject* mt_post(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n < 3) Py_RETURN_NONE;
  try {
    int32_t path = path_of(a[0], false);
    if (path == NOT_A_MODULE) Py_RETURN_NONE;
    if (depth > 0) --depth;
    if (thread_depth() > 0) --thread_depth();
    if (path < 0) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
    bool bw = in_backward();
    {
      std::lock_guard<std::mutex> g(mt_mu);
      pop_locked(tid(), path, bw ? BWD : FWD);
    }
    if (!bw && c10::GradMode::is_enabled() && on.load(std::memory_order_relaxed)) {
      std::vector<PyObject*> outs;
      grad_tensors(a[2], outs, 0);
      if (!outs.empty() && !on_grads(outs, path, false)) PyErr_Clear();
    }
  } catch (...) {
    PyErr_Clear();
  }
  Py_RETURN_NONE;
}

// the labeller's saved-tensor pack hook (capture/owners.py NativeLabeler._pack): a plain tensor's
// block is noted as saved for backward when the forward pass made it (an autograd result, or a
// block allocated inside the running outermost forward); other tensors go to the Python hook
PyObject* mt_pack(PyObject*, PyObject* t) {
  Py_INCREF(t);
  if (!on.load(std::memory_order_relaxed)) return t;
  if (!THPVariable_CheckExact(t)) {
    if (pack_py != nullptr) {
      PyObject* r = PyObject_CallFunctionObjArgs(pack_py, t, nullptr);
      if (r == nullptr) PyErr_Clear();
      Py_XDECREF(r);
    }
    return t;
  }
  try {  // a C++ exception must not cross into the interpreter
    const at::Tensor& x = THPVariable_Unpack(t);
    const void* data = cpu_data(x);
    if (data == nullptr) return t;
    int64_t aid = counted_ids({data})[0];
    int64_t first = depth > 0 ? fwd_first_aid : -1;
    if (aid >= 0 && ((bool)x.grad_fn() || (first >= 0 && aid >= first))) {
      std::lock_guard<std::mutex> g(mu);
      saved_aids.push_back(aid);
    }
  } catch (...) {
  }
  return t;
}

PyObject* mt_unpack(PyObject*, PyObject* t) {
  Py_INCREF(t);
  return t;
}

PyMethodDef defs[] = {
    {"mt_pre", (PyCFunction)(void (*)(void))mt_pre, METH_FASTCALL, "the module forward pre-hook"},
    {"mt_post", (PyCFunction)(void (*)(void))mt_post, METH_FASTCALL, "the module forward hook"},
    {"mt_pack", (PyCFunction)mt_pack, METH_O, "the saved-tensor pack hook"},
    {"mt_unpack", (PyCFunction)mt_unpack, METH_O, "the saved-tensor unpack hook"},
    {nullptr, nullptr, 0, nullptr}};

void set_callable(PyObject*& slot, py::object v) {
  PyObject* old = slot;
  slot = v.is_none() ? nullptr : v.inc_ref().ptr();
  Py_XDECREF(old);
}

// the module tracker's callables (capture/modules.py)
void mt_setup(py::object namer_, py::object leaf_) {
  set_callable(namer, namer_);
  set_callable(leaf, leaf_);
  if (str_fwd == nullptr) {
    str_fwd = PyUnicode_InternFromString("forward");
    str_bwd = PyUnicode_InternFromString("backward");
  }
  if (!forked_handlers) {
    forked_handlers = true;
    pthread_atfork(&mt_before_fork, &mt_after_fork_parent, &mt_after_fork_child);
  }
}

// the owner labeller's callables (capture/owners.py NativeLabeler; None: none)
void mt_labeller(py::object on_root_, py::object pack_py_) {
  set_callable(on_root, on_root_);
  set_callable(pack_py, pack_py_);
}

void mt_set_on(bool v) {
  on = v;
  if (!v) reset_depth();
}

// a leaf's multi-grad hook fired (Python): its module's backward begins or ends on this thread
void mt_enter(const std::string& path) {
  std::lock_guard<std::mutex> g(mt_mu);
  enter_locked(intern_path_locked(path));
}

void mt_exit(const std::string& path) {
  std::lock_guard<std::mutex> g(mt_mu);
  pop_locked(tid(), intern_path_locked(path), BWD);
}

// tracing stops: what is still open is closed now (rows made after carry no module)
void mt_close_all() {
  std::lock_guard<std::mutex> g(mt_mu);
  int64_t ts = now_ns();
  for (auto& kv : threads)
    if (!kv.second.stack.empty()) {
      kv.second.stack.clear();
      mark_locked(kv.second, ts, -1);
    }
  reset_depth();
}

PyObject* state_obj(int32_t s) {  // borrowed; the (path, phase) tuple of a state, None for -1
  if (s < 0) return Py_None;
  if ((size_t)s >= state_objs.size()) state_objs.resize((size_t)s + 1, nullptr);
  PyObject*& o = state_objs[(size_t)s];
  if (o == nullptr) {
    const std::string& p = paths[(size_t)(s >> 1)];
    PyObject* text = PyUnicode_FromStringAndSize(p.data(), (Py_ssize_t)p.size());
    if (text == nullptr) throw py::error_already_set();
    PyObject* ph = (s & 1) == BWD ? str_bwd : str_fwd;
    Py_INCREF(ph);
    o = PyTuple_Pack(2, text, ph);
    Py_DECREF(text);
    Py_DECREF(ph);
    if (o == nullptr) throw py::error_already_set();
  }
  return o;
}

// ({tid: ([ts, ...], [state, ...])}, {tid: state before its first mark}): ModuleTracker's marks
// and base, as the Python tracker keeps them (state: (path, phase) or None)
py::tuple mt_marks() {
  std::vector<std::pair<uint64_t, Thread>> copy;
  {
    std::lock_guard<std::mutex> g(mt_mu);
    copy.reserve(threads.size());
    for (auto& kv : threads) {
      Thread t;
      t.ts = kv.second.ts;
      t.st = kv.second.st;
      t.base = kv.second.base;
      copy.emplace_back(kv.first, std::move(t));
    }
  }
  py::dict marks, base;
  for (auto& kv : copy) {
    py::int_ key(kv.first);
    if (!kv.second.ts.empty()) {
      py::list ts(kv.second.ts.size()), st(kv.second.st.size());
      for (size_t i = 0; i < kv.second.ts.size(); ++i) {
        ts[i] = py::int_(kv.second.ts[i]);
        st[i] = py::reinterpret_borrow<py::object>(state_obj(kv.second.st[i]));
      }
      marks[key] = py::make_tuple(ts, st);
    }
    if (kv.second.base >= 0) base[key] = py::reinterpret_borrow<py::object>(state_obj(kv.second.base));
  }
  return py::make_tuple(marks, base);
}

// marks older than `cut` fold into each thread's base state (ModuleTracker._prune)
void mt_prune(int64_t cut) {
  std::lock_guard<std::mutex> g(mt_mu);
  for (auto& kv : threads) {
    Thread& t = kv.second;
    size_t k = (size_t)(std::lower_bound(t.ts.begin(), t.ts.end(), cut) - t.ts.begin());
    if (k) {
      t.base = t.st[k - 1];
      t.ts.erase(t.ts.begin(), t.ts.begin() + (std::ptrdiff_t)k);
      t.st.erase(t.st.begin(), t.st.begin() + (std::ptrdiff_t)k);
    }
  }
}

// the allocation ids the pack hook noted since the last call
py::list mt_take_saved() {
  std::vector<int64_t> got;
  {
    std::lock_guard<std::mutex> g(mu);
    got.swap(saved_aids);
  }
  py::list out(got.size());
  for (size_t i = 0; i < got.size(); ++i) out[i] = py::int_(got[i]);
  return out;
}

py::tuple mt_forward() {  // (depth, first allocation id of the outermost forward or -1)
  return py::make_tuple(depth, fwd_first_aid);
}

// a new tracker (tests; a session started again in a forked child): nothing open, no marks
void mt_reset() {
  std::lock_guard<std::mutex> g(mt_mu);
  threads.clear();
  callback_queued = false;
  reset_depth();
}

void add_to(py::module_& m) {
  for (PyMethodDef* d = defs; d->ml_name != nullptr; ++d) {
    PyObject* f = PyCFunction_New(d, nullptr);
    if (f == nullptr) throw py::error_already_set();
    m.attr(d->ml_name) = py::reinterpret_steal<py::object>(f);
  }
  m.def("mt_setup", &mt_setup);
  m.def("mt_labeller", &mt_labeller);
  m.def("mt_set_on", &mt_set_on);
  m.def("mt_enter", &mt_enter);
  m.def("mt_exit", &mt_exit);
  m.def("mt_close_all", &mt_close_all);
  m.def("mt_marks", &mt_marks);
  m.def("mt_prune", &mt_prune);
  m.def("mt_take_saved", &mt_take_saved);
  m.def("mt_forward", &mt_forward);
  m.def("mt_reset", &mt_reset);
}

}  // namespace modtrack
// ================================================================ end of module attribution

// ================================================================ analysis folds (issue 25)
// Generic accumulators the online analyses drive (analysis/decompose.py, analysis/inefficient.py),
// so that no Python runs per row: they read the session's row tuples (events.RawRow order,
// MALLOC/FREE Attr tuples in events.MALLOC_ATTR_M order, or dicts) and know nothing of owners,
// modules or categories, which the analysis gives them through `key_fn`. Nothing here touches the
// recorder above.
//
// Fold: blocks (alloc_id -> key, size) and counters of bytes. A key is what a MALLOC row maps to:
// `key_fn(pool, device, owner, module, phase)` (called once per distinct 5-tuple) returns None
// (the row is not followed) or (counters, gauge, marks): the counters its block's bytes go to, the
// gauge (-1: none) that the row's `used` updates, and the marks that keep the highest `used` seen
// at such a MALLOC. Per counter: cur, peak (highest after a rise, whole run), held (highest in the
// window since `end_window`), since (change since the gauge last rose above its peak, so cur -
// since is the counter at that gauge's peak). A row kind it does not fold (a SYSTEM row of one of
// `stop_types`: owner updates) ends `feed`, which returns its index for the analysis to handle.
namespace fold {

struct Key {
  std::vector<int32_t> ctr;
  int32_t gauge = -1;
  std::vector<int32_t> marks;
};

struct Block {
  int32_t key;
  int64_t size;
  uint64_t gen;  // its gauge's generation at its MALLOC (0: no gauge)
};

// live blocks by allocation id: open addressing (linear probing, deletion by backward shift) in
// one array. A node-based map allocated and freed a node per MALLOC and FREE row of every flush,
// in each of the folds a flush feeds
class AidTable {
 public:
  Block* find(int64_t aid) {
    if (n_ == 0) return nullptr;
    for (size_t i = slot(aid);; i = (i + 1) & mask_) {
      if (!used_[i]) return nullptr;
      if (keys_[i] == aid) return &vals_[i];
    }
  }
  void put(int64_t aid, const Block& b) {
    if ((n_ + 1) * 2 > keys_.size()) grow();
    size_t i = slot(aid);
    for (; used_[i]; i = (i + 1) & mask_)
      if (keys_[i] == aid) {
        vals_[i] = b;
        return;
      }
    used_[i] = 1;
    keys_[i] = aid;
    vals_[i] = b;
    ++n_;
  }
  bool take(int64_t aid, Block* out) {
    if (n_ == 0) return false;
    size_t i = slot(aid);
    for (;; i = (i + 1) & mask_) {
      if (!used_[i]) return false;
      if (keys_[i] == aid) break;
    }
    *out = vals_[i];
    // backward shift: each entry after the hole that may move into it does
    for (size_t j = (i + 1) & mask_; used_[j]; j = (j + 1) & mask_) {
      size_t home = slot(keys_[j]);
      // j's entry stays where its home lies cyclically in (i, j]
      if (i <= j ? (i < home && home <= j) : (i < home || home <= j)) continue;
      keys_[i] = keys_[j];
      vals_[i] = vals_[j];
      i = j;
    }
    used_[i] = 0;
    --n_;
    return true;
  }
  size_t size() const { return n_; }

 private:
  std::vector<int64_t> keys_;
  std::vector<Block> vals_;
  std::vector<uint8_t> used_;
  size_t n_ = 0, mask_ = 0;
  int shift_ = 64;
  size_t slot(int64_t aid) const { return (size_t)(((uint64_t)aid * 0x9E3779B97F4A7C15ULL) >> shift_) & mask_; }
  void grow() {
    size_t cap = keys_.empty() ? 1024 : keys_.size() * 2;
    std::vector<int64_t> ok = std::move(keys_);
    std::vector<Block> ov = std::move(vals_);
    std::vector<uint8_t> ou = std::move(used_);
    keys_.assign(cap, 0);
    vals_.assign(cap, Block{});
    used_.assign(cap, 0);
    mask_ = cap - 1;
    shift_ = 64 - __builtin_ctzll((unsigned long long)cap);
    n_ = 0;
    for (size_t i = 0; i < ok.size(); ++i)
      if (ou[i]) put(ok[i], ov[i]);
  }
};

static bool same_str(PyObject* a, PyObject* b) {
  if (a == b) return true;
  if (!PyUnicode_Check(a) || !PyUnicode_Check(b)) return false;
  // two interned strings are one object or unequal (a str subclass is never interned)
  if (PyUnicode_CHECK_INTERNED(a) && PyUnicode_CHECK_INTERNED(b)) return false;
  return PyUnicode_Compare(a, b) == 0;
}

// the interned str of a constant name (the event and pool names rows carry are interned)
static py::object interned(const char* text) {
  PyObject* o = PyUnicode_InternFromString(text);
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

// an int item or "none" (None, or not an int)
static bool as_i64(PyObject* o, int64_t* v) {
  if (o == nullptr || o == Py_None || !PyLong_Check(o)) return false;
  *v = PyLong_AsLongLong(o);
  if (*v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

static PyObject* dict_item(PyObject* d, const char* k) {  // borrowed or nullptr
  PyObject* v = PyDict_GetItemString(d, k);
  return v;
}

class Fold {
 public:
  Fold(py::object key_fn, py::tuple stop_types)
      : key_fn_(std::move(key_fn)), stop_types_(std::move(stop_types)),
        // interned, as the rows' event names are (Python's literals): a match is the same object
        malloc_(interned("MALLOC")), free_(interned("FREE")), system_(interned("SYSTEM")) {}

  // Fold rows[start:] until a row it leaves to the analysis: its index, or len(rows).
  Py_ssize_t feed(py::sequence rows, Py_ssize_t start) {
    PyObject* seq = PySequence_Fast(rows.ptr(), "rows: a sequence");
    if (seq == nullptr) throw py::error_already_set();
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t i = start;
    try {
      for (; i < n; ++i) {
        PyObject* r = items[i];
        if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) < 8) continue;
        PyObject* ev = PyTuple_GET_ITEM(r, 0);
        if (same_str(ev, malloc_.ptr())) {
          on_malloc(r);
        } else if (same_str(ev, free_.ptr())) {
          on_free(r);
        } else if (same_str(ev, system_.ptr())) {
          PyObject* et = PyTuple_GET_ITEM(r, 1);
          bool stop = false;
          for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(stop_types_.ptr()); ++j)
            if (same_str(et, PyTuple_GET_ITEM(stop_types_.ptr(), j))) stop = true;
          if (stop) break;
        }
      }
    } catch (...) {
      Py_DECREF(seq);
      throw;
    }
    Py_DECREF(seq);
    return i;
  }

  // ``feed`` of the MALLOC/FREE/STEP rows of a flush taken as columns (the native source's
  // take_packed: the leak columns, and (module codes, phase codes) beside them in the same strings),
  // from row ``start``: stops at a STEP row (its index; the analysis ends the step), else the count.
  // With no row tuple: the records of a flush whose labels were given as they were taken.
  Py_ssize_t feed_columns(py::tuple cols, py::tuple mods, Py_ssize_t start) {
    enum { ID, EV, ET, NAME, TID, DEV, AID, ADDR, SIZE, USED, OWNER, STACK, NCOLS };
    if (cols.size() != NCOLS || mods.size() != 2) throw py::value_error("feed_columns: 12 columns and 2");
    auto bytes_of = [](py::handle col, size_t width, Py_ssize_t* n) -> const char* {
      PyObject* b = PyTuple_Check(col.ptr()) ? PyTuple_GET_ITEM(col.ptr(), 0) : col.ptr();
      if (!PyBytes_Check(b)) throw py::type_error("feed_columns: a column is bytes");
      *n = PyBytes_GET_SIZE(b) / (Py_ssize_t)width;
      return PyBytes_AS_STRING(b);
    };
    Py_ssize_t n = 0;
    bytes_of(cols[ID], 8, &n);
    PyObject* values = PyTuple_GET_ITEM(cols[EV].ptr(), 1);
    if (!PyList_Check(values)) throw py::type_error("feed_columns: the strings are a list");
    auto u32 = [&](py::handle c) {  // a code column, at least as long as the rows
      Py_ssize_t k = 0;
      const uint32_t* p = (const uint32_t*)bytes_of(c, 4, &k);
      if (k < n) throw py::value_error("feed_columns: short column");
      return p;
    };
    auto i64 = [&](py::handle c) {  // a number column, likewise
      Py_ssize_t k = 0;
      const int64_t* p = (const int64_t*)bytes_of(c, 8, &k);
      if (k < n) throw py::value_error("feed_columns: short column");
      return p;
    };
    const uint32_t *ev = u32(cols[EV]), *et = u32(cols[ET]), *dev = u32(cols[DEV]), *own = u32(cols[OWNER]);
    const uint32_t *mod = u32(mods[0]), *ph = u32(mods[1]);
    const int64_t *aid = i64(cols[AID]), *size = i64(cols[SIZE]), *used = i64(cols[USED]);
    const Py_ssize_t nv = PyList_GET_SIZE(values);
    auto text = [&](uint32_t c) -> PyObject* {  // borrowed; None for no string
      if (c == 0xffffffffu) return Py_None;
      if ((Py_ssize_t)c >= nv) throw py::value_error("feed_columns: a code past the strings");
      return PyList_GET_ITEM(values, (Py_ssize_t)c);
    };
    Py_ssize_t i = start;
    for (; i < n; ++i) {
      PyObject* e = text(ev[i]);
      if (same_str(e, malloc_.ptr())) {
        malloc_row(aid[i], size[i], true, used[i], text(et[i]), text(dev[i]), text(own[i]), text(mod[i]), text(ph[i]));
      } else if (same_str(e, free_.ptr())) {
        rows_ += 1;
        free_row(aid[i], true, used[i]);
      } else if (same_str(e, system_.ptr())) {
        break;  // a STEP row (the one SYSTEM row these columns hold)
      }
    }
    return i;
  }

  // a key of the analysis' own (a relabelled block's): no row maps to it
  int32_t add_key(py::sequence ctr, int32_t gauge, py::sequence marks) {
    Key k;
    for (auto c : ctr) k.ctr.push_back(c.cast<int32_t>());
    for (auto m : marks) k.marks.push_back(m.cast<int32_t>());
    k.gauge = gauge;
    return install_key(std::move(k));
  }

  // (key, size) of a live block, or None
  py::object block(int64_t aid) {
    Block* b = blocks_.find(aid);
    if (b == nullptr) return py::none();
    return py::make_tuple(b->key, b->size);
  }

  // move a live block's bytes to another key (an owner update). `at_peak`: where the block was
  // live at its gauge's peak (made before it rose there, or before the window began), the move
  // counts there too (its `since` is left alone): the block was what the update says it is
  bool rekey(int64_t aid, int32_t key, bool at_peak) {
    Block* b = blocks_.find(aid);
    if (b == nullptr || key < 0 || key >= (int32_t)keys_.size()) return false;
    int32_t g = keys_[(size_t)b->key].gauge;
    bool back = at_peak && g >= 0 && b->gen != g_gen_[g];
    move(b->key, -b->size, back);
    b->key = key;
    move(key, b->size, back);
    return true;
  }

  // rows counted since the last call: MALLOC rows with an id and a size, every FREE row
  int64_t take_rows() {
    int64_t r = rows_;
    rows_ = 0;
    return r;
  }

  // per counter (list index = counter id): (cur, peak or None, held or None, since, moved yet,
  // the order held values were first set in since the window began)
  py::tuple counters() {
    size_t n = cur_.size();
    py::list cur(n), peak(n), held(n), since(n), made(n), order(n);
    for (size_t c = 0; c < n; ++c) {
      cur[c] = py::int_(cur_[c]);
      peak[c] = has_peak_[c] ? py::object(py::int_(peak_[c])) : py::none();
      held[c] = has_held_[c] ? py::object(py::int_(held_[c])) : py::none();
      int32_t g = gauge_of_[c];
      since[c] = py::int_(g >= 0 && since_gen_[c] == g_gen_[g] ? since_[c] : 0);
      made[c] = py::bool_(made_[c] != 0);
      order[c] = py::int_(held_seq_[c]);
    }
    return py::make_tuple(cur, peak, held, since, made, order);
  }

  // per gauge: (used or None, peak or None); per mark: highest used or None
  py::tuple gauges() {
    size_t n = g_used_.size();
    py::list used(n), peak(n);
    for (size_t g = 0; g < n; ++g) {
      used[g] = g_has_used_[g] ? py::object(py::int_(g_used_[g])) : py::none();
      peak[g] = g_has_peak_[g] ? py::object(py::int_(g_peak_[g])) : py::none();
    }
    py::list marks(mark_.size());
    for (size_t m = 0; m < mark_.size(); ++m)
      marks[m] = has_mark_[m] ? py::object(py::int_(mark_[m])) : py::none();
    return py::make_tuple(used, peak, marks);
  }

  // a new window (a step): held = cur (where not 0), since reset, each gauge's peak = its used,
  // marks cleared
  void end_window() {
    for (size_t c = 0; c < cur_.size(); ++c) {
      held_[c] = cur_[c];
      has_held_[c] = cur_[c] != 0;
      if (has_held_[c]) held_seq_[c] = ++seq_;
    }
    for (size_t g = 0; g < g_gen_.size(); ++g) {
      g_gen_[g] = ++gen_;
      if (g_has_peak_[g]) g_peak_[g] = g_has_used_[g] ? g_used_[g] : 0;
    }
    std::fill(has_mark_.begin(), has_mark_.end(), 0);
  }

  size_t live() const { return blocks_.size(); }

 private:
  py::object key_fn_;
  py::tuple stop_types_;
  py::object malloc_, free_, system_;
  py::dict cache_;  // (pool, device, owner, module, phase) -> key id (-1: not followed)
  std::vector<Key> keys_;
  AidTable blocks_;
  std::vector<int64_t> cur_, peak_, held_, since_;
  std::vector<uint64_t> since_gen_;
  std::vector<uint8_t> has_peak_, has_held_, made_;
  std::vector<int32_t> gauge_of_;
  std::vector<int64_t> g_used_, g_peak_;
  std::vector<uint64_t> g_gen_;
  std::vector<uint8_t> g_has_used_, g_has_peak_;
  std::vector<int64_t> mark_;
  std::vector<uint8_t> has_mark_;
  std::vector<uint64_t> held_seq_;  // the order counters got a held value in (a dict's order)
  uint64_t gen_ = 0, seq_ = 0;
  int64_t rows_ = 0;

  int32_t install_key(Key k) {
    for (int32_t c : k.ctr) {
      if (c < 0) throw std::invalid_argument("counter id < 0");
      if ((size_t)c >= cur_.size()) {
        size_t m = (size_t)c + 1;
        cur_.resize(m, 0); peak_.resize(m, 0); held_.resize(m, 0); since_.resize(m, 0);
        since_gen_.resize(m, 0); has_peak_.resize(m, 0); has_held_.resize(m, 0); made_.resize(m, 0);
        gauge_of_.resize(m, -1);
        held_seq_.resize(m, 0);
      }
      gauge_of_[c] = k.gauge;
    }
    if (k.gauge >= 0 && (size_t)k.gauge >= g_used_.size()) {
      size_t m = (size_t)k.gauge + 1;
      g_used_.resize(m, 0); g_peak_.resize(m, -1); g_gen_.resize(m, 0);
      g_has_used_.resize(m, 0); g_has_peak_.resize(m, 0);
      for (size_t g = 0; g < m; ++g)
        if (g_gen_[g] == 0) g_gen_[g] = ++gen_;
    }
    for (int32_t mk : k.marks) {
      if (mk < 0) throw std::invalid_argument("mark id < 0");
      if ((size_t)mk >= mark_.size()) {
        mark_.resize((size_t)mk + 1, -1);
        has_mark_.resize((size_t)mk + 1, 0);
      }
    }
    keys_.push_back(std::move(k));
    return (int32_t)keys_.size() - 1;
  }

  // the rows of a flush mostly share their strings (the same objects): a map by the objects'
  // addresses finds their key without a tuple and its hash; its entries keep those objects alive
  // (`fast_refs_`), so an address in it never names another object
  struct Ptrs {
    PyObject* p[5];
    bool operator==(const Ptrs& o) const {
      for (int j = 0; j < 5; ++j)
        if (p[j] != o.p[j]) return false;
      return true;
    }
  };
  struct PtrsHash {
    size_t operator()(const Ptrs& k) const {
      size_t h = 1469598103934665603ULL;
      for (int j = 0; j < 5; ++j) h = (h ^ (size_t)k.p[j]) * 1099511628211ULL;
      return h;
    }
  };
  std::unordered_map<Ptrs, int32_t, PtrsHash> fast_;
  std::vector<py::object> fast_refs_;

  int32_t key_of(PyObject* pool, PyObject* dev, PyObject* owner, PyObject* module, PyObject* phase) {
    Ptrs pk{{pool, dev, owner, module, phase}};
    auto hit_fast = fast_.find(pk);
    if (hit_fast != fast_.end()) return hit_fast->second;
    int32_t id = key_by_value(pool, dev, owner, module, phase);
    if (fast_.size() >= 65536) {  // a stream of ever new strings: start over (the dict still has them)
      fast_.clear();
      fast_refs_.clear();
    }
    fast_refs_.push_back(py::make_tuple(py::reinterpret_borrow<py::object>(pool), py::reinterpret_borrow<py::object>(dev),
                                   py::reinterpret_borrow<py::object>(owner),
                                   py::reinterpret_borrow<py::object>(module),
                                   py::reinterpret_borrow<py::object>(phase)));
    fast_.emplace(pk, id);
    return id;
  }

  int32_t key_by_value(PyObject* pool, PyObject* dev, PyObject* owner, PyObject* module, PyObject* phase) {
    PyObject* t = PyTuple_Pack(5, pool, dev, owner, module, phase);
    if (t == nullptr) throw py::error_already_set();
    PyObject* hit = PyDict_GetItemWithError(cache_.ptr(), t);
    if (hit != nullptr) {
      long v = PyLong_AsLong(hit);
      Py_DECREF(t);
      return (int32_t)v;
    }
    if (PyErr_Occurred()) {
      Py_DECREF(t);
      throw py::error_already_set();
    }
    int32_t id = -1;
    try {
      py::object spec = key_fn_(py::reinterpret_borrow<py::object>(pool), py::reinterpret_borrow<py::object>(dev),
                                py::reinterpret_borrow<py::object>(owner), py::reinterpret_borrow<py::object>(module),
                                py::reinterpret_borrow<py::object>(phase));
      if (!spec.is_none()) {
        py::tuple st = spec.cast<py::tuple>();
        Key k;
        for (auto c : st[0]) k.ctr.push_back(c.cast<int32_t>());
        k.gauge = st[1].cast<int32_t>();
        for (auto m : st[2]) k.marks.push_back(m.cast<int32_t>());
        id = install_key(std::move(k));
      }
    } catch (...) {
      Py_DECREF(t);
      throw;
    }
    PyObject* v = PyLong_FromLong(id);
    int bad = v == nullptr || PyDict_SetItem(cache_.ptr(), t, v) < 0;
    Py_XDECREF(v);
    Py_DECREF(t);
    if (bad) throw py::error_already_set();
    return id;
  }

  void move(int32_t key, int64_t n, bool at_peak = false) {
    const Key& k = keys_[(size_t)key];
    for (int32_t c : k.ctr) {
      int64_t v = cur_[c] + n;
      cur_[c] = v;
      made_[c] = 1;
      if (n > 0) {
        if (v > (has_peak_[c] ? peak_[c] : 0)) { peak_[c] = v; has_peak_[c] = 1; }
        if (v > (has_held_[c] ? held_[c] : 0)) {
          if (!has_held_[c]) held_seq_[c] = ++seq_;
          held_[c] = v;
          has_held_[c] = 1;
        }
      }
      if (k.gauge >= 0 && !at_peak) {
        uint64_t g = g_gen_[k.gauge];
        if (since_gen_[c] != g) { since_gen_[c] = g; since_[c] = 0; }
        since_[c] += n;
      }
    }
  }

  void on_malloc(PyObject* r) {
    PyObject* a = PyTuple_GET_ITEM(r, 7);
    PyObject *aid_o = nullptr, *size_o = nullptr, *used_o = nullptr, *owner = Py_None, *module = Py_None,
             *phase = Py_None;
    if (PyTuple_Check(a)) {
      Py_ssize_t m = PyTuple_GET_SIZE(a);
      if (m < 6) return;
      aid_o = PyTuple_GET_ITEM(a, 0);
      size_o = PyTuple_GET_ITEM(a, 2);
      used_o = PyTuple_GET_ITEM(a, 3);
      owner = PyTuple_GET_ITEM(a, 5);
      if (m > 6) module = PyTuple_GET_ITEM(a, 6);
      if (m > 7) phase = PyTuple_GET_ITEM(a, 7);
    } else if (PyDict_Check(a) && PyDict_GET_SIZE(a)) {
      aid_o = dict_item(a, "allocation_id");
      size_o = dict_item(a, "size");
      used_o = dict_item(a, "used");
      PyObject* o;
      if ((o = dict_item(a, "owner")) != nullptr) owner = o;
      if ((o = dict_item(a, "module")) != nullptr) module = o;
      if ((o = dict_item(a, "phase")) != nullptr) phase = o;
    } else {
      return;
    }
    int64_t aid, size, used;
    if (!as_i64(aid_o, &aid) || !as_i64(size_o, &size)) return;
    bool has_used = as_i64(used_o, &used);
    malloc_row(aid, size, has_used, used, PyTuple_GET_ITEM(r, 1), PyTuple_GET_ITEM(r, 5), owner, module, phase);
  }

  void malloc_row(int64_t aid, int64_t size, bool has_used, int64_t used, PyObject* pool, PyObject* dev,
                  PyObject* owner, PyObject* module, PyObject* phase) {
    rows_ += 1;
    int32_t key = key_of(pool, dev, owner, module, phase);
    if (key < 0) return;
    const Key& k = keys_[(size_t)key];
    blocks_.put(aid, Block{key, size, k.gauge >= 0 ? g_gen_[k.gauge] : 0});
    move(key, size);
    if (!has_used) return;
    if (k.gauge >= 0) {
      int32_t g = k.gauge;
      g_used_[g] = used;
      g_has_used_[g] = 1;
      if (!g_has_peak_[g] || used > g_peak_[g]) {
        g_peak_[g] = used;
        g_has_peak_[g] = 1;
        g_gen_[g] = ++gen_;  // since: from this peak on
      }
    }
    for (int32_t mk : k.marks)
      if (!has_mark_[mk] || used > mark_[mk]) { mark_[mk] = used; has_mark_[mk] = 1; }
  }

  void on_free(PyObject* r) {
    rows_ += 1;
    PyObject* a = PyTuple_GET_ITEM(r, 7);
    PyObject *aid_o = nullptr, *used_o = nullptr;
    if (PyTuple_Check(a)) {
      Py_ssize_t m = PyTuple_GET_SIZE(a);
      if (m >= 1) aid_o = PyTuple_GET_ITEM(a, 0);
      if (m >= 4) used_o = PyTuple_GET_ITEM(a, 3);
    } else if (PyDict_Check(a)) {
      aid_o = dict_item(a, "allocation_id");
      used_o = dict_item(a, "used");
    }
    int64_t aid, used;
    if (!as_i64(aid_o, &aid)) return;
    bool has_used = as_i64(used_o, &used);
    free_row(aid, has_used, used);
  }

  void free_row(int64_t aid, bool has_used, int64_t used) {
    Block b;
    if (!blocks_.take(aid, &b)) return;
    move(b.key, -b.size);
    int32_t g = keys_[(size_t)b.key].gauge;
    if (g >= 0 && has_used) {
      g_used_[g] = used;
      g_has_used_[g] = 1;
    }
  }
};

// The columns of analysis/inefficient.py's chunk from row tuples, in one pass (its
// chunk_from_rows is the reference): kinds 1 op start, 2 op end, 3 MALLOC, 4 FREE, 5 ACCESS;
// numbers as raw little-endian buffers (int64 pos, int8 kind, int64 alloc_id + uint8 valid,
// int64 size + uint8 valid, int8 before: -1 none); op names and stacks as int32 codes (-1: none)
// into a list of the distinct strings of this call (a batch has few distinct names and stacks).
py::tuple chunk_columns(py::sequence rows, int64_t first_id, py::tuple skip_pools) {
  PyObject* seq = PySequence_Fast(rows.ptr(), "rows: a sequence");
  if (seq == nullptr) throw py::error_already_set();
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  // interned, as the rows' names are (Python's literals): same_str's mismatches cost no compare
  py::object op_launch = interned("OP_LAUNCH"), aten_start = interned("ATEN_START"),
             aten_end = interned("ATEN_END"), access = interned("ACCESS"), malloc_s = interned("MALLOC"),
             free_s = interned("FREE");
  std::string pos, kind, aid, aid_ok, size, size_ok, before, name_codes, stack_codes;
  py::list names, stacks;     // the distinct strings
  py::dict name_ids, stack_ids;
  auto code_of = [](PyObject* o, py::dict& ids, py::list& uniq) -> int32_t {
    if (o == nullptr || !PyUnicode_Check(o)) return -1;
    PyObject* hit = PyDict_GetItemWithError(ids.ptr(), o);
    if (hit != nullptr) return (int32_t)PyLong_AsLong(hit);
    if (PyErr_Occurred()) throw py::error_already_set();
    int32_t c = (int32_t)PyList_GET_SIZE(uniq.ptr());
    PyObject* v = PyLong_FromLong(c);
    if (v == nullptr) throw py::error_already_set();
    int bad = PyDict_SetItem(ids.ptr(), o, v);
    Py_DECREF(v);
    if (bad < 0 || PyList_Append(uniq.ptr(), o) < 0) throw py::error_already_set();
    return c;
  };
  auto put32 = [](std::string& b, int32_t v) { b.append((const char*)&v, 4); };
  auto put64 = [](std::string& b, int64_t v) { b.append((const char*)&v, 8); };
  auto put8 = [](std::string& b, int8_t v) { b.push_back((char)v); };
  auto in_skip = [&](PyObject* et) {
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(skip_pools.ptr()); ++j)
      if (same_str(et, PyTuple_GET_ITEM(skip_pools.ptr(), j))) return true;
    return false;
  };
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* r = items[i];
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) < 9) continue;
    PyObject* ev = PyTuple_GET_ITEM(r, 0);
    PyObject* et = PyTuple_GET_ITEM(r, 1);
    PyObject* at = PyTuple_GET_ITEM(r, 7);
    int8_t k;
    PyObject *a = nullptr, *sz = nullptr, *name = Py_None, *stack = Py_None;
    int8_t bf = -1;
    if (same_str(ev, op_launch.ptr())) {
      if (same_str(et, aten_start.ptr())) {
        k = 1;
        name = PyTuple_GET_ITEM(r, 2);
      } else if (same_str(et, aten_end.ptr())) {
        k = 2;
      } else {
        continue;
      }
    } else if (same_str(ev, access.ptr())) {
      k = 5;
      if (PyTuple_Check(at)) {
        if (PyTuple_GET_SIZE(at) > 3) a = PyTuple_GET_ITEM(at, 3);
      } else if (PyDict_Check(at)) {
        a = dict_item(at, "allocation_id");
      }
    } else if (same_str(ev, malloc_s.ptr()) || same_str(ev, free_s.ptr())) {
      if (in_skip(et)) continue;
      bool is_malloc = same_str(ev, malloc_s.ptr());
      k = is_malloc ? 3 : 4;
      bool b = false;
      if (PyTuple_Check(at)) {
        if (PyTuple_GET_SIZE(at) > 2) {
          a = PyTuple_GET_ITEM(at, 0);
          sz = PyTuple_GET_ITEM(at, 2);
        }
      } else if (PyDict_Check(at)) {
        a = dict_item(at, "allocation_id");
        sz = dict_item(at, "size");
        PyObject* o = dict_item(at, "origin");
        if (o != nullptr && PyUnicode_Check(o) && PyUnicode_CompareWithASCIIString(o, "before_op") == 0) b = true;
      }
      if (is_malloc) {
        name = PyTuple_GET_ITEM(r, 2);
        stack = PyTuple_GET_ITEM(r, 8);
        bf = b ? 1 : 0;
      }
    } else {
      continue;
    }
    int64_t v;
    put64(pos, first_id + (int64_t)i);
    put8(kind, k);
    bool ok = as_i64(a, &v);
    put64(aid, ok ? v : 0);
    put8(aid_ok, ok);
    ok = as_i64(sz, &v);
    put64(size, ok ? v : 0);
    put8(size_ok, ok);
    put8(before, bf);
    put32(name_codes, code_of(name, name_ids, names));
    put32(stack_codes, code_of(stack, stack_ids, stacks));
  }
  Py_DECREF(seq);
  return py::make_tuple(py::bytes(pos), py::bytes(kind), py::bytes(aid), py::bytes(aid_ok), py::bytes(size),
                        py::bytes(size_ok), py::bytes(before), py::bytes(name_codes), names, py::bytes(stack_codes),
                        stacks);
}

// Module attribution at a flush (capture/modules.py ModuleTracker.attribute is the caller and
// the reference, `_attribute_py`): each MALLOC row of `buf` not attributed yet (a 6-item Attr
// tuple, or a dict without "module") gets the state its thread had at its time, the last mark
// (ts <= row ts) in `marks[tid] = (ts list, state list)`, else `base[tid]`; a state is
// (module, phase) or None. `owned[alloc_id]` (the module owning the block) wins over the running
// module; `cats[alloc_id]` gives an unlabelled owned block its owner (`<pool>@<category>`). The
// row is replaced in `buf` by one whose Attr ends with (module, phase). Returns the rows changed.
Py_ssize_t attribute(py::list buf, py::dict marks, py::dict base, py::dict owned, py::dict cats, Py_ssize_t start) {
  std::unordered_map<PyObject*, ThreadMarks> by_tid;  // keyed by the marks found for the tid object
  py::object malloc_s = interned("MALLOC");
  Py_ssize_t changed = 0;
  PyObject* module_key = nullptr;
  PyObject* phase_key = nullptr;
  auto state_of = [&](PyObject* tid, int64_t ts, bool* found) -> PyObject* {
    *found = false;
    PyObject* m = PyDict_GetItemWithError(marks.ptr(), tid);
    if (m == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (m == nullptr || !PyTuple_Check(m) || PyTuple_GET_SIZE(m) < 2) {
      PyObject* b = PyDict_GetItemWithError(base.ptr(), tid);
      if (b == nullptr && PyErr_Occurred()) throw py::error_already_set();
      return b;  // borrowed, may be nullptr (None)
    }
    auto it = by_tid.find(m);
    if (it == by_tid.end()) {
      PyObject* b = PyDict_GetItemWithError(base.ptr(), tid);
      if (b == nullptr && PyErr_Occurred()) throw py::error_already_set();
      it = by_tid.emplace(m, ThreadMarks(m, b)).first;
    }
    return it->second.at(ts);
  };
  Py_ssize_t n = PyList_GET_SIZE(buf.ptr());
  for (Py_ssize_t i = std::max<Py_ssize_t>(start, 0); i < n; ++i) {
    PyObject* r = PyList_GET_ITEM(buf.ptr(), i);
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) < 8 || !same_str(PyTuple_GET_ITEM(r, 0), malloc_s.ptr())) continue;
    PyObject* a = PyTuple_GET_ITEM(r, 7);
    PyObject* aid;
    bool is_tuple = PyTuple_Check(a);
    if (is_tuple) {
      if (PyTuple_GET_SIZE(a) != 6) continue;
      aid = PyTuple_GET_ITEM(a, 0);
    } else if (PyDict_Check(a)) {
      if (PyDict_GetItemString(a, "module") != nullptr) continue;
      aid = PyDict_GetItemString(a, "allocation_id");
      if (aid == nullptr) aid = Py_None;
    } else {
      continue;
    }
    int64_t ts = PyLong_AsLongLong(PyTuple_GET_ITEM(r, 3));
    if (ts == -1 && PyErr_Occurred()) throw py::error_already_set();
    bool found;
    PyObject* state = state_of(PyTuple_GET_ITEM(r, 4), ts, &found);
    if (state == Py_None) state = nullptr;
    PyObject* own = PyDict_GetItemWithError(owned.ptr(), aid);
    if (own == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (own == Py_None) own = nullptr;
    if (state == nullptr && own == nullptr) continue;
    if (state != nullptr && (!PyTuple_Check(state) || PyTuple_GET_SIZE(state) < 2))
      throw std::invalid_argument("a module state is (module, phase)");
    PyObject* mod = own != nullptr ? own : PyTuple_GET_ITEM(state, 0);
    PyObject* phase = state != nullptr ? PyTuple_GET_ITEM(state, 1) : Py_None;
    py::object na;
    if (is_tuple) {
      PyObject* owner = PyTuple_GET_ITEM(a, 5);
      PyObject* cat = nullptr;
      if (own != nullptr && !PyObject_IsTrue(owner)) {
        cat = PyDict_GetItemWithError(cats.ptr(), aid);
        if (cat == nullptr && PyErr_Occurred()) throw py::error_already_set();
      }
      PyObject* t = PyTuple_New(8);
      if (t == nullptr) throw py::error_already_set();
      na = py::reinterpret_steal<py::object>(t);
      for (Py_ssize_t j = 0; j < 5; ++j) {
        PyObject* x = PyTuple_GET_ITEM(a, j);
        Py_INCREF(x);
        PyTuple_SET_ITEM(t, j, x);
      }
      if (cat != nullptr) {
        PyObject* o = PyUnicode_FromFormat("%S@%S", PyTuple_GET_ITEM(r, 1), cat);
        if (o == nullptr) throw py::error_already_set();
        PyTuple_SET_ITEM(t, 5, o);
      } else {
        Py_INCREF(owner);
        PyTuple_SET_ITEM(t, 5, owner);
      }
      Py_INCREF(mod);
      PyTuple_SET_ITEM(t, 6, mod);
      Py_INCREF(phase);
      PyTuple_SET_ITEM(t, 7, phase);
      untrack_if_atomic(t);
    } else {
      PyObject* d = PyDict_Copy(a);
      if (d == nullptr) throw py::error_already_set();
      na = py::reinterpret_steal<py::object>(d);
      if (module_key == nullptr) {
        module_key = PyUnicode_InternFromString("module");
        phase_key = PyUnicode_InternFromString("phase");
      }
      if (PyDict_SetItem(d, module_key, mod) < 0) throw py::error_already_set();
      if (phase != Py_None && PyDict_SetItem(d, phase_key, phase) < 0) throw py::error_already_set();
    }
    PyObject* nr = with_item(r, 7, na.ptr());
    if (nr == nullptr) throw py::error_already_set();
    PyList_SetItem(buf.ptr(), i, nr);  // steals nr, drops the old row
    ++changed;
  }
  Py_XDECREF(module_key);
  Py_XDECREF(phase_key);
  return changed;
}

}  // namespace fold
// ================================================================ end of analysis folds

// ================================================================ a call on every other thread
// The dispatch-mode source follows a thread through a mode on that thread's own stack. At a
// handover (watch() from any thread) the threads already running must get one too: each other
// Python thread gets a one-shot profile function that, at its next Python-level event, puts the
// thread's previous profile function back and calls `fn` there, in that thread. Python 3.11 has no
// public way to run code in another thread (3.12's PyEval_SetProfileAllThreads sets, not once).
namespace oneshot {

struct Saved {
  Py_tracefunc func;
  PyObject* obj;  // owned
};
static std::unordered_map<PyThreadState*, Saved> saved;  // under the GIL
static PyObject* callback = nullptr;                       // owned; one at a time

#if PY_VERSION_HEX < 0x030D0000
static int profile(PyObject* obj, PyFrameObject* frame, int what, PyObject* arg) {
  PyThreadState* ts = PyThreadState_Get();
  Py_tracefunc old_func = nullptr;
  PyObject* old_obj = nullptr;
  auto it = saved.find(ts);
  if (it != saved.end()) {
    old_func = it->second.func;
    old_obj = it->second.obj;
    saved.erase(it);
  }
  Py_XINCREF(obj);  // SetProfile below drops the thread's reference to it
  if (_PyEval_SetProfile(ts, old_func, old_obj) < 0) PyErr_Clear();
  Py_XDECREF(old_obj);  // the thread holds its own reference again
  if (obj != nullptr) {
    PyObject* r = PyObject_CallNoArgs(obj);
    if (r == nullptr) PyErr_Clear();  // never an exception of ours in the program's thread
    Py_XDECREF(r);
    Py_DECREF(obj);
  }
  // the program's own profiler (if any) sees this event as it would have
  if (old_func != nullptr) return old_func(old_obj, frame, what, arg);
  return 0;
}
#endif

// arm every Python thread but the calling one; returns how many (-1: not on this Python)
int on_other_threads(py::object fn) {
#if PY_VERSION_HEX >= 0x030D0000
  (void)fn;
  return -1;  // the profile fields and _PyEval_SetProfile moved: not followed there
#else
  PyThreadState* me = PyThreadState_Get();
  Py_XDECREF(callback);
  callback = fn.ptr();
  Py_INCREF(callback);
  int n = 0;
  for (PyThreadState* ts = PyInterpreterState_ThreadHead(me->interp); ts != nullptr; ts = PyThreadState_Next(ts)) {
    if (ts == me || saved.count(ts) || ts->c_profilefunc == profile) continue;
    Saved sv{ts->c_profilefunc, ts->c_profileobj};
    Py_XINCREF(sv.obj);
    if (_PyEval_SetProfile(ts, profile, callback) < 0) {
      PyErr_Clear();
      Py_XDECREF(sv.obj);
      continue;
    }
    saved[ts] = sv;
    ++n;
  }
  return n;
#endif
}

}  // namespace oneshot

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("on_other_threads", &oneshot::on_other_threads);
  m.def("relabel_mallocs", &relabel_mallocs);
  m.def("label_live", &label_live);
  m.def("set_owner_tag", &set_owner_tag);
  m.def("take_tagged", &take_tagged);
  m.def("last_alloc_id", &last_alloc_id);
  m.def("install", &install);
  m.def("set_drain_at", &set_drain_at);
  m.def("uninstall", &uninstall, py::arg("keep_allocator") = false);
  m.def("set_flags", &set_flags);
  m.def("step_end", &step_end);
  m.def("drain", &drain, py::arg("out"), py::arg("names"), py::arg("want_bytes") = false,
        py::arg("labels") = py::none());
  m.def("take_packed", &take_packed, py::arg("first"), py::arg("names"), py::arg("buf"), py::arg("wants") = (int)PACK_LEAK,
        py::arg("labels") = py::none());
  m.def("waiting_free_ids", &waiting_free_ids);
  m.def("counters", &counters);
  m.def("reset_peak", &reset_peak);
  m.def("live_alloc_ids", &live_alloc_ids);
  m.def("handover", &handover);
  m.def("account", &account);
  m.def("counted_block", &counted_block);
  m.def("block_ids", &block_ids);
  m.def("live_categories", &live_categories);
  m.def("owning_modules", &owning_modules);
  m.def("live_walks", &live_walks);
  m.def("reset", &reset);
  // analysis folds (issue 25)
  py::class_<fold::Fold>(m, "Fold")
      .def(py::init<py::object, py::tuple>(), py::arg("key_fn"), py::arg("stop_types"))
      .def("feed", &fold::Fold::feed, py::arg("rows"), py::arg("start") = 0)
      .def("feed_columns", &fold::Fold::feed_columns, py::arg("cols"), py::arg("mods"), py::arg("start") = 0)
      .def("add_key", &fold::Fold::add_key)
      .def("block", &fold::Fold::block)
      .def("rekey", &fold::Fold::rekey, py::arg("aid"), py::arg("key"), py::arg("at_peak") = false)
      .def("take_rows", &fold::Fold::take_rows)
      .def("counters", &fold::Fold::counters)
      .def("gauges", &fold::Fold::gauges)
      .def("end_window", &fold::Fold::end_window)
      .def("live", &fold::Fold::live);
  m.def("chunk_columns", &fold::chunk_columns);
  m.def("attribute", &fold::attribute, py::arg("buf"), py::arg("marks"), py::arg("base"), py::arg("owned"),
        py::arg("cats"), py::arg("start") = 0);
  modtrack::add_to(m);  // module attribution (issue 25)
}
