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
// Records go into one vector under a mutex; Python drains it (at step boundaries, before each
// Python-side row so that the order holds, and from the op exit when it grows past a bound)
// into row tuples shaped like the Python source's.
#include <torch/extension.h>
#include <ATen/record_function.h>
#include <c10/core/CPUAllocator.h>
#include <Python.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

// FREE_UNTRACED: a counted block freed while the session does not record (stopped, or a step
// outside --steps): its FREE row is still written, flagged, so that `used` stays the running sum.
enum Kind : int32_t { OP_START = 0, OP_END = 1, MALLOC = 2, FREE = 3, ALLOC_FAILED = 4, FREE_UNTRACED = 5 };

struct Rec {
  int64_t ts;
  uint64_t tid;
  uint64_t ptr;
  int64_t size;
  int64_t used;
  int64_t aid;
  int32_t kind;
  int32_t op;  // index into op names, -1 outside any op
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
std::unordered_map<void*, Block>& live = *new std::unordered_map<void*, Block>();
// op names. A dispatcher op's name and overload strings live in its schema for the process's
// life, so their pointers key a cache; the text map gives one index per name whatever the
// pointers (an op registered again after a library reload).
std::unordered_map<const char*, std::unordered_map<const char*, int32_t>>& op_index =
    *new std::unordered_map<const char*, std::unordered_map<const char*, int32_t>>();
std::unordered_map<std::string, int32_t>& op_index_by_text = *new std::unordered_map<std::string, int32_t>();
std::vector<std::string>& op_names = *new std::vector<std::string>();  // "torch._ops.aten.add.Tensor"
std::vector<PyObject*>& op_strs = *new std::vector<PyObject*>();  // Python names made so far

std::atomic<bool> recording{false};   // ops tracked, allocation failures noted
// count: new blocks are counted (their MALLOC row is in the dump when emit_alloc); emit_free: a
// counted block's free is recorded as traced; free_untraced: otherwise it is recorded flagged.
bool count_new = false, emit_alloc = false, emit_free = false, free_untraced = false, emit_launch = false;
// top-level ops whose OP_START was recorded and whose OP_END is not yet: thread -> op. Closed (an
// OP_END recorded now) when the source stops or hands over, so a dump never has an op left open.
std::unordered_map<uint64_t, int32_t>& in_flight = *new std::unordered_map<uint64_t, int32_t>();
bool draining = false;                // one drain() at a time (building tuples may run Python)
// The session went over to the dispatch-mode source (watch, owner labels): this source only
// records the frees of the blocks it counted, and keeps the one bytes-in-use counter.
bool handed_over = false;
int64_t used_bytes = 0, peak_bytes = 0, next_aid = 0;
size_t drain_at = 1 << 16;            // records before the op exit asks Python to drain
PyObject* on_full = nullptr;          // Python callable: drain now
at::CallbackHandle handle = 0;
int alloc_priority = 100;

thread_local int nest = 0;         // RecordFunctions (FUNCTION scope) open on this thread
thread_local int top_nest = 0;     // the nesting level of the top-level op, 0 when none runs
thread_local int32_t top_op = -1;  // its name index
thread_local bool in_drain_call = false;

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
  int32_t i = t != op_index_by_text.end() ? t->second : (op_index_by_text[text] = add_name(text));
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

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  ++nest;
  if (top_nest != 0 || !recording.load(std::memory_order_relaxed)) return nullptr;  // inside an op
  std::lock_guard<std::mutex> g(mu);
  int32_t op = intern(fn);
  if (op < 0) return nullptr;
  top_nest = nest;
  top_op = op;
  if (emit_launch) {
    uint64_t t = tid();
    recs.push_back({now_ns(), t, 0, 0, 0, 0, OP_START, op});
    in_flight[t] = op;
  }
  return nullptr;
}

