// The leak rule's row loop and block tables (issue 22): StepLeakTracker's (analysis/leaks.py)
// inlined MALLOC/FREE path in C++, online and offline. A CPython extension with no torch in it
// (pybind11's headers only, from torch's include folder or the pybind11 package), so that the
// offline replay, which never imports torch, runs the same code as the online sink. Built and
// loaded by msmemscope/leak_native.py.
#include <Python.h>
#include <structmember.h>
#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <unordered_map>
#include <utility>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cerrno>

namespace py = pybind11;

// a numpy array of T as C++ reads it (converted or copied where it is not that already)
template <typename T>
using carr = py::array_t<T, py::array::c_style | py::array::forcecast>;

// ---------------------------------------------------------------- the row loop's helpers
// (issue 22d) StepLeakTracker.consume's inlined MALLOC/FREE path (msmemscope/analysis/leaks.py),
// the same dict operations on the tracker's own dicts and Site objects, without a Python
// bytecode per row. It stops at the first row it does not handle exactly as the Python loop
// would (a row of another kind, a dict attr, the cached segments' pool, the first row of a pool
// in a step, a Python stack whose line is not cached yet, owner labels, a new site) and returns
// its index: the Python loop takes that row, then calls again. Nothing is changed for the row it
// stops at, so the Python loop sees it as if this function did not exist.
namespace {

inline bool same_str(PyObject* a, PyObject* b) {
  if (a == b) return true;
  if (!PyUnicode_CheckExact(a) || !PyUnicode_CheckExact(b)) return false;
  // two interned strings are one object or unequal: most calls are an event name against another
  if (PyUnicode_CHECK_INTERNED(a) && PyUnicode_CHECK_INTERNED(b)) return false;
  return PyUnicode_Compare(a, b) == 0;
}

// Python's truth value of a field (-1 on error)
inline int truthy(PyObject* o) { return o == Py_None ? 0 : PyObject_IsTrue(o); }

struct Ref {  // a strong reference released on every way out
  PyObject* o;
  explicit Ref(PyObject* p = nullptr) : o(p) {}
  ~Ref() { Py_XDECREF(o); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  PyObject* get() const { return o; }
  PyObject* release() { PyObject* p = o; o = nullptr; return p; }
};

// site.<attr> += delta (delta may be negative: subtract)
bool add_attr(PyObject* site, PyObject* name, PyObject* delta, bool subtract) {
  Ref cur(PyObject_GetAttr(site, name));
  if (cur.get() == nullptr) return false;
  Ref v(subtract ? PyNumber_Subtract(cur.get(), delta) : PyNumber_Add(cur.get(), delta));
  if (v.get() == nullptr) return false;
  return PyObject_SetAttr(site, name, v.get()) == 0;
}

// Site (analysis/growth.py) has __slots__: its ``live`` and ``last_aid`` are read and written at
// their offsets (the member descriptors' own), not through attribute lookups; another type (or a
// slot left unset) goes through getattr/setattr.
#ifndef T_OBJECT_EX
#define T_OBJECT_EX Py_T_OBJECT_EX
#endif
struct SiteSlots {
  PyTypeObject* type = nullptr;  // a strong reference: the offsets never outlive their type
  Py_ssize_t live = -1, last = -1;
};
SiteSlots site_slots;

Py_ssize_t member_offset(PyTypeObject* tp, PyObject* name) {
  PyObject* d = _PyType_Lookup(tp, name);  // borrowed
  if (d == nullptr || !Py_IS_TYPE(d, &PyMemberDescr_Type)) return -1;
  PyMemberDef* m = ((PyMemberDescrObject*)d)->d_member;
  return (m->type == T_OBJECT_EX && !(m->flags & READONLY)) ? m->offset : -1;
}

// the address of the site's slot (live: which=0, last_aid: 1), or null: use getattr/setattr
PyObject** site_slot(PyObject* site, int which, PyObject* s_live, PyObject* s_last) {
  PyTypeObject* tp = Py_TYPE(site);
  if (site_slots.type != tp) {
    Py_XDECREF((PyObject*)site_slots.type);
    Py_INCREF((PyObject*)tp);
    site_slots.type = tp;
    site_slots.live = member_offset(tp, s_live);
    site_slots.last = member_offset(tp, s_last);
    if (site_slots.live < 0 || site_slots.last < 0) site_slots.live = site_slots.last = -1;
  }
  Py_ssize_t off = which == 0 ? site_slots.live : site_slots.last;
  if (off < 0) return nullptr;
  PyObject** slot = (PyObject**)((char*)site + off);
  return *slot != nullptr ? slot : nullptr;
}

// site.live += delta (or -= delta)
bool site_add_live(PyObject* site, PyObject* delta, bool subtract, PyObject* s_live, PyObject* s_last) {
  PyObject** slot = site_slot(site, 0, s_live, s_last);
  if (slot == nullptr) return add_attr(site, s_live, delta, subtract);
  PyObject* v = subtract ? PyNumber_Subtract(*slot, delta) : PyNumber_Add(*slot, delta);
  if (v == nullptr) return false;
  PyObject* old = *slot;
  *slot = v;
  Py_DECREF(old);
  return true;
}

bool site_set_last(PyObject* site, PyObject* value, PyObject* s_live, PyObject* s_last) {
  PyObject** slot = site_slot(site, 1, s_live, s_last);
  if (slot == nullptr) return PyObject_SetAttr(site, s_last, value) == 0;
  PyObject* old = *slot;
  Py_INCREF(value);
  *slot = value;
  Py_DECREF(old);
  return true;
}

// site.last_aid, a new reference
PyObject* site_get_last(PyObject* site, PyObject* s_live, PyObject* s_last) {
  PyObject** slot = site_slot(site, 1, s_live, s_last);
  if (slot == nullptr) return PyObject_GetAttr(site, s_last);
  Py_INCREF(*slot);
  return *slot;
}

// d.pop(key, None) in one lookup: a new reference, or Py_None (a new reference too); null on error
PyObject* dict_pop(PyObject* d, PyObject* key) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* out = nullptr;
  int rc = PyDict_Pop(d, key, &out);
  if (rc < 0) return nullptr;
  if (rc == 0) Py_RETURN_NONE;
  return out;
#else
  return _PyDict_Pop(d, key, Py_None);
#endif
}

PyObject* tuple_of(std::initializer_list<PyObject*> items) {
  PyObject* t = PyTuple_New((Py_ssize_t)items.size());
  if (t == nullptr) return nullptr;
  Py_ssize_t k = 0;
  for (PyObject* o : items) {
    Py_INCREF(o);
    PyTuple_SET_ITEM(t, k++, o);
  }
  return t;
}

}  // namespace

// ---------------------------------------------------------------- the leak rule's block tables
// (issue 22) StepLeakTracker's live blocks, (device, pool, alloc_id) -> (site, size), and its
// pending blocks, -> (step, row_id, addr, size, op, py_stack), kept here where the native module
// is loaded: leak_rows puts and takes a block with no key tuple, no value tuple and no dict
// operation per row. From Python a table reads as a dict of those tuples in insertion order (an
// assignment to a key already there keeps its place, as in a dict), so the tracker's Python loop
// and its step end use it as they use their dicts offline.
class KeyTable {
 public:
  explicit KeyTable(int width) : width_(width) {
    if (width < 1 || width > kMaxWidth) throw py::value_error("KeyTable: width must be 1-6");
  }
  ~KeyTable() {
    clear();
    for (PyObject* p : pk_pairs_) Py_DECREF(p);
  }
  KeyTable(const KeyTable&) = delete;
  KeyTable& operator=(const KeyTable&) = delete;

  static constexpr int kMaxWidth = 6;
  int width() const { return width_; }

  // the index of a (device, pool) pair (a 2-tuple), -1 with the error set
  int32_t pk_of(PyObject* pair) {
    PyObject* got = PyDict_GetItemWithError(pk_ids_.ptr(), pair);
    if (got != nullptr) return (int32_t)PyLong_AsLong(got);
    if (PyErr_Occurred()) return -1;
    Ref n(PyLong_FromSize_t(pk_pairs_.size()));
    if (n.get() == nullptr || PyDict_SetItem(pk_ids_.ptr(), pair, n.get()) != 0) return -1;
    Py_INCREF(pair);
    pk_pairs_.push_back(pair);
    return (int32_t)(pk_pairs_.size() - 1);
  }

  // the entry of (pk, aid), or -1 (-2 with the error set)
  int64_t find(int32_t pk, PyObject* aid) {
    int64_t a;
    if (!as_id(aid, &a)) return find_odd(pk, aid);
    if (slots_.empty()) return -1;
    size_t mask = slots_.size() - 1;
    for (size_t h = hash(pk, a) & mask;; h = (h + 1) & mask) {
      int32_t e = slots_[h];
      if (e < 0) return -1;
      const Entry& x = entries_[e];
      if (x.pk == pk && x.aid == a && x.plain) return e;
    }
  }

  // (pk, aid) -> vals (borrowed; width of them, vals[lazy] may be null: lazy_val stands for it
  // until asked for); false with the error set
  bool put(int32_t pk, PyObject* aid, PyObject* const* vals, int lazy = -1, int64_t lazy_val = 0) {
    int64_t e = find(pk, aid);
    if (e == -2) return false;
    if (e >= 0) {  // a key already there keeps its place
      Entry& x = entries_[e];
      for (int k = 0; k < width_; ++k) {
        Py_XINCREF(vals[k]);
        Py_XSETREF(x.v[k], vals[k]);
      }
      x.lazy = (int8_t)lazy;
      x.lazy_val = lazy_val;
      return true;
    }
    Entry x;
    x.pk = pk;
    x.plain = as_id(aid, &x.aid);
    Py_INCREF(aid);
    x.aid_obj = aid;
    for (int k = 0; k < width_; ++k) {
      Py_XINCREF(vals[k]);
      x.v[k] = vals[k];
    }
    x.lazy = (int8_t)lazy;
    x.lazy_val = lazy_val;
    int64_t idx = (int64_t)entries_.size();
    if (!x.plain) {  // an alloc id that is not a plain int (None from a dict attr): a dict finds it
      Ref key(key_tuple(x));
      Ref at(PyLong_FromLongLong(idx));
      if (key.get() == nullptr || at.get() == nullptr || PyDict_SetItem(odd_.ptr(), key.get(), at.get()) != 0) {
        drop(x);
        return false;
      }
    }
    entries_.push_back(x);
    ++live_;
    if (x.plain) {
      ++plain_;
      if ((size_t)plain_ * 2 > slots_.size())
        rehash(std::max<size_t>(64, slots_.size() * 2));  // puts the new entry in too
      else
        slot_in(idx);
    }
    return true;
  }

  // the value k of entry e, a new reference
  PyObject* value(int64_t e, int k) {
    Entry& x = entries_[e];
    if (x.v[k] == nullptr) {
      PyObject* o = PyLong_FromLongLong(x.lazy_val);
      if (o == nullptr) return nullptr;
      x.v[k] = o;
      x.lazy = -1;
    }
    Py_INCREF(x.v[k]);
    return x.v[k];
  }
  PyObject* borrowed(int64_t e, int k) const { return entries_[e].v[k]; }

  // the entry removed (its references dropped); false with the error set
  bool erase(int64_t e, bool may_compact = true) {
    Entry& x = entries_[e];
    if (x.plain) {
      slot_out(e);
      --plain_;
    } else {
      Ref key(key_tuple(x));
      if (key.get() == nullptr || PyDict_DelItem(odd_.ptr(), key.get()) != 0) return false;
    }
    drop(x);
    x.pk = -1;
    --live_;
    ++dead_;
    if (may_compact && dead_ > 1024 && dead_ > live_) compact();
    return true;
  }

