"""How cheap could capture get with its per-op work in C++? A measurement probe, not part of msmemscope.

    pip install ninja && PYTHONPATH=. python bench/native_probe.py      # compiles ~25 s on 2 cores

Builds (torch.utils.cpp_extension.load_inline) a CPU allocator wrapper that records every
allocation and free, and a global RecordFunction callback that records every op's enter and
exit, each into a C++ vector drained from Python. Prints the per-op cost of each on the loop
of bench/per_op.py, then the transformer example in an in-process A/B (plain, this probe,
torch.profiler(profile_memory=True) with its stop; alternating every 2 steps, 12 rounds).
BENCHMARKS.md ("Where the time goes") records what it printed.
"""
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import torch  # noqa: E402
from torch.utils.cpp_extension import load_inline  # noqa: E402

from per_op import per_op as per_op_loop  # noqa: E402  (the loop of torch.add that per_op.py times)

SRC = r'''
#include <torch/extension.h>
#include <ATen/record_function.h>
#include <c10/core/CPUAllocator.h>
#include <chrono>
#include <mutex>
struct Rec { const char* name; int64_t ts; int kind; void* ptr; size_t size; };
static std::vector<Rec> recs;
static std::mutex mu;
static at::CallbackHandle handle = 0;
static inline int64_t now() { return std::chrono::steady_clock::now().time_since_epoch().count(); }
static std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  recs.push_back({fn.name(), now(), 0, nullptr, 0}); return nullptr; }
static void on_exit(const at::RecordFunction& fn, at::ObserverContext*) {
  recs.push_back({fn.name(), now(), 1, nullptr, 0}); }
struct Ctx { void* orig_ctx; c10::DeleterFnPtr orig_del; size_t size; };
static std::unordered_map<void*, Ctx> live;
static void tracing_delete(void* p) {
  Ctx c;
  { std::lock_guard<std::mutex> g(mu); auto it = live.find(p); c = it->second; live.erase(it);
    recs.push_back({nullptr, now(), 3, p, c.size}); }
  c.orig_del(c.orig_ctx); }
struct TracingAlloc : c10::Allocator {
  c10::Allocator* inner;
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr d = inner->allocate(n);
    if (!d.get_deleter()) return d;
    void* data = d.get();
    c10::Device dev = d.device();
    Ctx c{d.get_context(), d.get_deleter(), n};
    d.release_context();
    { std::lock_guard<std::mutex> g(mu); live[data] = c; recs.push_back({nullptr, now(), 2, data, n}); }
    return c10::DataPtr(data, data, &tracing_delete, dev);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &tracing_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};
static TracingAlloc talloc;
void start_ops() {
  handle = at::addGlobalCallback(at::RecordFunctionCallback(on_enter, on_exit).scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
}
void start_alloc() { talloc.inner = c10::GetCPUAllocator(); c10::SetCPUAllocator(&talloc, 100); }
void stop_all() { if (handle) at::removeCallback(handle); handle = 0; c10::SetCPUAllocator(talloc.inner, 101); }
int64_t drain() { std::lock_guard<std::mutex> g(mu); int64_t n = recs.size(); recs.clear(); return n; }
'''


def main():
    t0 = time.time()
    m = load_inline("msmemscope_native_probe", cpp_sources=SRC,
                    functions=["start_ops", "start_alloc", "stop_all", "drain"], extra_cflags=["-O2"])
    print(f"compiled in {time.time() - t0:.1f} s")
    torch.set_num_threads(1)
    base = per_op_loop()
    print(f"the op alone: {base:.2f} us")
    m.start_alloc()
    print(f"+ allocator wrapper: +{per_op_loop() - base:.2f} us ({m.drain()} records)")
    m.start_ops()
    print(f"+ RecordFunction enter/exit: +{per_op_loop() - base:.2f} us ({m.drain()} records)")
    m.stop_all()

    torch.manual_seed(0)
    from torch.profiler import ProfilerActivity, profile
    from workloads import build
    _, step = build("transformer")

    def run(v):
        p = None
        if v == "probe":
            m.start_alloc()
            m.start_ops()
        elif v == "profiler":
            p = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            p.__enter__()
        t0 = time.perf_counter()
        step()
        step()
        if p is not None:
            p.__exit__(None, None, None)
        if v == "probe":
            m.drain()
        dt = time.perf_counter() - t0
        if v == "probe":
            m.stop_all()
        return dt
    configs = ["plain", "probe", "profiler"]
    for v in configs:
        run(v)
    res = {v: [] for v in configs}
    for i in range(12):
        for v in (configs if i % 2 == 0 else configs[::-1]):
            res[v].append(run(v))
    b = statistics.median(res["plain"])
    print("transformer, ratio to plain: " + ", ".join(f"{v} {statistics.median(res[v]) / b:.3f}" for v in configs))


if __name__ == "__main__":
    main()