void on_exit(const at::RecordFunction& fn, at::ObserverContext*) {
  if (nest-- != top_nest) return;
  int32_t op = top_op;
  top_nest = 0;
  top_op = -1;
  bool ask = false;
  {
    std::lock_guard<std::mutex> g(mu);
    // the OP_END of an op whose OP_START is recorded, whatever the flags are now (a step
    // boundary on another thread); none when stop()/handover() closed it already
    if (!in_flight.empty()) {
      auto it = in_flight.find(tid());
      if (it != in_flight.end()) {
        recs.push_back({now_ns(), it->first, 0, 0, 0, 0, OP_END, op});
        in_flight.erase(it);
      }
    }
    ask = recs.size() >= drain_at;
  }
  if (ask) maybe_ask_drain();
}

void traced_delete(void* data) {
  Block b;
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = live.find(data);
    if (it == live.end()) return;  // not ours: nothing we may call
    b = it->second;
    live.erase(it);
    if (b.counted) {
      used_bytes -= b.size;
      if (emit_free)
        recs.push_back({now_ns(), tid(), (uint64_t)data, b.size, used_bytes, b.aid, FREE, top_op});
      else if (free_untraced)
        recs.push_back({now_ns(), tid(), (uint64_t)data, b.size, used_bytes, b.aid, FREE_UNTRACED, -1});
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
        recs.push_back({now_ns(), tid(), 0, (int64_t)n, used_bytes, peak_bytes, ALLOC_FAILED, top_op});
      throw;
    }
    void* data = d.get();
    if (data == nullptr || d.get_deleter() == nullptr) return d;
    c10::Device dev = d.device();
    Block b{d.get_context(), d.get_deleter(), (int64_t)n, 0, false};
    d.release_context();
    {
      std::lock_guard<std::mutex> g(mu);
      if (count_new) {
        b.counted = true;
        b.aid = ++next_aid;
        used_bytes += b.size;
        if (used_bytes > peak_bytes) peak_bytes = used_bytes;
        if (emit_alloc)
          recs.push_back({now_ns(), tid(), (uint64_t)data, b.size, used_bytes, b.aid, MALLOC, top_op});
      }
      live[data] = b;
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
  count_new = emit_alloc = emit_free = free_untraced = emit_launch = false;
  recs.clear();
  in_flight.clear();
  mu.unlock();
}

// Under the lock: an OP_END now for every top-level op whose OP_START was recorded.
void close_in_flight_locked() {
  int64_t t = now_ns();
  for (auto& kv : in_flight) recs.push_back({t, kv.first, 0, 0, 0, 0, OP_END, kv.second});
  in_flight.clear();
}

// Under the lock: nothing new is recorded (ops, blocks); frees of counted blocks still are,
// flagged per the flags the session gives.
void stop_recording_locked() {
  recording = false;
  count_new = false;
  emit_alloc = false;
  emit_launch = false;
  close_in_flight_locked();
}

void detach() {
  // blocks allocated through the wrapper keep its deleter: the wrapper and the side table stay
  Py_XDECREF(on_full);  // called with the GIL (from Python)
  on_full = nullptr;
  if (handle != 0) {
    at::removeCallback(handle);
    handle = 0;
  }
  if (c10::GetCPUAllocator() == &tracing_allocator)
    c10::SetCPUAllocator(tracing_allocator.inner, ++alloc_priority);
}

}  // namespace

void install(int64_t drain_rows, py::object full_callback) {
  drain_at = (size_t)drain_rows;
  Py_XDECREF(on_full);
  on_full = full_callback.is_none() ? nullptr : full_callback.release().ptr();
  if (tracing_allocator.inner == nullptr) {
    tracing_allocator.inner = c10::GetCPUAllocator();
    pthread_atfork(&before_fork, &after_fork_parent, &after_fork_child);
  }
  if (c10::GetCPUAllocator() != &tracing_allocator)
    c10::SetCPUAllocator(&tracing_allocator, ++alloc_priority);
  if (handle == 0)
    handle = at::addGlobalCallback(
        at::RecordFunctionCallback(on_enter, on_exit).needsInputs(false).needsOutputs(false)
            .needsIds(false).scopes({at::RecordScope::FUNCTION}));
}