  // ---- the dict-like face Python sees
  Py_ssize_t size() const { return live_; }
  bool contains(py::handle key) {
    int32_t pk;
    PyObject* aid;
    if (!split(key, &pk, &aid)) return false;
    int64_t e = find(pk, aid);
    if (e == -2) throw py::error_already_set();
    return e >= 0;
  }
  py::object getitem(py::handle key) {
    int32_t pk;
    PyObject* aid;
    if (!split(key, &pk, &aid)) throw py::key_error(py::repr(key).cast<std::string>());
    int64_t e = find(pk, aid);
    if (e == -2) throw py::error_already_set();
    if (e < 0) throw py::key_error(py::repr(key).cast<std::string>());
    return values_of(e);
  }
  void setitem(py::handle key, py::handle val) {
    int32_t pk;
    PyObject* aid;
    if (!split(key, &pk, &aid)) throw py::type_error("KeyTable: a key is (device, pool, alloc_id)");
    if (!PyTuple_Check(val.ptr()) || PyTuple_GET_SIZE(val.ptr()) != width_)
      throw py::type_error("KeyTable: a value is a tuple of the table's width");
    PyObject* vals[kMaxWidth];
    for (int k = 0; k < width_; ++k) vals[k] = PyTuple_GET_ITEM(val.ptr(), k);
    if (!put(pk, aid, vals)) throw py::error_already_set();
  }
  py::object pop(py::handle key, py::object dflt) {
    int32_t pk;
    PyObject* aid;
    if (!split(key, &pk, &aid)) return dflt;
    int64_t e = find(pk, aid);
    if (e == -2) throw py::error_already_set();
    if (e < 0) return dflt;
    py::object v = values_of(e);
    if (!erase(e)) throw py::error_already_set();
    return v;
  }
  py::list items() {
    py::list out;
    for (int64_t e = 0; e < (int64_t)entries_.size(); ++e)
      if (entries_[e].pk >= 0) out.append(py::make_tuple(key_of(e), values_of(e)));
    return out;
  }
  py::list keys() {
    py::list out;
    for (int64_t e = 0; e < (int64_t)entries_.size(); ++e)
      if (entries_[e].pk >= 0) out.append(key_of(e));
    return out;
  }
  // [(key, value)] of the entries whose value 0 (a step) is at most ``last``, taken out: by step,
  // then in insertion order (the block rule's suspects at a step end)
  py::list due(int64_t last) {
    std::vector<std::pair<int64_t, int64_t>> hit;  // (step, entry)
    for (int64_t e = 0; e < (int64_t)entries_.size(); ++e) {
      const Entry& x = entries_[e];
      if (x.pk < 0 || x.v[0] == nullptr) continue;
      int over = 0;
      long long s = PyLong_AsLongLongAndOverflow(x.v[0], &over);
      if (s == -1 && PyErr_Occurred()) throw py::error_already_set();
      if (!over && s <= last) hit.emplace_back(s, e);
    }
    std::stable_sort(hit.begin(), hit.end(),
                     [](const std::pair<int64_t, int64_t>& a, const std::pair<int64_t, int64_t>& b) {
                       return a.first < b.first;
                     });
    py::list out;
    for (auto& h : hit) out.append(py::make_tuple(key_of(h.second), values_of(h.second)));
    // taken out only once every tuple is made: a failure leaves the table as it was
    for (auto& h : hit)
      if (!erase(h.second, false)) throw py::error_already_set();  // no compaction: the indices hold
    if (dead_ > 1024 && dead_ > live_) compact();
    return out;
  }
  void clear() {
    for (Entry& x : entries_)
      if (x.pk >= 0) drop(x);
    entries_.clear();
    slots_.clear();
    live_ = dead_ = plain_ = 0;
    PyDict_Clear(odd_.ptr());
  }

 private:
  struct Entry {
    int32_t pk = -1;         // (device, pool) index; -1: removed
    bool plain = false;      // the alloc id is an int that fits int64 (found by the slots, not odd_)
    int8_t lazy = -1;        // the value made from lazy_val when asked for (-1: none)
    int64_t aid = 0;
    int64_t lazy_val = 0;
    PyObject* aid_obj = nullptr;
    PyObject* v[kMaxWidth] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  };

  static bool as_id(PyObject* aid, int64_t* out) {
    if (!PyLong_CheckExact(aid)) return false;
    int over = 0;
    long long a = PyLong_AsLongLongAndOverflow(aid, &over);
    if (over || (a == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    *out = a;
    return true;
  }
  static size_t hash(int32_t pk, int64_t a) {
    uint64_t h = (uint64_t)a * 0x9E3779B97F4A7C15ull ^ ((uint64_t)(uint32_t)pk << 32);
    return (size_t)(h ^ (h >> 29));
  }
  int64_t find_odd(int32_t pk, PyObject* aid) {
    if (PyDict_GET_SIZE(odd_.ptr()) == 0) return -1;
    Ref key(PyTuple_Pack(3, PyTuple_GET_ITEM(pk_pairs_[pk], 0), PyTuple_GET_ITEM(pk_pairs_[pk], 1), aid));
    if (key.get() == nullptr) return -2;
    PyObject* at = PyDict_GetItemWithError(odd_.ptr(), key.get());
    if (at == nullptr) return PyErr_Occurred() ? -2 : -1;
    return PyLong_AsLongLong(at);
  }
  // a Python key (device, pool, alloc_id) split; false: not such a key (no error set)
  bool split(py::handle key, int32_t* pk, PyObject** aid) {
    PyObject* k = key.ptr();
    if (!PyTuple_Check(k) || PyTuple_GET_SIZE(k) != 3) return false;
    Ref pair(PyTuple_Pack(2, PyTuple_GET_ITEM(k, 0), PyTuple_GET_ITEM(k, 1)));
    if (pair.get() == nullptr) throw py::error_already_set();
    *pk = pk_of(pair.get());
    if (*pk < 0) throw py::error_already_set();
    *aid = PyTuple_GET_ITEM(k, 2);
    return true;
  }
  PyObject* key_tuple(const Entry& x) {
    PyObject* pair = pk_pairs_[x.pk];
    return PyTuple_Pack(3, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), x.aid_obj);
  }
  py::object key_of(int64_t e) {
    PyObject* t = key_tuple(entries_[e]);
    if (t == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(t);
  }
  py::object values_of(int64_t e) {
    PyObject* t = PyTuple_New(width_);
    if (t == nullptr) throw py::error_already_set();
    py::object out = py::reinterpret_steal<py::object>(t);
    for (int k = 0; k < width_; ++k) {
      PyObject* v = value(e, k);
      if (v == nullptr) throw py::error_already_set();
      PyTuple_SET_ITEM(t, k, v);
    }
    return out;
  }
  static void drop(Entry& x) {
    Py_CLEAR(x.aid_obj);
    for (auto& o : x.v) Py_CLEAR(o);
  }
  void slot_in(int64_t e) {
    size_t mask = slots_.size() - 1;
    size_t h = hash(entries_[e].pk, entries_[e].aid) & mask;
    while (slots_[h] >= 0) h = (h + 1) & mask;
    slots_[h] = (int32_t)e;
  }
  // linear probing's deletion by backward shift: no tombstones in the slots
  void slot_out(int64_t e) {
    size_t mask = slots_.size() - 1;
    size_t h = hash(entries_[e].pk, entries_[e].aid) & mask;
    while (slots_[h] != e) h = (h + 1) & mask;
    size_t hole = h;
    for (size_t j = (hole + 1) & mask; slots_[j] >= 0; j = (j + 1) & mask) {
      const Entry& x = entries_[slots_[j]];
      size_t home = hash(x.pk, x.aid) & mask;
      // the entry at j may move into the hole if its home is not in (hole, j]
      bool between = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (!between) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = -1;
  }
  void rehash(size_t n) {
    slots_.assign(n, -1);
    for (int64_t e = 0; e < (int64_t)entries_.size(); ++e)
      if (entries_[e].pk >= 0 && entries_[e].plain) slot_in(e);
  }
  // the removed entries dropped from the vector (order kept), the slots and odd_ renumbered
  void compact() {
    std::vector<Entry> kept;
    kept.reserve(live_ + live_ / 2 + 16);
    bool odd = false;
    for (Entry& x : entries_)
      if (x.pk >= 0) {
        odd = odd || !x.plain;
        kept.push_back(x);
      }
    entries_.swap(kept);
    dead_ = 0;
    size_t n = 64;
    while (n < (size_t)plain_ * 2 + 2) n *= 2;
    rehash(n);
    if (odd) {
      PyDict_Clear(odd_.ptr());
      for (int64_t e = 0; e < (int64_t)entries_.size(); ++e) {
        if (entries_[e].plain) continue;
        Ref key(key_tuple(entries_[e]));
        Ref at(PyLong_FromLongLong(e));
        if (key.get() == nullptr || at.get() == nullptr || PyDict_SetItem(odd_.ptr(), key.get(), at.get()) != 0)
          PyErr_Clear();  // no memory for a rare key's index: found again by the next compaction
      }
    }
  }

  int width_;
  std::vector<Entry> entries_;
  std::vector<int32_t> slots_;  // entry indices of the plain keys, -1 empty (load at most 1/2)
  Py_ssize_t live_ = 0, dead_ = 0, plain_ = 0;
  py::dict pk_ids_;             // (device, pool) -> index in pk_pairs_
  std::vector<PyObject*> pk_pairs_;
  py::dict odd_;                // (device, pool, alloc_id) -> entry, for the alloc ids that are not plain ints
};

// consts = (OP_LAUNCH, ACCESS, MALLOC, FREE, cached segments' pool, "live", "last_aid",
//           "freed_at_step"); state = (sites, blocks, pending, level, cur, lines, labels, reported),
// blocks and pending KeyTables (of width 2 and 6; dicts: nothing is done here, the Python loop
// takes every row). The sites' live bytes are summed here and added to them when the call ends.
namespace {
// one MALLOC/FREE row's fields as the loop reads them, borrowed (from the row tuple, or from the
// columns and the values the caller made for the row)
struct LeakRow {
  bool is_malloc = false;
  PyObject *pool = nullptr, *device = nullptr, *used = nullptr, *op = nullptr, *aid = nullptr,
           *stack = nullptr, *owner = nullptr, *size = nullptr, *addr = nullptr;
  PyObject* tid = nullptr;  // null: tid_val (None where tid_null), made only for a labels lookup
  int64_t tid_val = 0;
  bool tid_null = false;
  PyObject* id = nullptr;   // null: id_val, kept by the pending table as a number until asked for
  int64_t id_val = 0;
  int64_t used_val = 0;     // ``used`` as a number where ``used`` is null (the column loop: no
                            // int made for it unless it becomes the step's lowest or highest or
                            // the pool's level)
};

// the (device, pool) of the last row: most rows of a batch have the same objects, so their key is
// made, and their min/max looked up, once; ``level`` gets the pool's last ``used`` when the pool
// changes and when the loop ends (nothing reads it in between)
struct LastPool {
  PyObject* level;
  PyObject* device = nullptr;  // borrowed (the rows hold them)
  PyObject* pool = nullptr;
  PyObject* key = nullptr;     // owned
  PyObject* mm = nullptr;      // borrowed from cur
  PyObject* used = nullptr;    // owned: the last row's ``used`` not yet in level
  bool raw = false;            // ... or that number, not yet made an int (used null)
  int64_t used_val = 0;
  int32_t bpk = -1, ppk = -1;  // the pair's index in the blocks and pending tables
  explicit LastPool(PyObject* l) : level(l) {}
  LastPool(const LastPool&) = delete;
  LastPool& operator=(const LastPool&) = delete;
  void note(PyObject* u) {
    Py_INCREF(u);
    Py_XSETREF(used, u);
    raw = false;
  }
  void note_raw(int64_t v) {
    Py_CLEAR(used);
    used_val = v;
    raw = true;
  }
  bool put_level() {
    if (key == nullptr) return true;
    if (raw) {
      raw = false;
      used = PyLong_FromLongLong(used_val);
      if (used == nullptr) return false;
    }
    if (used == nullptr) return true;
    Ref u(used);
    used = nullptr;
    return PyDict_SetItem(level, key, u.get()) == 0;
  }
  ~LastPool() {
    if ((used != nullptr || raw) && key != nullptr) {  // an exception on the way out: keep it, put the level
      PyObject *t, *v, *tb;
      PyErr_Fetch(&t, &v, &tb);
      if (!put_level()) PyErr_Clear();
      PyErr_Restore(t, v, tb);
    }
    Py_XDECREF(used);
    Py_XDECREF(key);
  }
};

// the bytes each site gained or lost in this call, added to its ``live`` when the call ends (on
// an error too): one int made per site, not one per row. The sites are held meanwhile.
struct Deltas {
  std::vector<std::pair<PyObject*, long long>> v;
  std::unordered_map<PyObject*, size_t> at;
  PyObject *s_live, *s_last;
  PyObject* last = nullptr;  // the site of the last add, and its place in v
  size_t last_at = 0;
  Deltas(PyObject* l, PyObject* t) : s_live(l), s_last(t) {}
  Deltas(const Deltas&) = delete;
  Deltas& operator=(const Deltas&) = delete;
  void add(PyObject* site, long long d) {
    if (site != last) {
      auto it = at.find(site);
      if (it == at.end()) {
        Py_INCREF(site);
        it = at.emplace(site, v.size()).first;
        v.emplace_back(site, 0);
      }
      last = site;
      last_at = it->second;
    }
    v[last_at].second += d;
  }
  bool apply() {
    bool ok = true;
    for (auto& sd : v) {
      if (ok && sd.second != 0) {
        Ref d(PyLong_FromLongLong(sd.second));
        ok = d.get() != nullptr && site_add_live(sd.first, d.get(), false, s_live, s_last);
      }
      Py_DECREF(sd.first);
    }
    v.clear();
    at.clear();
    last = nullptr;
    return ok;
  }
  ~Deltas() {
    if (v.empty()) return;
    PyObject *t, *val, *tb;
    PyErr_Fetch(&t, &val, &tb);
    if (!apply()) PyErr_Clear();
    PyErr_Restore(t, val, tb);
  }
};

// the step's [min, max] of ``used`` (a list of two ints) moved to take ``v``: false on an error.
// An item that is not an int that fits in 64 bits is compared as Python compares it.
bool minmax_raw(PyObject* mm, int64_t v) {
  for (int k = 0; k < 2; ++k) {
    PyObject* cur = PyList_GET_ITEM(mm, k);
    int over = 1;
    long long c = PyLong_CheckExact(cur) ? PyLong_AsLongLongAndOverflow(cur, &over) : 0;
    bool moves;
    if (!over) {
      moves = k == 0 ? v < c : v > c;
    } else {
      Ref u(PyLong_FromLongLong(v));
      if (u.get() == nullptr) return false;
      int b = PyObject_RichCompareBool(u.get(), cur, k == 0 ? Py_LT : Py_GT);
      if (b < 0) return false;
      moves = b != 0;
    }
    if (moves) {
      PyObject* u = PyLong_FromLongLong(v);
      if (u == nullptr) return false;
      PyList_SetItem(mm, k, u);  // steals u
      return true;  // a new lowest is not also a new highest (the Python loop's elif)
    }
  }
  return true;
}

// the loop's state for one call: what take() needs of consts and state, the last pool, the sites'
// deltas and the sites last found by op. take() handles a row (true) or leaves it untouched for
// the Python loop (false); errors are thrown. finish() puts the level and the deltas.
class LeakLoop {
 public:
  LeakLoop(py::handle step_h, py::tuple consts, py::tuple state)
      : ev_launch(consts[0].ptr()), ev_access(consts[1].ptr()), ev_malloc(consts[2].ptr()),
        ev_free(consts[3].ptr()), hal(consts[4].ptr()), s_live(consts[5].ptr()), s_last(consts[6].ptr()),
        s_freed(consts[7].ptr()), sites(state[0].ptr()), level(state[3].ptr()), cur(state[4].ptr()),
        lines(state[5].ptr()), labels(state[6].ptr()), reported(state[7].ptr()), step(step_h.ptr()), pk(level),
        deltas(s_live, s_last) {
    if (!py::isinstance<KeyTable>(state[1]) || !py::isinstance<KeyTable>(state[2])) return;
    blocks = state[1].cast<KeyTable*>();
    pending = state[2].cast<KeyTable*>();
    if (blocks->width() != 2 || pending->width() != 6) return;
    long long step_no = PyLong_AsLongLong(step);
    if (step_no == -1 && PyErr_Occurred()) throw py::error_already_set();
    late = step_no >= 2;  // blocks of steps >= 2 are pending until judged
    ready = true;
  }
  bool ready = false;
  PyObject *ev_launch, *ev_access, *ev_malloc, *ev_free;

  bool take(const LeakRow& r) {
    PyObject* pool = r.pool;
    if (r.is_malloc && (!PyUnicode_CheckExact(pool) || same_str(pool, hal))) return false;
    PyObject* device = r.device;
    PyObject* used = r.used;
    if (pk.key == nullptr || device != pk.device || pool != pk.pool) {
      // another (device, pool) than the last row's: its key, and its min/max of this step
      PyObject* key = tuple_of({device, pool});
      if (key == nullptr) throw py::error_already_set();
      PyObject* got = nullptr;
      if (late) {
        got = PyDict_GetItemWithError(cur, key);
        if (got == nullptr || !PyList_CheckExact(got) || PyList_GET_SIZE(got) != 2) {
          Py_DECREF(key);
          if (PyErr_Occurred()) throw py::error_already_set();
          return false;  // the pool's first row in this step: the Python loop starts its min/max
        }
      }
      if (!pk.put_level()) {
        Py_DECREF(key);
        throw py::error_already_set();
      }
      Py_XDECREF(pk.key);
      pk.key = key;
      pk.device = device;
      pk.pool = pool;
      pk.mm = got;
      pk.bpk = blocks->pk_of(key);
      pk.ppk = pk.bpk < 0 ? -1 : pending->pk_of(key);
      if (pk.ppk < 0) {
        Py_CLEAR(pk.key);  // no level is put for a pair that has no index
        throw py::error_already_set();
      }
    }
    PyObject* mm = pk.mm;  // borrowed from cur
    PyObject* op = r.op;
    PyObject* aid = r.aid;
    PyObject* stack = r.stack;
    PyObject* site = nullptr;  // borrowed from sites
    PyObject* size = nullptr;  // borrowed (the row's, or the cached 0)
    long long isize = 0;
    static PyObject* zero = PyLong_FromLong(0);
    if (r.is_malloc) {
      PyObject* python = Py_None;
      int has_stack = truthy(stack);
      if (has_stack < 0) throw py::error_already_set();
      if (has_stack) {
        python = PyDict_GetItemWithError(lines, stack);
        if (python == nullptr) {
          if (PyErr_Occurred()) throw py::error_already_set();
          return false;  // the line of a new stack: the Python loop finds it
        }
      }
      PyObject* label = Py_None;
      Ref owned_label;  // a describe label cut from the owner text (a new string)
      if (python == Py_None) {
        PyObject* owner = r.owner;
        int has_owner = truthy(owner);
        if (has_owner < 0) throw py::error_already_set();
        Py_ssize_t second = -1;
        if (has_owner) {
          // <pool>@<category>@<labels...>: the labels are the text after the second '@'
          if (!PyUnicode_CheckExact(owner)) return false;
          Py_ssize_t len = PyUnicode_GET_LENGTH(owner);
          Py_ssize_t first_at = PyUnicode_FindChar(owner, '@', 0, len, 1);
          if (first_at == -2) throw py::error_already_set();
          if (first_at >= 0) {
            second = PyUnicode_FindChar(owner, '@', first_at + 1, len, 1);
            if (second == -2) throw py::error_already_set();
          }
          if (second >= 0) {
            owned_label.o = PyUnicode_Substring(owner, second + 1, len);
            if (owned_label.o == nullptr) throw py::error_already_set();
            label = owned_label.o;
          }
        }
        if (second < 0 && PyDict_GET_SIZE(labels) > 0) {
          Ref made;  // the thread's number, made here for the lookup (the column replay)
          PyObject* tid = r.tid;
          if (tid == nullptr) {
            made.o = r.tid_null ? Py_NewRef(Py_None) : PyLong_FromLongLong(r.tid_val);
            if (made.o == nullptr) throw py::error_already_set();
            tid = made.o;
          }
          label = PyDict_GetItemWithError(labels, tid);
          if (label == nullptr) {
            if (PyErr_Occurred()) throw py::error_already_set();
            label = Py_None;
          }
        }
      }
      // the site: rows of one op (one name object) mostly have the same line and label; the sites
      // found in this call are remembered by those objects (no site is added or removed meanwhile)
      SiteHit& hit = site_hits[op];
      if (owned_label.o == nullptr && hit.site != nullptr && hit.device == device && hit.pool == pool &&
          hit.python == python && hit.label == label) {
        site = hit.site;
      } else {
        Ref skey(tuple_of({device, pool, op, python, label}));
        if (skey.get() == nullptr) throw py::error_already_set();
        site = PyDict_GetItemWithError(sites, skey.get());
        if (site == nullptr) {
          if (PyErr_Occurred()) throw py::error_already_set();
          return false;  // a new site: made by the Python loop
        }
        // a label made for this row dies with it: its address may come back as another string
        if (owned_label.o == nullptr) hit = SiteHit{device, pool, python, label, site};
      }
      size = r.size;
      int has_size = truthy(size);
      if (has_size < 0) throw py::error_already_set();
      if (!has_size) size = zero;
      if (!PyLong_CheckExact(size)) return false;  // a size that is not an int: the Python loop adds it
      int over = 0;
      isize = PyLong_AsLongLongAndOverflow(size, &over);
      if (over) return false;
    }
    // from here on the row is handled here: the step's lowest and highest ``used``, the level
    if (used == nullptr) {  // a number (the column loop): compared with the min/max as numbers
      if (late && !minmax_raw(mm, r.used_val)) throw py::error_already_set();
      pk.note_raw(r.used_val);
    } else if (late) {
      PyObject* lo = PyList_GET_ITEM(mm, 0);
      int lt = PyObject_RichCompareBool(used, lo, Py_LT);
      if (lt < 0) throw py::error_already_set();
      if (lt) {
        Py_INCREF(used);
        PyList_SetItem(mm, 0, used);
      } else {
        int gt = PyObject_RichCompareBool(used, PyList_GET_ITEM(mm, 1), Py_GT);
        if (gt < 0) throw py::error_already_set();
        if (gt) {
          Py_INCREF(used);
          PyList_SetItem(mm, 1, used);
        }
      }
    }
    if (used != nullptr) pk.note(used);  // level[pk] = used, put when the pool changes or the loop ends
    if (r.is_malloc) {
      deltas.add(site, isize);
      if (!site_set_last(site, aid, s_live, s_last)) throw py::error_already_set();
      PyObject* bv[2] = {site, size};
      if (!blocks->put(pk.bpk, aid, bv)) throw py::error_already_set();
      if (late) {  // (step, row id: made when asked for, addr, size, op, stack)
        PyObject* pv[6] = {step, r.id, r.addr, size, op, stack};
        if (!pending->put(pk.ppk, aid, pv, r.id ? -1 : 1, r.id_val)) throw py::error_already_set();
      }
    } else {
      int64_t e = blocks->find(pk.bpk, aid);
      if (e == -2) throw py::error_already_set();
      if (e >= 0) {
        Ref vs(Py_NewRef(blocks->borrowed(e, 0)));  // held past the erase
        Ref vsize(Py_NewRef(blocks->borrowed(e, 1)));
        if (!blocks->erase(e)) throw py::error_already_set();
        int over = 1;
        long long d = PyLong_CheckExact(vsize.get()) ? PyLong_AsLongLongAndOverflow(vsize.get(), &over) : 0;
        if (!over) {
          deltas.add(vs.get(), -d);
        } else if (!site_add_live(vs.get(), vsize.get(), true, s_live, s_last)) {
          throw py::error_already_set();
        }
        Ref last(site_get_last(vs.get(), s_live, s_last));
        if (last.get() == nullptr) throw py::error_already_set();
        int eq = PyObject_RichCompareBool(last.get(), aid, Py_EQ);
        if (eq < 0) throw py::error_already_set();
        if (eq && !site_set_last(vs.get(), Py_None, s_live, s_last)) throw py::error_already_set();
      }
      int64_t pe = pending->size() > 0 ? pending->find(pk.ppk, aid) : -1;
      if (pe == -2) throw py::error_already_set();
      if (pe >= 0) {
        if (!pending->erase(pe)) throw py::error_already_set();
      } else if (PyDict_GET_SIZE(reported) > 0) {
        Ref key(tuple_of({device, pool, aid}));
        if (key.get() == nullptr) throw py::error_already_set();
        Ref rec(dict_pop(reported, key.get()));
        if (rec.get() == nullptr) throw py::error_already_set();
        if (rec.get() != Py_None && PyObject_SetItem(rec.get(), s_freed, step) != 0) throw py::error_already_set();
      }
    }
    return true;
  }

  void finish() {
    if (!pk.put_level()) throw py::error_already_set();
    if (!deltas.apply()) throw py::error_already_set();
  }

 private:
  PyObject *hal, *s_live, *s_last, *s_freed, *sites, *level, *cur, *lines, *labels, *reported, *step;
  KeyTable* blocks = nullptr;
  KeyTable* pending = nullptr;
  bool late = false;
  LastPool pk;
  Deltas deltas;
  struct SiteHit {  // borrowed: the rows hold the keys' objects, ``sites`` the site
    PyObject *device = nullptr, *pool = nullptr, *python = nullptr, *label = nullptr, *site = nullptr;
  };
  std::unordered_map<PyObject*, SiteHit> site_hits;  // op name object -> its last site
};
}  // namespace

int64_t leak_rows(py::handle rows_h, int64_t start, py::handle first_h, py::handle step_h, py::tuple consts,
                  py::tuple state) {
  PyObject* rows = rows_h.ptr();
  if (!PyList_Check(rows)) return start;
  LeakLoop loop(step_h, consts, state);
  if (!loop.ready) return start;
  // the rows' IDs: first, first + 1, ... (online), or a list of them (the offline replay)
  PyObject* first = first_h.ptr();
  PyObject* ids = PyList_CheckExact(first) ? first : nullptr;
  long long first_no = 0;
  if (ids == nullptr) {
    first_no = PyLong_AsLongLong(first);
    if (first_no == -1 && PyErr_Occurred()) throw py::error_already_set();
  }
  Py_ssize_t n = PyList_GET_SIZE(rows);
  if (ids != nullptr && PyList_GET_SIZE(ids) < n) n = PyList_GET_SIZE(ids);  // no row without its ID
  Py_ssize_t i = (Py_ssize_t)start;
  for (; i < n; ++i) {
    PyObject* r = PyList_GET_ITEM(rows, i);
    if (!PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r) < 10) break;
    PyObject* ev = PyTuple_GET_ITEM(r, 0);
    LeakRow row;
    if (ev == loop.ev_malloc) {  // the sources' own string objects first, then any equal string
      row.is_malloc = true;
    } else if (ev == loop.ev_free) {
      row.is_malloc = false;
    } else if (ev == loop.ev_launch || ev == loop.ev_access || same_str(ev, loop.ev_launch) ||
               same_str(ev, loop.ev_access)) {
      continue;  // most rows: nothing to do
    } else if (same_str(ev, loop.ev_malloc)) {
      row.is_malloc = true;
    } else if (same_str(ev, loop.ev_free)) {
      row.is_malloc = false;
    } else {
      break;
    }
    PyObject* a = PyTuple_GET_ITEM(r, 7);
    if (!PyTuple_CheckExact(a) || PyTuple_GET_SIZE(a) < 5) break;
    row.pool = PyTuple_GET_ITEM(r, 1);
    row.device = PyTuple_GET_ITEM(r, 5);
    row.op = PyTuple_GET_ITEM(r, 2);
    row.tid = PyTuple_GET_ITEM(r, 4);
    row.stack = PyTuple_GET_ITEM(r, 8);
    row.aid = PyTuple_GET_ITEM(a, 0);
    row.addr = PyTuple_GET_ITEM(a, 1);
    row.size = PyTuple_GET_ITEM(a, 2);
    row.used = PyTuple_GET_ITEM(a, 3);
    row.owner = PyTuple_GET_SIZE(a) > 5 ? PyTuple_GET_ITEM(a, 5) : Py_None;
    row.id = ids ? PyList_GET_ITEM(ids, i) : nullptr;
    row.id_val = first_no + (long long)i;
    if (!loop.take(row)) break;
  }
  loop.finish();
  return (int64_t)i;
}


// ---------------------------------------------------------------- the offline replay's rows
// (analysis/leaks.py _replay_rows) made from a dump's columns with no Python per row: the string
// columns come as (codes, values) of a categorical column (each distinct string one object, the
// event and pool names interned: the loop above then finds them by identity), the int columns as
// (int64 values, null mask or None), a column the dump lacks as None. cols = (id, event,
// event_type, name, tid, device, alloc_id, addr, size, used, owner, py_stack); consts = (MALLOC,
// FREE). Returns (rows, ids, others): the MALLOC/FREE rows in events.RawRow order with their Attr
// tuples, as the Python replay makes them; None in the place of every other row, whose index in
// the batch is in ``others`` (the replay makes those from their Attr text).
namespace {
// A column's values through the buffer protocol (a numpy array from the reader's frame, or the
// bytes the native source's take_packed makes): no conversion, a few hundred nanoseconds a column
// (pybind11's array_t::ensure was ~1-2 us each, 12 columns a call of a loop that is called per
// flush and per row it leaves).
struct Buf {
  Py_buffer view{};
  bool held = false;
  Buf() = default;
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  // the buffer of ``o`` holding at least n items of ``size`` bytes (its items of that size, or bytes)
  const void* bind(PyObject* o, Py_ssize_t n, Py_ssize_t size, const char* what) {
    if (PyObject_GetBuffer(o, &view, PyBUF_C_CONTIGUOUS) != 0) throw py::error_already_set();
    held = true;
    if ((view.itemsize != size && view.itemsize != 1) || view.len < n * size)
      throw py::value_error(std::string("replay_rows: a column is not ") + what + " or is shorter than the rows");
    return view.buf;
  }
  ~Buf() {
    if (held) PyBuffer_Release(&view);
  }
};

struct ColumnView {
  bool present = false, text = false;
  Buf cb, vb, mb;
  PyObject* values = nullptr;  // borrowed from the cols tuple: the strings by code
  Py_ssize_t nvalues = 0;
  bool has_nulls = false;
  const uint32_t* c = nullptr;
  const int64_t* v = nullptr;
  const bool* m = nullptr;

  void bind(py::handle col, bool is_text, Py_ssize_t n) {
    if (col.is_none()) return;
    py::tuple t = py::reinterpret_borrow<py::tuple>(col);
    present = true;
    text = is_text;
    if (is_text) {
      values = t[1].ptr();
      if (!PyList_Check(values)) throw py::type_error("replay_rows: a text column is (uint32 codes, list)");
      nvalues = PyList_GET_SIZE(values);
      c = (const uint32_t*)cb.bind(t[0].ptr(), n, 4, "uint32 codes");
    } else {
      v = (const int64_t*)vb.bind(t[0].ptr(), n, 8, "int64 values");
      if (!t[1].is_none()) {
        m = (const bool*)mb.bind(t[1].ptr(), n, 1, "a bool mask");
        has_nulls = true;
      }
    }
  }
  // row i's value: a new reference
  PyObject* get(Py_ssize_t i) const {
    if (!present) Py_RETURN_NONE;
    if (text) {
      uint32_t k = c[i];
      PyObject* o = (Py_ssize_t)k < nvalues ? PyList_GET_ITEM(values, k) : Py_None;  // past the values: null
      Py_INCREF(o);
      return o;
    }
    if (has_nulls && m[i]) Py_RETURN_NONE;
    return PyLong_FromLongLong(v[i]);
  }
  // row i's string, borrowed (null: not a text column, or a null)
  PyObject* str(Py_ssize_t i) const {
    if (!present || !text) return nullptr;
    uint32_t k = c[i];
    return (Py_ssize_t)k < nvalues ? PyList_GET_ITEM(values, k) : nullptr;
  }
};
}  // namespace

py::tuple replay_rows(py::tuple cols, Py_ssize_t start, Py_ssize_t stop, py::tuple consts) {
  enum { ID, EV, ET, NAME, TID, DEV, AID, ADDR, SIZE, USED, OWNER, STACK, NCOLS };
  if (cols.size() != NCOLS) throw py::value_error("replay_rows: 12 columns");
  static const bool is_text[NCOLS] = {false, true, true, true, false, true, false, false, false, false, true, true};
  ColumnView v[NCOLS];
  for (int j = 0; j < NCOLS; ++j) v[j].bind(cols[j], is_text[j], stop);
  if (!v[EV].present || !v[EV].text) throw py::value_error("replay_rows: no event column");
  PyObject* ev_malloc = consts[0].ptr();
  PyObject* ev_free = consts[1].ptr();
  Py_ssize_t n = std::max<Py_ssize_t>(0, stop - start);
  Ref rows(PyList_New(n)), ids(PyList_New(n)), others(PyList_New(0));
  if (rows.get() == nullptr || ids.get() == nullptr || others.get() == nullptr) throw py::error_already_set();
  for (Py_ssize_t k = 0; k < n; ++k) {
    Py_ssize_t i = start + k;
    PyObject* id = v[ID].get(i);
    if (id == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(ids.get(), k, id);
    PyObject* ev = v[EV].str(i);
    bool is_malloc = ev != nullptr && (ev == ev_malloc || same_str(ev, ev_malloc));
    bool is_free = !is_malloc && ev != nullptr && (ev == ev_free || same_str(ev, ev_free));
    if (!is_malloc && !is_free) {
      Py_INCREF(Py_None);
      PyList_SET_ITEM(rows.get(), k, Py_None);
      Ref at(PyLong_FromSsize_t(k));
      if (at.get() == nullptr || PyList_Append(others.get(), at.get()) != 0) throw py::error_already_set();
      continue;
    }
    // (alloc_id, addr, size, used, None[, owner])
    Ref a(PyTuple_New(is_malloc ? 6 : 5));
    if (a.get() == nullptr) throw py::error_already_set();
    const int attr_cols[4] = {AID, ADDR, SIZE, USED};
    for (int j = 0; j < 4; ++j) {
      PyObject* x = v[attr_cols[j]].get(i);
      if (x == nullptr) throw py::error_already_set();
      PyTuple_SET_ITEM(a.get(), j, x);
    }
    Py_INCREF(Py_None);
    PyTuple_SET_ITEM(a.get(), 4, Py_None);
    if (is_malloc) {
      PyObject* owner = v[OWNER].get(i);
      if (owner == nullptr) throw py::error_already_set();
      PyTuple_SET_ITEM(a.get(), 5, owner);
    }
    // (event, event_type, name, None, tid, device, None, attr, py_stack, None)
    PyObject* items[10] = {nullptr};
    items[0] = v[EV].get(i);
    items[1] = v[ET].get(i);
    items[2] = v[NAME].get(i);
    items[3] = Py_NewRef(Py_None);
    items[4] = v[TID].get(i);
    items[5] = v[DEV].get(i);
    items[6] = Py_NewRef(Py_None);
    items[7] = a.release();
    items[8] = is_malloc ? v[STACK].get(i) : Py_NewRef(Py_None);
    items[9] = Py_NewRef(Py_None);
    PyObject* r = PyTuple_New(10);
    bool ok = r != nullptr;
    for (int j = 0; j < 10; ++j) {
      if (items[j] == nullptr) ok = false;
      if (r != nullptr && items[j] != nullptr) PyTuple_SET_ITEM(r, j, items[j]);
      else Py_XDECREF(items[j]);
    }
    if (!ok) {
      Py_XDECREF(r);
      throw py::error_already_set();
    }
    PyList_SET_ITEM(rows.get(), k, r);
  }
  return py::make_tuple(py::reinterpret_steal<py::object>(rows.release()),
                        py::reinterpret_steal<py::object>(ids.release()),
                        py::reinterpret_steal<py::object>(others.release()));
}

// leak_columns(cols, start, stop, step, consts, state): leak_rows over the rows of ``replay_rows``'
// columns (the same cols), with no row tuple made: a MALLOC/FREE row's numbers are made as it is
// taken (its ID only where the pending table is asked for it), its strings are the columns'
// objects. Stops, as leak_rows does, at the first row it does not take, and at every row that is
// not a MALLOC/FREE (the offline replay's MSTX, STEP and summary rows): the replay makes that one
// row (replay_rows) for the Python loop and calls again.
int64_t leak_columns(py::tuple cols, Py_ssize_t start, Py_ssize_t stop, py::handle step_h, py::tuple consts,
                     py::tuple state) {
  enum { ID, EV, ET, NAME, TID, DEV, AID, ADDR, SIZE, USED, OWNER, STACK, NCOLS };
  if (cols.size() != NCOLS) throw py::value_error("leak_columns: 12 columns");
  static const bool is_text[NCOLS] = {false, true, true, true, false, true, false, false, false, false, true, true};
  ColumnView v[NCOLS];
  for (int j = 0; j < NCOLS; ++j) v[j].bind(cols[j], is_text[j], stop);
  if (!v[EV].present || !v[EV].text || !v[ID].present || v[ID].text)
    throw py::value_error("leak_columns: no event or ID column");
  LeakLoop loop(step_h, consts, state);
  if (!loop.ready) return start;
  auto text = [&](int j, Py_ssize_t i) {  // borrowed; None for a null or a missing column
    PyObject* o = v[j].str(i);
    return o != nullptr ? o : Py_None;
  };
  Py_ssize_t i = start;
  for (; i < stop; ++i) {
    PyObject* ev = v[EV].str(i);
    LeakRow row;
    if (ev == nullptr) break;
    if (ev == loop.ev_malloc || same_str(ev, loop.ev_malloc)) {
      row.is_malloc = true;
    } else if (!(ev == loop.ev_free || same_str(ev, loop.ev_free))) {
      break;
    }
    if (v[ID].has_nulls && v[ID].m[i]) break;
    row.id_val = v[ID].v[i];
    row.pool = text(ET, i);
    row.device = text(DEV, i);
    row.op = text(NAME, i);
    row.stack = row.is_malloc ? text(STACK, i) : Py_None;
    row.owner = row.is_malloc ? text(OWNER, i) : Py_None;
    if (v[TID].present && !(v[TID].has_nulls && v[TID].m[i])) {
      row.tid_val = v[TID].v[i];
    } else {
      row.tid_null = true;
    }
    // the numbers a row keeps or looks up as ints; ``used`` as a number unless null, the size and
    // address of a FREE are not read
    Ref aid(v[AID].get(i));
    Ref size(row.is_malloc ? v[SIZE].get(i) : Py_NewRef(Py_None));
    Ref used;
    if (v[USED].present && !(v[USED].has_nulls && v[USED].m[i])) {
      row.used_val = v[USED].v[i];
    } else {
      used.o = Py_NewRef(Py_None);
    }
    if (aid.get() == nullptr || size.get() == nullptr) throw py::error_already_set();
    Ref addr(row.is_malloc ? v[ADDR].get(i) : Py_NewRef(Py_None));
    if (addr.get() == nullptr) throw py::error_already_set();
    row.aid = aid.get();
    row.size = size.get();
    row.used = used.get();
    row.addr = addr.get();
    if (!loop.take(row)) break;
  }
  loop.finish();
  return (int64_t)i;
}

// ---------------------------------------------------------------- Attr fields of a text dump
// The Attr texts our writer prints for MALLOC/FREE and for ACCESS rows (io/reader.py _MEM_ATTR,
// _ACCESS_ATTR: the same texts, field for field), parsed in one pass over a string column's Arrow
// buffers (the Arrow C stream interface that polars exports: no pyarrow, no copy of the text).
// A text that is not the template is not matched: the reader reads it key by key, as it reads
// every other text. A number of a matched text that does not fit in 64 bits is null, as polars'
// cast of its digits makes it.
namespace {
// The Arrow C data interface's structs, as its specification lays them out (a stable ABI).
struct ArrowSchema {
  const char* format;
  const char* name;
  const char* metadata;
  int64_t flags;
  int64_t n_children;
  ArrowSchema** children;
  ArrowSchema* dictionary;
  void (*release)(ArrowSchema*);
  void* private_data;
};
struct ArrowArray {
  int64_t length;
  int64_t null_count;
  int64_t offset;
  int64_t n_buffers;
  int64_t n_children;
  const void** buffers;
  ArrowArray** children;
  ArrowArray* dictionary;
  void (*release)(ArrowArray*);
  void* private_data;
};
struct ArrowArrayStream {
  int (*get_schema)(ArrowArrayStream*, ArrowSchema*);
  int (*get_next)(ArrowArrayStream*, ArrowArray*);
  const char* (*get_last_error)(ArrowArrayStream*);
  void (*release)(ArrowArrayStream*);
  void* private_data;
};

// the strings of one chunk, by row: null (no text) or (pointer, length)
struct StringChunk {
  enum Kind { UTF8, LARGE_UTF8, VIEW } kind;
  const ArrowArray* a;
  bool get(int64_t i, const char*& p, int64_t& n) const {
    int64_t j = a->offset + i;
    const uint8_t* valid = (const uint8_t*)a->buffers[0];
    if (valid && !(valid[j >> 3] >> (j & 7) & 1)) return false;
    if (kind == UTF8) {
      const int32_t* off = (const int32_t*)a->buffers[1];
      p = (const char*)a->buffers[2] + off[j];
      n = off[j + 1] - off[j];
    } else if (kind == LARGE_UTF8) {
      const int64_t* off = (const int64_t*)a->buffers[1];
      p = (const char*)a->buffers[2] + off[j];
      n = off[j + 1] - off[j];
    } else {  // 16 bytes a view: length, then the text inline (<= 12) or prefix, buffer, offset
      const uint8_t* v = (const uint8_t*)a->buffers[1] + 16 * j;
      int32_t len, buf, at;
      std::memcpy(&len, v, 4);
      n = len;
      if (len <= 12) {
        p = (const char*)v + 4;
      } else {
        std::memcpy(&buf, v + 8, 4);
        std::memcpy(&at, v + 12, 4);
        p = (const char*)a->buffers[2 + buf] + at;
      }
    }
    return true;
  }
};

// a string column's chunks, taken from its Arrow C stream capsule (None: no chunks, every row
// null); its rows read in order with ``get``
struct TextsIn {
  std::vector<ArrowArray> chunks;
  StringChunk::Kind ck = StringChunk::UTF8;
  size_t at = 0;       // the chunk being read
  int64_t base = 0;    // its first row
  explicit TextsIn(py::object capsule) {
    if (capsule.is_none()) return;
    auto* stream = (ArrowArrayStream*)PyCapsule_GetPointer(capsule.ptr(), "arrow_array_stream");
    if (!stream) throw py::error_already_set();
    struct StreamGuard {
      ArrowArrayStream* s;
      ~StreamGuard() { if (s->release) s->release(s); }
    } sg{stream};
    try {
      ArrowSchema schema{};
      if (stream->get_schema(stream, &schema) != 0) throw py::value_error("a string column: no schema");
      std::string fmt = schema.format ? schema.format : "";
      if (schema.release) schema.release(&schema);
      if (fmt == "u") ck = StringChunk::UTF8;
      else if (fmt == "U") ck = StringChunk::LARGE_UTF8;
      else if (fmt == "vu") ck = StringChunk::VIEW;
      else throw py::value_error("not a string column (format " + fmt + ")");
      for (;;) {
        ArrowArray a{};
        if (stream->get_next(stream, &a) != 0) throw py::value_error("a string column: the stream failed");
        if (!a.release) break;  // the end
        chunks.push_back(a);
        if ((ck == StringChunk::VIEW && a.n_buffers < 3) || (ck != StringChunk::VIEW && a.n_buffers != 3))
          throw py::value_error("a string column: a chunk without its buffers");
      }
    } catch (...) {  // no destructor runs for a constructor that throws
      release();
      throw;
    }
  }
  ~TextsIn() { release(); }
  TextsIn(const TextsIn&) = delete;
  TextsIn& operator=(const TextsIn&) = delete;
  void release() {
    for (auto& a : chunks)
      if (a.release) a.release(&a);
  }
  // row i's text (rows asked for in increasing order); false where null
  bool get(int64_t i, const char*& p, int64_t& n) {
    while (at < chunks.size() && i >= base + chunks[at].length) base += chunks[at++].length;
    if (at >= chunks.size()) return false;
    StringChunk sc{ck, &chunks[at]};
    return sc.get(i - base, p, n);
  }
  int64_t rows() const {
    int64_t n = 0;
    for (auto& a : chunks) n += a.length;
    return n;
  }
};

// an optional numpy array of n items: its data, or nullptr for None (``keep`` holds the array)
template <typename T>
const T* optional_array(py::object obj, int64_t n, carr<T>& keep, const char* what) {
  if (obj.is_none()) return nullptr;
  keep = carr<T>::ensure(obj);
  if (!keep || keep.size() != n) throw py::value_error(std::string(what) + " of another length");
  return keep.data();
}

// a cursor over one text, each step what the template's pattern asks
struct Cursor {
  const char* p;
  const char* e;
  bool lit(const char* s, size_t k) {
    if ((size_t)(e - p) < k || std::memcmp(p, s, k) != 0) return false;
    p += k;
    return true;
  }
  template <size_t K>
  bool lit(const char (&s)[K]) { return lit(s, K - 1); }
  // -?\d+ (neg: a minus allowed) into a signed 64-bit value; past 64 bits, bit ``flag`` is set
  // in ``over`` (the value is null)
  bool num(int64_t& out, bool neg_ok, uint8_t& over, uint8_t flag) {
    bool neg = neg_ok && p < e && *p == '-';
    if (neg) ++p;
    if (p >= e || *p < '0' || *p > '9') return false;
    uint64_t v = 0;
    const uint64_t limit = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    for (; p < e && *p >= '0' && *p <= '9'; ++p) {
      uint64_t d = (uint64_t)(*p - '0');
      if (v > (limit - d) / 10) over |= flag;
      v = v * 10 + d;
    }
    out = neg ? (int64_t)(0 - v) : (int64_t)v;
    return true;
  }
  // [0-9a-fA-F]+ into a value that fits int64 (the reader's addr column), else as num
  bool hex(int64_t& out, uint8_t& over, uint8_t flag) {
    uint64_t v = 0;
    const char* s = p;
    for (; p < e; ++p) {
      int d = *p >= '0' && *p <= '9' ? *p - '0' : *p >= 'a' && *p <= 'f' ? *p - 'a' + 10
            : *p >= 'A' && *p <= 'F' ? *p - 'A' + 10 : -1;
      if (d < 0) break;
      if (v > ((uint64_t)INT64_MAX - (uint64_t)d) / 16) over |= flag;
      v = v * 16 + (uint64_t)d;
    }
    out = (int64_t)v;
    return p > s;
  }
  // [^",}\\]* then the closing quote: the text's span
  bool text(const char*& s, int64_t& n) {
    s = p;
    while (p < e && *p != '"' && *p != ',' && *p != '}' && *p != '\\') ++p;
    n = p - s;
    return p < e && *p++ == '"';
  }
  // [^<stop>]* up to (and past) the byte stop
  bool skip_to(char stop) {
    while (p < e && *p != stop) ++p;
    return p < e && *p++ == stop;
  }
};

// The text may hold a number over 64 bits: a superset of io/validate.py's pattern
// [:,]\s*-?\d{19,} (any byte past ASCII counts: a Unicode space or digit is one to the pattern),
// which then looks at the rows marked only.
bool big_number_maybe(const char* p, const char* e) {
  for (const char* q = p; q < e; ++q) {
    unsigned char ch = (unsigned char)*q;
    if (ch >= 0x80) return true;
    if (ch != ':' && ch != ',') continue;
    const char* r = q + 1;
    while (r < e && (*r == ' ' || (*r >= '\t' && *r <= '\r'))) ++r;
    if (r < e && *r == '-') ++r;
    const char* d = r;
    while (r < e && *r >= '0' && *r <= '9') ++r;
    if (r - d >= 19 || (r < e && (unsigned char)*r >= 0x80)) return true;
  }
  return false;
}

// distinct texts by code, kept in order of first appearance (plain C++: filled by the parse
// threads without the GIL, made Python strings at the end)
struct Codes {
  std::unordered_map<std::string, int32_t> index;
  std::vector<std::string> values;
  int32_t code(const char* s, int64_t n) {
    std::string k(s, (size_t)n);
    auto it = index.find(k);
    if (it != index.end()) return it->second;
    int32_t c = (int32_t)values.size();
    index.emplace(k, c);
    values.push_back(std::move(k));
    return c;
  }
  py::list to_list() const {
    py::list out;
    for (const std::string& v : values) {
      PyObject* o = PyUnicode_DecodeUTF8(v.data(), (Py_ssize_t)v.size(), "strict");
      if (!o) throw py::error_already_set();
      out.append(py::reinterpret_steal<py::object>(o));
    }
    return out;
  }
};

// the output columns of attr_fields, as raw pointers the parse threads write through
struct AttrOut {
  bool* M;
  uint8_t* OV;
  int64_t *A, *S, *U, *T, *D;
  int32_t *O, *MO, *PH;
};

// one thread's share: the rows of chunks [c0, c1), the first of them at row ``row``
void parse_attr_chunks(const std::vector<ArrowArray>& chunks, size_t c0, size_t c1, int64_t row,
                       StringChunk::Kind ck, int kind_all, const uint8_t* kinds, const AttrOut& o, Codes& owners,
                       Codes& modules, Codes& phases) {
  bool* M = o.M;
  uint8_t* OV = o.OV;
  int64_t *A = o.A, *S = o.S, *U = o.U, *T = o.T, *D = o.D;
  int32_t *O = o.O, *MO = o.MO, *PH = o.PH;
  for (size_t ci = c0; ci < c1; ++ci) {
    const ArrowArray& a = chunks[ci];
    StringChunk sc{ck, &a};
    for (int64_t i = 0; i < a.length; ++i, ++row) {
      M[row] = false;
      OV[row] = 0;
      A[row] = S[row] = U[row] = T[row] = D[row] = 0;
      O[row] = MO[row] = PH[row] = -1;
      // the row's template: the one asked for, or per row (kinds: 0 none, 1 MALLOC/FREE, 2 ACCESS)
      int kind = kind_all;
      if (kinds != nullptr) {
        if (kinds[row] == 0) continue;
        kind = kinds[row] == 1 ? 0 : 1;
      }
      const char* p;
      int64_t len;
      if (!sc.get(i, p, len)) continue;
      Cursor c{p, p + len};
      if (kind == 0 && big_number_maybe(p, p + len)) OV[row] |= 32;
      bool ok;
      if (kind == 0) {
        const char *os = nullptr, *ms = nullptr, *ps = nullptr;
        int64_t on = 0, mn = 0, pn = 0;
        uint8_t& ov = OV[row];
        ok = c.lit("{\"allocation_id\":") && c.num(A[row], false, ov, 1) && c.lit(",\"addr\":\"0x") &&
             c.hex(D[row], ov, 16) && c.lit("\",\"size\":") && c.num(S[row], false, ov, 2) &&
             c.lit(",\"used\":") && c.num(U[row], true, ov, 4) && c.lit(",\"total\":") && c.num(T[row], true, ov, 8);
        if (ok && c.lit(",\"owner\":\"")) ok = c.text(os, on);
        if (ok && c.lit(",\"module\":\"")) {
          ok = c.text(ms, mn);
          if (ok && c.lit(",\"phase\":\"")) ok = c.text(ps, pn);
        }
        ok = ok && c.lit("}") && c.p == c.e;
        if (ok) {
          if (os) O[row] = owners.code(os, on);
          if (ms) MO[row] = modules.code(ms, mn);
          if (ps) PH[row] = phases.code(ps, pn);
        }
      } else {
        ok = c.lit("{\"dtype\":\"") && c.skip_to('"') && c.lit(",\"shape\":[") && c.skip_to(']') &&
             c.lit(",\"size\":") && c.num(S[row], false, OV[row], 2) && c.lit(",\"allocation_id\":") &&
             c.num(A[row], false, OV[row], 1) && c.lit("}") && c.p == c.e;
      }
      M[row] = ok;
    }
  }
}

// the threads the parse may use: the cores, fewer where POLARS_MAX_THREADS says so (the summary
// shares the cores among its worker processes that way)
unsigned parse_threads() {
  unsigned n = std::max(1u, std::thread::hardware_concurrency());
  if (const char* env = std::getenv("POLARS_MAX_THREADS")) {
    long v = std::strtol(env, nullptr, 10);
    if (v >= 1) n = std::min<unsigned>(n, (unsigned)v);
  }
  return std::min(n, 8u);
}

// codes of ``local`` (one thread's) turned into those of ``global``, over rows [r0, r1)
void merge_codes(Codes& global, const Codes& local, int32_t* codes, int64_t r0, int64_t r1) {
  std::vector<int32_t> to(local.values.size());
  bool same = true;
  for (size_t j = 0; j < local.values.size(); ++j) {
    const std::string& v = local.values[j];
    to[j] = global.code(v.data(), (int64_t)v.size());
    same = same && to[j] == (int32_t)j;
  }
  if (same) return;
  for (int64_t r = r0; r < r1; ++r)
    if (codes[r] >= 0) codes[r] = to[codes[r]];
}
}  // namespace

// attr_fields(stream, kind): stream is the Arrow C stream capsule of a string column (polars:
// Series.__arrow_c_stream__()), kind 0 for the MALLOC/FREE template, 1 for ACCESS. Returns
// (matched bool[n], alloc_id, size, used, total, addr as int64[n], over uint8[n]: bit k set where
// the k-th of those five numbers is past 64 bits, bit 5 where any text (matched or not) may hold
// a number past 64 bits (big_number_maybe), then for each of owner, module, phase: (int32
// codes[n], -1 where absent, and the list of its distinct texts)); for ACCESS only matched,
// alloc_id and size mean anything. ``kinds`` (uint8[n], or None): each row's template instead of
// ``kind``'s: 0 none (the row is passed over), 1 MALLOC/FREE, 2 ACCESS, so that one pass reads a
// dump's column. The chunks are parsed by a few threads without the GIL (the CSV parse has no
// other work for the second core then); the codes come out as one thread's would.
py::tuple attr_fields(py::object capsule, int kind, py::object kinds_obj) {
  if (capsule.is_none()) throw py::value_error("attr_fields: no column");
  TextsIn in(capsule);
  const std::vector<ArrowArray>& chunks = in.chunks;
  const StringChunk::Kind ck = in.ck;
  int64_t n = 0;
  std::vector<int64_t> starts;  // the first row of each chunk, then the row count
  for (const ArrowArray& a : chunks) {
    starts.push_back(n);
    n += a.length;
  }
  starts.push_back(n);
  carr<uint8_t> kinds_a;
  const uint8_t* kinds = optional_array(kinds_obj, n, kinds_a, "attr_fields: kinds");
  py::array_t<bool> matched(n);
  py::array_t<int64_t> aid(n), size(n), used(n), total(n), addr(n);
  py::array_t<int32_t> oc(n), mc(n), pc(n);
  py::array_t<uint8_t> over(n);
  AttrOut o{matched.mutable_data(), over.mutable_data(), aid.mutable_data(), size.mutable_data(),
            used.mutable_data(), total.mutable_data(), addr.mutable_data(), oc.mutable_data(),
            mc.mutable_data(), pc.mutable_data()};

  // the chunks cut into contiguous shares of about equal rows (a small column: one share)
  const unsigned want = n >= (1 << 16) ? parse_threads() : 1;
  std::vector<size_t> cut{0};
  for (unsigned t = 1; t < want; ++t) {
    const int64_t goal = n * (int64_t)t / (int64_t)want;
    size_t c = cut.back();
    while (c < chunks.size() && starts[c + 1] <= goal) ++c;
    if (c > cut.back() && c < chunks.size()) cut.push_back(c);
  }
  cut.push_back(chunks.size());
  const size_t shares = cut.size() - 1;
  std::vector<Codes> owners(shares), modules(shares), phases(shares);
  std::vector<char> failed(shares, 0);  // out of memory in a share: raised once all have ended
  {
    py::gil_scoped_release nogil;
    auto share = [&](size_t t) {
      try {
        parse_attr_chunks(chunks, cut[t], cut[t + 1], starts[cut[t]], ck, kind, kinds, o, owners[t], modules[t],
                          phases[t]);
      } catch (...) {
        failed[t] = 1;
      }
    };
    std::vector<std::thread> threads;
    for (size_t t = 1; t < shares; ++t) {
      try {
        threads.emplace_back(share, t);
      } catch (...) {  // no thread to be had: this one does the share
        share(t);
      }
    }
    share(0);
    for (auto& th : threads) th.join();
  }
  if (std::find(failed.begin(), failed.end(), 1) != failed.end()) throw std::bad_alloc();
  for (size_t t = 1; t < shares; ++t) {
    const int64_t r0 = starts[cut[t]], r1 = starts[cut[t + 1]];
    merge_codes(owners[0], owners[t], o.O, r0, r1);
    merge_codes(modules[0], modules[t], o.MO, r0, r1);
    merge_codes(phases[0], phases[t], o.PH, r0, r1);
  }
  return py::make_tuple(matched, aid, size, used, total, addr, over, py::make_tuple(oc, owners[0].to_list()),
                        py::make_tuple(mc, modules[0].to_list()), py::make_tuple(pc, phases[0].to_list()));
}

// ---------------------------------------------------------------- texts made in C++, for polars
// (issue 22) The text columns a full read makes again from stored fields: an address as
// 0x%016x, and the MALLOC/FREE rows' Attr text (io/columns.py ``hex16``, ``template_attr``).
// They come out as one Arrow large-string array in an Arrow C stream (a PyCapsule), which
// polars takes as it is (``pl.Series`` of an object with ``__arrow_c_stream__``): no pyarrow,
// no copy, no per-row Python.
namespace {

// a string column being made: offsets, bytes, validity
struct TextsOut {
  std::vector<int64_t> offsets{0};
  std::vector<char> data;
  std::vector<uint8_t> valid;  // a bit a row (Arrow's order), made only once a null is met
  int64_t nulls = 0;
  int64_t n = 0;
  void end_row() {
    offsets.push_back((int64_t)data.size());
    ++n;
  }
  void null_row() {
    if (valid.empty()) valid.assign((size_t)((n + 8) / 8 + 1), 0xFF);
    // grown to hold row n whatever the gap since the last null (doubling once was not enough
    // for a null far after the one before: a write past the end)
    if (valid.size() * 8 <= (size_t)n) valid.resize(std::max(valid.size() * 2 + 1, (size_t)n / 8 + 2), 0xFF);
    valid[(size_t)n >> 3] &= (uint8_t)~(1u << (n & 7));
    ++nulls;
    end_row();
  }
  void finish() {  // the validity covers every row
    if (!valid.empty()) valid.resize((size_t)(n + 7) / 8 + 1, 0xFF);
  }
  void put(const char* p, size_t k) { data.insert(data.end(), p, p + k); }
  template <size_t K>
  void lit(const char (&s)[K]) { put(s, K - 1); }
  void num(int64_t v) {
    char buf[24];
    char* e = buf + sizeof buf;
    char* q = e;
    uint64_t u = v < 0 ? 0 - (uint64_t)v : (uint64_t)v;
    do {
      *--q = (char)('0' + u % 10);
      u /= 10;
    } while (u);
    if (v < 0) *--q = '-';
    put(q, (size_t)(e - q));
  }
  void hex16(uint64_t v) {
    static const char* digits = "0123456789abcdef";
    char buf[16];
    for (int k = 15; k >= 0; --k, v >>= 4) buf[k] = digits[v & 15];
    put(buf, 16);
  }
};

struct TextsStream {  // what the exported stream owns until its one array is taken
  TextsOut t;
  bool given = false;
};

struct TextsArray {  // what the array owns: polars keeps it (no copy) and releases it when done
  TextsOut t;
  const void* buffers[3];
};

void texts_schema_release(ArrowSchema* s) { s->release = nullptr; }

int texts_get_schema(ArrowArrayStream*, ArrowSchema* out) {
  *out = ArrowSchema{};
  out->format = "U";
  out->name = "";
  out->flags = 2;  // nullable
  out->release = texts_schema_release;
  return 0;
}

void texts_array_release(ArrowArray* a) {
  delete (TextsArray*)a->private_data;
  a->private_data = nullptr;
  a->release = nullptr;
}

int texts_get_next(ArrowArrayStream* st, ArrowArray* out) {
  auto* ts = (TextsStream*)st->private_data;
  *out = ArrowArray{};
  if (ts->given) return 0;  // the end: a released array
  ts->given = true;
  auto* own = new TextsArray{std::move(ts->t), {}};
  own->buffers[0] = own->t.nulls ? own->t.valid.data() : nullptr;
  own->buffers[1] = own->t.offsets.data();
  own->buffers[2] = own->t.data.empty() ? (const void*)"" : own->t.data.data();
  out->length = own->t.n;
  out->null_count = own->t.nulls;
  out->n_buffers = 3;
  out->buffers = own->buffers;
  out->release = texts_array_release;
  out->private_data = own;
  return 0;
}

const char* texts_last_error(ArrowArrayStream*) { return nullptr; }

void texts_stream_release(ArrowArrayStream* st) {
  delete (TextsStream*)st->private_data;
  st->private_data = nullptr;
  st->release = nullptr;
}

void texts_capsule_free(PyObject* cap) {
  auto* st = (ArrowArrayStream*)PyCapsule_GetPointer(cap, "arrow_array_stream");
  if (st == nullptr) {
    PyErr_Clear();
    return;
  }
  if (st->release) st->release(st);
  delete st;
}

// the column as an Arrow C stream capsule (the buffers live until polars releases them)
py::object texts_capsule(TextsOut&& t) {
  t.finish();
  auto* st = new ArrowArrayStream{};
  auto* ts = new TextsStream{};
  ts->t = std::move(t);
  st->get_schema = texts_get_schema;
  st->get_next = texts_get_next;
  st->get_last_error = texts_last_error;
  st->release = texts_stream_release;
  st->private_data = ts;
  PyObject* cap = PyCapsule_New(st, "arrow_array_stream", texts_capsule_free);
  if (cap == nullptr) {
    texts_stream_release(st);
    delete st;
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(cap);
}

}  // namespace

// hex_texts(values int64[n], nulls bool[n] or None, prefix, null_text or None): prefix +
// %016x of each value, null_text (or null) where it is null. A negative value raises ValueError
// (the numpy path's cast to unsigned refuses it too).
py::object hex_texts(carr<int64_t> values, py::object nulls_obj, std::string prefix, py::object null_text) {
  const int64_t n = values.size();
  carr<bool> nulls_a;
  const bool* nulls = optional_array(nulls_obj, n, nulls_a, "hex_texts: nulls");
  const bool has_null_text = !null_text.is_none();
  const std::string nt = has_null_text ? null_text.cast<std::string>() : std::string();
  const int64_t* v = values.data();
  TextsOut t;
  t.offsets.reserve((size_t)n + 1);
  t.data.reserve((size_t)n * (prefix.size() + 16));
  for (int64_t i = 0; i < n; ++i) {
    if (nulls && nulls[i]) {
      if (has_null_text) {
        t.put(nt.data(), nt.size());
        t.end_row();
      } else {
        t.null_row();
      }
      continue;
    }
    if (v[i] < 0) throw py::value_error("hex_texts: a negative value");
    t.put(prefix.data(), prefix.size());
    t.hex16((uint64_t)v[i]);
    t.end_row();
  }
  return texts_capsule(std::move(t));
}

// template_texts(alloc_id, addr, size, used, total: each (int64[n], nulls bool[n]); owner,
// module, phase: Arrow C stream capsules of string columns or None): the writer's MALLOC/FREE
// Attr template, null where one of the five numbers is (io/columns.py template_attr).
py::object template_texts(py::tuple nums, py::object owner, py::object module, py::object phase) {
  if (nums.size() != 5) throw py::value_error("template_texts: five number columns");
  std::vector<carr<int64_t>> vals;
  std::vector<carr<bool>> nuls;
  int64_t n = -1;
  for (int k = 0; k < 5; ++k) {
    py::tuple pair = nums[k].cast<py::tuple>();
    vals.push_back(carr<int64_t>::ensure(pair[0]));
    nuls.push_back(carr<bool>::ensure(pair[1]));
    if (!vals.back() || !nuls.back()) throw py::error_already_set();
    if (n < 0) n = vals.back().size();
    if (vals.back().size() != n || nuls.back().size() != n) throw py::value_error("template_texts: lengths differ");
  }
  TextsIn texts[3] = {TextsIn(owner), TextsIn(module), TextsIn(phase)};
  for (auto& tx : texts)
    if (!tx.chunks.empty() && tx.rows() != n) throw py::value_error("template_texts: lengths differ");
  static const char* keys[3] = {",\"owner\":\"", ",\"module\":\"", ",\"phase\":\""};
  const int64_t *aid = vals[0].data(), *addr = vals[1].data(), *size = vals[2].data(), *used = vals[3].data(),
                *total = vals[4].data();
  TextsOut t;
  t.offsets.reserve((size_t)n + 1);
  t.data.reserve((size_t)n * 110);
  for (int64_t i = 0; i < n; ++i) {
    bool whole = true;
    for (int k = 0; k < 5; ++k) whole = whole && !nuls[k].data()[i];
    const char* p[3];
    int64_t len[3];
    bool has[3];
    for (int k = 0; k < 3; ++k) has[k] = texts[k].get(i, p[k], len[k]);  // read in order, whole or not
    if (!whole) {
      t.null_row();
      continue;
    }
    if (addr[i] < 0) throw py::value_error("template_texts: a negative address");
    t.lit("{\"allocation_id\":");
    t.num(aid[i]);
    t.lit(",\"addr\":\"0x");
    t.hex16((uint64_t)addr[i]);
    t.lit("\",\"size\":");
    t.num(size[i]);
    t.lit(",\"used\":");
    t.num(used[i]);
    t.lit(",\"total\":");
    t.num(total[i]);
    for (int k = 0; k < 3; ++k) {
      if (!has[k]) continue;
      t.put(keys[k], std::strlen(keys[k]));
      t.put(p[k], (size_t)len[k]);
      t.lit("\"");
    }
    t.lit("}");
    t.end_row();
  }
  return texts_capsule(std::move(t));
}

// ---------------------------------------------------------------- inefficient memory's fold
// (issue 22) Tracker.feed's array work (analysis/inefficient.py) for one chunk, in loops instead
// of numpy passes: the same live-block columns in, the same columns out, for the old blocks
// followed by this chunk's new ones. The definitions are the module docstring's; the order of
// the work is the numpy code's (accesses over the whole chunk before the searches for the first
// free/malloc after a point, those before the frees), so a row out of the usual order (an access
// before its block's MALLOC in the chunk, an unbalanced END) gives what the numpy code gives.
namespace {

// allocation id -> block index: a table indexed by id where the ids are dense (they are numbered
// in order of allocation, so the rows then touch it in order), else open addressing (ids are any
// int64: the original's, a sparse mix). Its arrays are kept from one chunk to the next: memory
// fresh from the system costs a page fault per page, more than the passes over it.
struct IdIndex {
  bool dense = false;
  int64_t lo = 0;
  std::vector<int64_t> table;  // dense: block or -1 at id - lo
  std::vector<int64_t> keys;
  std::vector<int64_t> vals;  // hashed: -1 where empty
  size_t mask = 0;
  void reset(size_t n, int64_t lo_id, int64_t hi_id) {
    // a range of about 8 ids per block at most: the table is then no bigger than the hashed one
    dense = lo_id <= hi_id && (uint64_t)hi_id - (uint64_t)lo_id < 8 * (uint64_t)n + 4096;
    if (dense) {
      lo = lo_id;
      table.assign((size_t)((uint64_t)hi_id - (uint64_t)lo_id) + 1, -1);
      return;
    }
    size_t cap = 16;
    while (cap < 2 * n + 16) cap <<= 1;
    keys.assign(cap, 0);
    vals.assign(cap, -1);
    mask = cap - 1;
  }
  static size_t mix(int64_t k) {
    uint64_t x = (uint64_t)k * 0x9E3779B97F4A7C15ull;
    return (size_t)(x ^ (x >> 29));
  }
  // the index of k, or -1
  int64_t find(int64_t k) const {
    if (dense) {
      const uint64_t at = (uint64_t)k - (uint64_t)lo;
      return at < table.size() ? table[at] : -1;
    }
    for (size_t h = mix(k) & mask;; h = (h + 1) & mask) {
      if (vals[h] < 0) return -1;
      if (keys[h] == k) return vals[h];
    }
  }
  // insert k -> v unless k is there (k must lie in the dense range); returns whether it was inserted
  bool insert(int64_t k, int64_t v) {
    if (dense) {
      int64_t& slot = table[(uint64_t)k - (uint64_t)lo];
      if (slot >= 0) return false;
      slot = v;
      return true;
    }
    for (size_t h = mix(k) & mask;; h = (h + 1) & mask) {
      if (vals[h] < 0) {
        keys[h] = k;
        vals[h] = v;
        return true;
      }
      if (keys[h] == k) return false;
    }
  }
};

constexpr int64_t kInf = INT64_MAX;
constexpr int8_t kStart = 1, kEnd = 2, kMalloc = 3, kFree = 4, kAccess = 5;

// the first event after a point: after the op's end when the point's slot is inside an op
// (even), else after the row itself (the events' positions and slots both never decrease)
inline size_t first_after(const std::vector<int64_t>& ev_slot, const std::vector<int64_t>& ev_pos,
                          int64_t slot, int64_t pos) {
  if (slot % 2 == 0)
    return std::upper_bound(ev_slot.begin(), ev_slot.end(), slot) - ev_slot.begin();
  return std::upper_bound(ev_pos.begin(), ev_pos.end(), pos) - ev_pos.begin();
}

// the op and slot of each row, walked again by each pass (a running count: no array of them)
struct Walk {
  const int8_t* kind;
  int64_t k, depth, cs = 0, ce = 0, op = 0, slot = 0;
  void step(int64_t i) {
    const bool en = kind[i] == kEnd;
    cs += kind[i] == kStart;
    ce += en;
    op = k + cs;
    slot = 2 * op + ((depth + cs - ce + (en ? 1 : 0)) <= 0 ? 1 : 0);
  }
};

// the fold's working arrays, kept between calls (the GIL is held throughout a call)
struct FoldScratch {
  IdIndex index;
  std::vector<int64_t> m_slot, m_pos, f_slot, f_pos, mk, mk_slot, mk_op;
  std::vector<uint8_t> newly;
};
FoldScratch scratch;

}  // namespace

// kind/pos/aid/has_aid/before/size: the chunk's columns (aid 0 and before false where null);
// k, depth: the tracker's ops so far and open ops; blocks: its live-block columns (a dict of the
// _NUM names). Returns (blocks after this chunk, old then new: a dict of the same columns;
// new-block rows of the chunk; whether each new block's row is inside an op; freed; late).
py::tuple inefficient_fold(carr<int8_t> kind_a, carr<int64_t> pos_a, carr<int64_t> aid_a, carr<bool> has_a,
                           carr<bool> before_a, carr<int64_t> size_a, int64_t k, int64_t depth, py::dict blocks) {
  const int64_t n = kind_a.size();
  if (pos_a.size() != n || aid_a.size() != n || has_a.size() != n || before_a.size() != n || size_a.size() != n)
    throw py::value_error("inefficient_fold: columns of different lengths");
  const int8_t* kind = kind_a.data();
  const int64_t *pos = pos_a.data(), *aid = aid_a.data(), *size = size_a.data();
  const bool *has = has_a.data(), *before = before_a.data();

  static const char* names[] = {"alloc_id", "mpos", "sa", "aop", "before", "size", "qf_slot", "first_op",
                                "early", "last_slot", "last_pos", "qm_slot", "qm_pos", "prev_op", "max_gap"};
  enum { ALLOC_ID, MPOS, SA, AOP, BEFORE, SIZE, QF_SLOT, FIRST_OP, EARLY, LAST_SLOT, LAST_POS, QM_SLOT, QM_POS,
         PREV_OP, MAX_GAP, NCOLS };
  std::vector<carr<int64_t>> old;  // bools come as 0/1
  int64_t n_old = -1;
  for (int c = 0; c < NCOLS; ++c) {
    old.push_back(py::reinterpret_borrow<py::object>(blocks[names[c]]));
    if (n_old < 0) n_old = old.back().size();
    if (old.back().size() != n_old) throw py::value_error("inefficient_fold: block columns of different lengths");
  }
  const int64_t* old_id = old[ALLOC_ID].data();

  // the ids a block can have: the live blocks' and those of this chunk's MALLOCs
  int64_t lo_id = INT64_MAX, hi_id = INT64_MIN, n_ids = n_old, n_malloc = 0, n_free = 0;
  for (int64_t b = 0; b < n_old; ++b) {
    lo_id = std::min(lo_id, old_id[b]);
    hi_id = std::max(hi_id, old_id[b]);
  }
  for (int64_t i = 0; i < n; ++i) {
    if (kind[i] == kMalloc) {
      ++n_malloc;
      if (has[i]) {
        lo_id = std::min(lo_id, aid[i]);
        hi_id = std::max(hi_id, aid[i]);
        ++n_ids;
      }
    } else if (kind[i] == kFree) {
      ++n_free;
    }
  }
  FoldScratch& S = scratch;
  IdIndex& index = S.index;
  index.reset((size_t)n_ids, lo_id, hi_id);
  for (int64_t b = 0; b < n_old; ++b) index.insert(old_id[b], b);

  // new blocks (the row, its slot and op); the MALLOC and FREE events
  for (auto* v : {&S.m_slot, &S.m_pos, &S.f_slot, &S.f_pos, &S.mk, &S.mk_slot, &S.mk_op}) v->clear();
  S.m_slot.reserve(n_malloc);
  S.m_pos.reserve(n_malloc);
  S.f_slot.reserve(n_free);
  S.f_pos.reserve(n_free);
  {
    Walk w{kind, k, depth};
    for (int64_t i = 0; i < n; ++i) {
      w.step(i);
      const int8_t kd = kind[i];
      if (kd == kMalloc) {
        S.m_slot.push_back(w.slot);
        S.m_pos.push_back(pos[i]);
        if (has[i] && index.insert(aid[i], n_old + (int64_t)S.mk.size())) {
          S.mk.push_back(i);
          S.mk_slot.push_back(w.slot);
          S.mk_op.push_back(w.op);
        }
      } else if (kd == kFree) {
        S.f_slot.push_back(w.slot);
        S.f_pos.push_back(pos[i]);
      }
    }
  }
  const int64_t n_new = (int64_t)S.mk.size(), nb = n_old + n_new;

  // the blocks after this chunk: the old ones' columns, then the new ones'
  std::vector<py::array_t<int64_t>> cols;
  int64_t* col[NCOLS];
  for (int c = 0; c < NCOLS; ++c) {
    cols.emplace_back(nb);
    col[c] = cols.back().mutable_data();
    std::copy(old[c].data(), old[c].data() + n_old, col[c]);
  }
  for (int64_t j = 0; j < n_new; ++j) {
    const int64_t b = n_old + j, r = S.mk[j];
    col[ALLOC_ID][b] = aid[r];
    col[MPOS][b] = pos[r];
    col[SA][b] = S.mk_slot[j];
    col[AOP][b] = S.mk_op[j];
    col[BEFORE][b] = before[r] ? 1 : 0;
    col[SIZE][b] = size[r];
    col[QF_SLOT][b] = kInf;
    col[FIRST_OP][b] = -1;
    col[EARLY][b] = 0;
    col[LAST_SLOT][b] = S.mk_slot[j];
    col[LAST_POS][b] = pos[r];
    col[QM_SLOT][b] = kInf;
    col[QM_POS][b] = kInf;
    col[PREV_OP][b] = -1;
    col[MAX_GAP][b] = -1;
  }

  // the accesses, in dump order: the last access, and the counted ones (by another op than the
  // allocating one; every access of a block first seen as an input)
  S.newly.assign(nb, 0);
  uint8_t* newly = S.newly.data();
  Walk w{kind, k, depth};
  for (int64_t i = 0; i < n; ++i) {
    w.step(i);
    if (kind[i] != kAccess || !has[i]) continue;
    const int64_t b = index.find(aid[i]);
    if (b < 0) continue;
    col[LAST_SLOT][b] = w.slot;
    col[LAST_POS][b] = pos[i];
    col[QM_SLOT][b] = kInf;
    col[QM_POS][b] = kInf;
    if (!(col[BEFORE][b] || w.slot != col[SA][b])) continue;
    const int64_t cop = w.op, prev = col[PREV_OP][b];
    if (prev >= 0) col[MAX_GAP][b] = std::max(col[MAX_GAP][b], cop - prev - 1);
    if (col[FIRST_OP][b] < 0) {
      col[FIRST_OP][b] = cop;
      newly[b] = 1;
    }
    col[PREV_OP][b] = cop;
  }

  // the first free / malloc of another block after the allocation / the last access
  for (int64_t b = 0; b < nb; ++b) {
    if (col[QF_SLOT][b] == kInf && !S.f_pos.empty()) {
      const size_t j = first_after(S.f_slot, S.f_pos, col[SA][b], col[MPOS][b]);
      col[QF_SLOT][b] = j < S.f_slot.size() ? S.f_slot[j] : kInf;
    }
    if (col[QM_SLOT][b] == kInf && !S.m_pos.empty()) {
      const size_t j = first_after(S.m_slot, S.m_pos, col[LAST_SLOT][b], col[LAST_POS][b]);
      col[QM_SLOT][b] = j < S.m_slot.size() ? S.m_slot[j] : kInf;
      col[QM_POS][b] = j < S.m_pos.size() ? S.m_pos[j] : kInf;
    }
    // 2*first_op cannot overflow: ops are row counts
    if (newly[b] && col[QF_SLOT][b] < 2 * col[FIRST_OP][b]) col[EARLY][b] = 1;
  }

  // the blocks freed in this chunk (the first FREE of each id) are judged now
  py::array_t<bool> freed_a(nb), late_a(nb);
  bool *freed = freed_a.mutable_data(), *late = late_a.mutable_data();
  std::fill(freed, freed + nb, false);
  std::fill(late, late + nb, false);
  w = Walk{kind, k, depth};
  for (int64_t i = 0; i < n; ++i) {
    w.step(i);
    if (kind[i] != kFree || !has[i]) continue;
    const int64_t b = index.find(aid[i]);
    if (b < 0 || freed[b]) continue;
    freed[b] = true;
    late[b] = w.slot % 2 == 0 ? col[QM_SLOT][b] < w.slot : col[QM_POS][b] < pos[i];
  }

  py::dict out;
  for (int c = 0; c < NCOLS; ++c) out[names[c]] = cols[c];
  py::module_ np = py::module_::import("numpy");
  for (int c : {BEFORE, EARLY}) out[names[c]] = cols[c].attr("astype")(np.attr("bool_"));
  py::array_t<int64_t> mk_a(n_new);
  py::array_t<bool> inside_a(n_new);
  for (int64_t j = 0; j < n_new; ++j) {
    mk_a.mutable_data()[j] = S.mk[j];
    inside_a.mutable_data()[j] = S.mk_slot[j] % 2 == 0;
  }
  return py::make_tuple(out, mk_a, inside_a, freed_a, late_a);
}

// ---------------------------------------------------------------- the dump's CSV lines
// CsvWriter.write's lines (io/writers.py) of the rows a flush is made of: OP_LAUNCH; MALLOC with a
// 6-tuple Attr and a plain owner, or an 8-tuple (module, phase); FREE and ACCESS with a tuple
// Attr; the texts in them plain ASCII. In the writer process (issue 22): the Python loop cost
// ~1 us of that process's CPU a row, this ~0.2 us (BENCHMARKS.md, seventeenth session). Same text to the byte (tests/test_csv_rows.py). Stops at the first row it would not write
// exactly as the Python loop does (another kind, a value of another type, a name or stack whose
// CSV text is not in `esc` yet, an owner that is not plain ASCII) and returns its index: the
// Python loop writes that row (and caches its texts), then calls again.
namespace {

std::string& csv_buf = *new std::string();  // kept between calls: its capacity, not a new one each frame

inline bool csv_int(std::string& out, PyObject* o) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  char tmp[24];
  auto r = std::to_chars(tmp, tmp + sizeof(tmp), v);
  out.append(tmp, (size_t)(r.ptr - tmp));
  return true;
}

inline bool csv_hex16(std::string& out, PyObject* o) {  // f"{v:016x}" of a non-negative int
  if (!PyLong_CheckExact(o)) return false;
  unsigned long long v = PyLong_AsUnsignedLongLong(o);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  char tmp[16];  // 16 hex digits, zero-filled: a 64-bit value never needs more
  for (int k = 15; k >= 0; --k, v >>= 4) tmp[k] = "0123456789abcdef"[v & 0xf];
  out.append(tmp, 16);
  return true;
}

inline bool csv_str(std::string& out, PyObject* o) {  // f"{s}" of a str
  if (!PyUnicode_CheckExact(o)) return false;
  Py_ssize_t n = 0;
  const char* u = PyUnicode_AsUTF8AndSize(o, &n);
  if (u == nullptr) {  // a lone surrogate: the Python loop and the file's error handler
    PyErr_Clear();
    return false;
  }
  out.append(u, (size_t)n);
  return true;
}

// writers._plain(owner) for an ASCII str: printable, no quote, no backslash
inline bool plain_ascii(PyObject* o) {
  if (!PyUnicode_CheckExact(o) || !PyUnicode_IS_ASCII(o)) return false;
  const unsigned char* p = (const unsigned char*)PyUnicode_DATA(o);
  for (Py_ssize_t k = 0, n = PyUnicode_GET_LENGTH(o); k < n; ++k)
    if (p[k] < 0x20 || p[k] > 0x7e || p[k] == '"' || p[k] == '\\') return false;
  return true;
}

// a text json.dumps writes as "text" (plain ASCII: nothing to escape), or None (null)
inline bool json_plain(PyObject* o) { return o == Py_None || plain_ascii(o); }

inline bool json_str(std::string& out, PyObject* o) {  // json.dumps(o) inside a CSV-quoted field
  if (o == Py_None) {
    out.append("null");
    return true;
  }
  out.append("\"\"");
  bool ok = csv_str(out, o);
  out.append("\"\"");
  return ok;
}

inline PyObject* esc_text(PyObject* esc, PyObject* key) {  // borrowed, or nullptr: not cached
  PyObject* v = PyDict_GetItemWithError(esc, key);
  if (v == nullptr) PyErr_Clear();  // an unhashable key: the Python loop says what it is
  return v != nullptr && PyUnicode_CheckExact(v) ? v : nullptr;
}

}  // namespace

// (index of the first row not written, the CSV text of rows[at:index])
py::tuple csv_rows(py::list rows, Py_ssize_t at, long long first, py::object ids, long long pid, py::dict esc,
                   py::tuple consts) {
  PyObject* lst = rows.ptr();
  PyObject* ids_l = ids.is_none() ? nullptr : ids.ptr();
  if (ids_l != nullptr && !PyList_CheckExact(ids_l)) return py::make_tuple(at, py::str(""));
  PyObject* e = esc.ptr();
  PyObject* s_launch = consts[0].ptr();
  PyObject* s_malloc = consts[1].ptr();
  PyObject* s_free = consts[2].ptr();
  PyObject* s_access = consts[3].ptr();
  char pid_s[24];
  auto pr = std::to_chars(pid_s, pid_s + sizeof(pid_s), pid);
  const std::string pid_text(pid_s, (size_t)(pr.ptr - pid_s));
  std::string& out = csv_buf;
  out.clear();
  const Py_ssize_t n = PyList_GET_SIZE(lst);
  Py_ssize_t i = at;
  for (; i < n; ++i) {
    PyObject* r = PyList_GET_ITEM(lst, i);
    if (!PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r) != 10) break;
    PyObject* ev = PyTuple_GET_ITEM(r, 0);
    PyObject* attr = PyTuple_GET_ITEM(r, 7);
    // 0 OP_LAUNCH, 1 MALLOC (6-tuple, plain owner), 2 FREE, 3 ACCESS, 4 MALLOC with module and phase
    int kind;
    if (same_str(ev, s_launch)) {
      kind = 0;
    } else if (same_str(ev, s_malloc)) {
      if (!PyTuple_CheckExact(attr)) break;
      if (PyTuple_GET_SIZE(attr) == 6 && plain_ascii(PyTuple_GET_ITEM(attr, 5))) {
        kind = 1;
      } else if (PyTuple_GET_SIZE(attr) == 8 && json_plain(PyTuple_GET_ITEM(attr, 5)) &&
                 json_plain(PyTuple_GET_ITEM(attr, 6)) && json_plain(PyTuple_GET_ITEM(attr, 7))) {
        kind = 4;
      } else {
        break;
      }
    } else if (same_str(ev, s_free)) {
      if (!PyTuple_CheckExact(attr) || PyTuple_GET_SIZE(attr) < 5) break;
      kind = 2;
    } else if (same_str(ev, s_access)) {
      if (!PyTuple_CheckExact(attr) || PyTuple_GET_SIZE(attr) != 4 || !plain_ascii(PyTuple_GET_ITEM(attr, 0)))
        break;
      kind = 3;
    } else {
      break;
    }
    PyObject* nm = esc_text(e, PyTuple_GET_ITEM(r, 2));
    if (nm == nullptr) break;
    PyObject* ps = PyTuple_GET_ITEM(r, 8);
    PyObject* st = nullptr;  // the stack's CSV text; none for None or ""
    if (ps != Py_None && !(PyUnicode_CheckExact(ps) && PyUnicode_GET_LENGTH(ps) == 0)) {
      if (!PyUnicode_CheckExact(ps) || (st = esc_text(e, ps)) == nullptr) break;
    }
    const size_t mark = out.size();  // a row that fails half-way is taken back whole
    bool ok = true;
    if (ids_l != nullptr) {
      ok = i < PyList_GET_SIZE(ids_l) && csv_int(out, PyList_GET_ITEM(ids_l, i));
    } else {
      char tmp[24];
      auto res = std::to_chars(tmp, tmp + sizeof(tmp), first + (long long)i);
      out.append(tmp, (size_t)(res.ptr - tmp));
    }
    // each field: the text before it, then the value written by `write` (ok turns false on a
    // value it does not take)
    auto put = [&](const char* before, bool (*write)(std::string&, PyObject*), PyObject* v) {
      out.append(before);
      ok = ok && write(out, v);
    };
    static const char* const head[] = {",OP_LAUNCH,", ",MALLOC,", ",FREE,", ",ACCESS,", ",MALLOC,"};
    put(head[kind], csv_str, PyTuple_GET_ITEM(r, 1));
    put(",", csv_str, nm);
    put(",", csv_int, PyTuple_GET_ITEM(r, 3));
    out.push_back(',');
    out.append(pid_text);
    put(",", csv_int, PyTuple_GET_ITEM(r, 4));
    put(",", csv_str, PyTuple_GET_ITEM(r, 5));
    if (kind == 0) {
      out.append(",N/A,,");
    } else if (kind == 3) {
      // events._ACCESS_T through the general path's "%s" and CSV quoting
      PyObject* ptr = PyTuple_GET_ITEM(r, 6);
      if (ptr == Py_None) {
        out.append(",N/A");
      } else {
        put(",0x", csv_hex16, ptr);
      }
      put(",\"{\"\"dtype\"\":\"\"", csv_str, PyTuple_GET_ITEM(attr, 0));
      out.append("\"\",\"\"shape\"\":[");
      PyObject* shape = PyTuple_GET_ITEM(attr, 1);
      if (PyTuple_CheckExact(shape) || PyList_CheckExact(shape)) {
        for (Py_ssize_t k = 0, nd = PySequence_Fast_GET_SIZE(shape); k < nd; ++k)
          put(k ? "," : "", csv_int, PySequence_Fast_GET_ITEM(shape, k));
      } else {
        ok = false;
      }
      put("],\"\"size\"\":", csv_int, PyTuple_GET_ITEM(attr, 2));
      put(",\"\"allocation_id\"\":", csv_int, PyTuple_GET_ITEM(attr, 3));
      out.append("}\",");
    } else {
      put(",0x", csv_hex16, PyTuple_GET_ITEM(r, 6));
      put(",\"{\"\"allocation_id\"\":", csv_int, PyTuple_GET_ITEM(attr, 0));
      put(",\"\"addr\"\":\"\"0x", csv_hex16, PyTuple_GET_ITEM(attr, 1));
      put("\"\",\"\"size\"\":", csv_int, PyTuple_GET_ITEM(attr, 2));
      put(",\"\"used\"\":", csv_int, PyTuple_GET_ITEM(attr, 3));
      put(",\"\"total\"\":", csv_int, PyTuple_GET_ITEM(attr, 4));
      if (kind == 1) {
        put(",\"\"owner\"\":\"\"", csv_str, PyTuple_GET_ITEM(attr, 5));
        out.append("\"\"}\",");
      } else if (kind == 4) {  // format_attr: owner and module as JSON (null for None), phase left out when None
        put(",\"\"owner\"\":", json_str, PyTuple_GET_ITEM(attr, 5));
        put(",\"\"module\"\":", json_str, PyTuple_GET_ITEM(attr, 6));
        if (PyTuple_GET_ITEM(attr, 7) != Py_None) put(",\"\"phase\"\":", json_str, PyTuple_GET_ITEM(attr, 7));
        out.append("}\",");
      } else {
        out.append("}\",");
      }
    }
    if (st != nullptr) ok = ok && csv_str(out, st);
    out.append(",\n");
    if (!ok) {
      out.resize(mark);
      break;
    }
  }
  PyObject* text = PyUnicode_DecodeUTF8(out.data(), (Py_ssize_t)out.size(), "strict");
  if (text == nullptr) throw py::error_already_set();
  if (out.capacity() > (size_t)(64 << 20)) std::string().swap(out);  // one huge frame: not kept for the next
  return py::make_tuple(i, py::reinterpret_steal<py::str>(text));
}

// ---------------------------------------------------------------- the scan of a CSV dump's text
// (io/reader.py check_csv) in one pass with the GIL released: every newline counted (the rows
// exactly, at any size), the first line longer than ``limit`` bytes, and whether a NUL byte is
// anywhere. Python's streamed scan copied the file block by block and counted the newlines of its
// first 64 MB only; this costs about what reading the file from the page cache does. ``path``: the
// file, mapped, or with ``end`` >= 0 its first ``end`` bytes read in blocks (a file the capture
// appends to while it reads, which another process may cut back to its last whole row: a mapped
// page past a new end would kill the process), given as bytes (os.fsencode). Or None with
// ``text``, a buffer (a .csv.zst dump's decompressed text). Returns (bytes up to the end of the last complete line, bytes scanned,
// newlines, NUL seen, the 1-based number of the first line over the limit or 0), or None where
// the file cannot be opened (the Python scan then says why).
namespace {
struct Scan {
  int64_t complete = 0, lines = 0, long_line = 0, pos = 0, since = 0;  // since: bytes after the last newline
  bool nul = false;
  void feed(const char* p, size_t n, int64_t limit) {
    if (!nul && n) nul = std::memchr(p, 0, n) != nullptr;
    const char* q = p;
    const char* e = p + n;
    while (q < e) {
      const char* x = static_cast<const char*>(std::memchr(q, '\n', (size_t)(e - q)));
      since += (x ? x : e) - q;
      if (long_line == 0 && since > limit) long_line = lines + 1;
      if (!x) break;
      ++lines;
      since = 0;
      q = x + 1;
      complete = pos + (q - p);
    }
    pos += (int64_t)n;
  }
};
}  // namespace

py::object csv_scan(py::object path, py::object text, int64_t end, int64_t limit) {
  Scan s;
  if (path.is_none()) {
    py::buffer_info b = py::buffer(text).request();
    size_t n = (size_t)(b.size * b.itemsize);
    if (end >= 0 && (size_t)end < n) n = (size_t)end;
    py::gil_scoped_release unlocked;  // the caller holds the buffer
    s.feed(static_cast<const char*>(b.ptr), n, limit);
  } else {
    std::string name = path.cast<std::string>();  // os.fsencode's bytes: any name the OS allows
    int fd = ::open(name.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return py::none();
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return py::none();
    }
    bool ok = true;
    {
      py::gil_scoped_release unlocked;
      size_t n = (size_t)st.st_size;
      void* m = end < 0 && n > 0 ? ::mmap(nullptr, n, PROT_READ, MAP_PRIVATE, fd, 0) : MAP_FAILED;
      if (m != MAP_FAILED) {
        ::madvise(m, n, MADV_SEQUENTIAL);
        s.feed(static_cast<const char*>(m), n, limit);
        ::munmap(m, n);
      } else {
        std::vector<char> block(std::min<int64_t>(1 << 22, std::max<int64_t>(limit, 1 << 16)));
        while (end < 0 || s.pos < end) {
          size_t want = block.size();
          if (end >= 0) want = (size_t)std::min<int64_t>((int64_t)want, end - s.pos);
          ssize_t k = ::pread(fd, block.data(), want, s.pos);
          if (k < 0 && errno == EINTR) continue;
          if (k < 0) ok = false;
          if (k <= 0) break;
          s.feed(block.data(), (size_t)k, limit);
        }
      }
    }
    ::close(fd);
    if (!ok) return py::none();
  }
  return py::make_tuple(s.complete, s.pos, s.lines, s.nul, s.long_line);
}

#ifndef LEAKRULE_NAME
#define LEAKRULE_NAME msmemscope_leakrule
#endif

PYBIND11_MODULE(LEAKRULE_NAME, m) {
  m.def("leak_rows", &leak_rows);
  m.def("replay_rows", &replay_rows);
  m.def("leak_columns", &leak_columns);
  m.def("attr_fields", &attr_fields, py::arg("stream"), py::arg("kind"), py::arg("kinds") = py::none());
  m.def("inefficient_fold", &inefficient_fold);
  m.def("hex_texts", &hex_texts);
  m.def("template_texts", &template_texts);
  m.def("csv_rows", &csv_rows);
  m.def("csv_scan", &csv_scan, py::arg("path"), py::arg("text"), py::arg("end"), py::arg("limit"));
  py::class_<KeyTable>(m, "KeyTable")
      .def(py::init<int>(), py::arg("width"))
      .def("__len__", &KeyTable::size)
      .def("__bool__", [](const KeyTable& t) { return t.size() > 0; })
      .def("__contains__", &KeyTable::contains)
      .def("__getitem__", &KeyTable::getitem)
      .def("__setitem__", &KeyTable::setitem)
      .def("__iter__", [](KeyTable& t) { return py::iter(t.keys()); })
      .def("pop", &KeyTable::pop, py::arg("key"), py::arg("default") = py::none())
      .def("items", &KeyTable::items)
      .def("keys", &KeyTable::keys)
      .def("due", &KeyTable::due, py::arg("last"))
      .def("clear", &KeyTable::clear);
}