// rec: ops tracked; count: new blocks counted; alloc: their MALLOC recorded; free_: frees recorded
// as traced; free_later: frees of counted blocks recorded flagged when not as traced; launch: ops.
void set_flags(bool rec, bool count, bool alloc, bool free_, bool free_later, bool launch) {
  std::lock_guard<std::mutex> g(mu);
  bool on = !handed_over;
  recording = rec && on;
  count_new = count && on;
  emit_alloc = alloc && on;
  emit_free = free_;
  free_untraced = free_later;
  emit_launch = launch && on;
}

// stop(): one critical section ends recording (closing the ops in flight), then the hooks go.
void uninstall() {
  {
    std::lock_guard<std::mutex> g(mu);
    stop_recording_locked();
  }
  detach();
}

// Returns (rows appended, failed-allocation markers among them).
// Append the recorded rows to `out` as the Python source's row tuples:
// (event, event_type, name, ts, tid, device, ptr, attr, py_stack, c_stack).
// `names` = (OP_LAUNCH, ATEN_START, ATEN_END, MALLOC, FREE, PTA, "cpu", "N/A", marker of a failed
// allocation).
py::tuple drain(py::list out, py::tuple names) {
  // The records are copied out, made into tuples, and only then removed: a tuple that cannot be
  // made (no memory) raises with every record still here for the next drain. Records added
  // while the tuples are built (frees on other threads) stay after the copied ones.
  int64_t failed = 0;
  std::vector<Rec> batch;
  {
    std::lock_guard<std::mutex> g(mu);
    if (draining || recs.empty()) return py::make_tuple((int64_t)0, (int64_t)0);
    draining = true;
    batch.assign(recs.begin(), recs.end());
  }
  struct Done {  // the drain flag is cleared on every way out
    ~Done() { std::lock_guard<std::mutex> g(mu); draining = false; }
  } done;
  PyObject* ev_launch = names[0].ptr();
  PyObject* ev_start = names[1].ptr();
  PyObject* ev_end = names[2].ptr();
  PyObject* ev_malloc = names[3].ptr();
  PyObject* ev_free = names[4].ptr();
  PyObject* pool = names[5].ptr();
  PyObject* device = names[6].ptr();
  PyObject* na = names[7].ptr();
  PyObject* ev_failed = names[8].ptr();
  PyObject* untraced_key = names[9].ptr();
  py::list made;  // the tuples, appended to `out` once all are made
  PyObject* lst = made.ptr();
  py::str empty("");
  for (const Rec& r : batch) {
    PyObject* name = r.op >= 0 ? op_str(r.op) : na;
    if (name == nullptr) throw py::error_already_set();
    PyObject* ev;
    PyObject* type;
    PyObject* ptr;
    PyObject* attr;
    if (r.kind == OP_START || r.kind == OP_END) {
      ev = ev_launch;
      type = r.kind == OP_START ? ev_start : ev_end;
      ptr = Py_None;
      attr = Py_None;
      Py_INCREF(ptr);
      Py_INCREF(attr);
    } else if (r.kind == ALLOC_FAILED) {
      ++failed;
      // not a dump row: the session turns it into the OOM snapshot (used and peak at the failure)
      ev = ev_failed;
      type = pool;
      ptr = Py_None;
      Py_INCREF(ptr);
      attr = Py_BuildValue("(LLL)", (long long)r.size, (long long)r.used, (long long)r.aid);
    } else if (r.kind == FREE_UNTRACED) {
      // FREE of a counted block freed while not recording: Attr is a dict with the flag
      ev = ev_free;
      type = pool;
      ptr = PyLong_FromUnsignedLongLong(r.ptr);
      attr = Py_BuildValue("{s:L,s:K,s:L,s:L,s:L,O:O}", "allocation_id", (long long)r.aid, "addr",
                           (unsigned long long)r.ptr, "size", (long long)r.size, "used", (long long)r.used,
                           "total", (long long)r.used, untraced_key, Py_True);
    } else {
      ev = r.kind == MALLOC ? ev_malloc : ev_free;
      type = pool;
      ptr = PyLong_FromUnsignedLongLong(r.ptr);
      // MALLOC: (alloc_id, addr, size, used, total, owner); FREE: the same without the owner.
      // The CPU allocator reserves nothing beyond what it hands out: total == used.
      if (r.kind == MALLOC)
        attr = Py_BuildValue("(LKLLLO)", (long long)r.aid, (unsigned long long)r.ptr, (long long)r.size,
                             (long long)r.used, (long long)r.used, empty.ptr());
      else
        attr = Py_BuildValue("(LKLLL)", (long long)r.aid, (unsigned long long)r.ptr, (long long)r.size,
                             (long long)r.used, (long long)r.used);
    }
    PyObject* t = (ptr == nullptr || attr == nullptr) ? nullptr
        : Py_BuildValue("(OOOLKOOOOO)", ev, type, name, (long long)r.ts, (unsigned long long)r.tid, device,
                        ptr, attr, Py_None, Py_None);
    Py_XDECREF(ptr);
    Py_XDECREF(attr);
    if (t == nullptr) throw py::error_already_set();
    int rc = PyList_Append(lst, t);
    Py_DECREF(t);
    if (rc != 0) throw py::error_already_set();
  }
  {
    // every tuple made: the records go (those appended meanwhile stay)
    std::lock_guard<std::mutex> g(mu);
    recs.erase(recs.begin(), recs.begin() + batch.size());
  }
  // appending cannot fail half-way on memory: the list is grown once by the slice assignment
  Py_ssize_t n = PyList_GET_SIZE(out.ptr());
  if (PyList_SetSlice(out.ptr(), n, n, lst) != 0) throw py::error_already_set();
  return py::make_tuple((int64_t)batch.size(), failed);
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
    used_bytes = peak_bytes = 0;
    next_aid = 0;
    for (auto& kv : live) kv.second.counted = false;
  }
  detach();
}

// After the handover the dispatch-mode source's blocks share the bytes-in-use counter:
// (used after the change, its time), taken together so that rows order by time.
py::tuple account(int64_t delta) {
  std::lock_guard<std::mutex> g(mu);
  used_bytes += delta;
  if (used_bytes > peak_bytes) peak_bytes = used_bytes;
  return py::make_tuple(used_bytes, now_ns());
}

// (alloc_id, size) of the counted block starting at this address, or None
py::object counted_block(uint64_t addr) {
  std::lock_guard<std::mutex> g(mu);
  auto it = live.find((void*)addr);
  if (it == live.end() || !it->second.counted) return py::none();
  return py::make_tuple(it->second.aid, it->second.size);
}

// (bytes in use, peak) of the blocks allocated while recording
py::tuple counters() {
  std::lock_guard<std::mutex> g(mu);
  return py::make_tuple(used_bytes, peak_bytes);
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
    for (auto& kv : live)
      if (kv.second.counted) ids.push_back(kv.second.aid);
  }
  py::set s;
  for (int64_t i : ids) s.add(py::int_(i));
  return s;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("uninstall", &uninstall);
  m.def("set_flags", &set_flags);
  m.def("drain", &drain);
  m.def("counters", &counters);
  m.def("reset_peak", &reset_peak);
  m.def("live_alloc_ids", &live_alloc_ids);
  m.def("handover", &handover);
  m.def("account", &account);
  m.def("counted_block", &counted_block);
  m.def("reset", &reset);
}
