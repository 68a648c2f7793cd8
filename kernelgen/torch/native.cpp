// kernelgen.torch's native entry point: a converted convolution's forward and backward as one C++ autograd
// Function whose kernels are launched by replaying driver calls that Python packed (runtime/program.py).
//
// Why C++: a converted network's step is host-bound, and each Python layer between torch and the kernel (module
// and functional code, the autograd Function, the backward node, the launch) costs microseconds that torch's own
// convolution, one C++ call, does not pay (BENCHMARKS.md, issue 31).  Nothing here plans, compiles or packs: the
// first call of a slot with given addresses calls back into Python (kernelgen/torch/native.py), which runs
// kernelgen's op and hands back its launch program as plain words - (driver function address, up to 11 integer
// arguments) per step - kept here under (stream, the tensors' addresses).  A later call on the same addresses
// (torch's caching allocator hands a step's blocks back in the same order) replays those words.
//
// A step's driver function is called through one pointer type taking 11 64-bit integers: every driver call a
// program holds (cuLaunchKernel, cuMemsetD32Async, cuMemsetD16Async) takes only integer and pointer arguments,
// which the x86-64 and AArch64 C conventions pass in 64-bit registers and stack slots; a callee reads its own
// (narrower) arguments from them and ignores the rest.
#include <torch/extension.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using DriverFn = int (*)(uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                         uint64_t, uint64_t);
using IsCapturingFn = int (*)(uint64_t, int*);

constexpr int kSlots = 3;  // forward, backward-data, backward-weight
constexpr int kFwd = 0, kBwdData = 1, kBwdWeight = 2;
constexpr size_t kMaxPrograms = 64;  // per slot; past it the slot starts again (Python's copies go with them)

struct Step {
  DriverFn fn;
  std::array<uint64_t, 11> args;
};

struct Program {
  std::vector<Step> steps;
  const int64_t* uploads = nullptr;  // the map ring's upload count (programs with tensor maps), else null
  int64_t seen = 0;                  // its value when the maps' addresses were written into the words
};

using Key = std::array<uint64_t, 5>;  // stream, up to three inputs' addresses (0: absent), the output's

struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 1469598103934665603ull;
    for (uint64_t v : k) h = (h ^ v) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

struct Slot {
  std::unordered_map<Key, Program, KeyHash> programs;
  std::vector<int64_t> out_shape;  // the kernel's output, channels-last: (N, *spatial, C) or (K, *filter, C / groups)
};

struct Plan {
  std::mutex lock;
  Slot slots[kSlots];
  at::ScalarType dtype;  // what the kernels read and write
  py::object fallback;   // fallback(slot, key, inputs, out): Python runs the slot (and may keep its program)
  py::object refresh;    // refresh(slot, key) -> the ring's upload count after the program's maps were read again,
                         // or None (Python no longer holds that program)
};

// Plans live as long as the process (a module keeps the ids of its own); never destroyed, so that no Python object
// is released at exit without the interpreter.
std::mutex g_plans_lock;
std::vector<Plan*>* g_plans = new std::vector<Plan*>();
IsCapturingFn g_is_capturing = nullptr;

Plan& plan_at(int64_t id) {
  std::lock_guard<std::mutex> guard(g_plans_lock);
  if (id < 0 || static_cast<size_t>(id) >= g_plans->size()) throw std::out_of_range("kernelgen native: no such plan");
  return *(*g_plans)[id];
}

uint64_t address(const at::Tensor& t) { return t.defined() ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0; }

enum class Replayed { yes, stale, none };  // run; kept, but the ring uploaded since its maps were read; not kept

// The kept program of `key`, run, where one is kept and its maps are where it read them (seen >= 0: they were
// read again just now, when the ring's count was `seen`).  Under the plan's lock: a keep() of another thread may
// rehash the table.
Replayed replay(Plan& plan, int slot, const Key& key, int64_t seen) {
  std::lock_guard<std::mutex> guard(plan.lock);
  auto found = plan.slots[slot].programs.find(key);
  if (found == plan.slots[slot].programs.end()) return Replayed::none;
  Program& program = found->second;
  if (seen >= 0) program.seen = seen;
  if (program.uploads != nullptr && *program.uploads != program.seen) return Replayed::stale;
  for (const Step& s : program.steps) {
    const auto& a = s.args;
    int err = s.fn(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10]);
    if (err != 0) throw std::runtime_error("kernelgen native: a driver call failed with CUDA error " +
                                           std::to_string(err));
  }
  return Replayed::yes;
}

// The slot's kernels on these tensors (torch layout, memory channels-last) into `out` (channels-last), on `stream`:
// the kept program for these addresses where one is kept (its maps read again where the ring uploaded since), else
// Python's.
void run_slot(Plan& plan, int slot, const std::vector<at::Tensor>& inputs, const at::Tensor& out, uint64_t stream) {
  Key key{stream, 0, 0, 0, address(out)};
  for (size_t i = 0; i < inputs.size() && i < 3; ++i) key[i + 1] = address(inputs[i]);
  int capturing = 0;
  if (stream != 0 && g_is_capturing != nullptr && g_is_capturing(stream, &capturing) != 0) capturing = 1;
  if (!capturing) {  // (a graph capture gets its own buffers and maps: Python's route)
    Replayed replayed = replay(plan, slot, key, -1);
    if (replayed == Replayed::yes) return;
    if (replayed == Replayed::stale) {  // read the maps again (Python, no op), then replay
      py::gil_scoped_acquire gil;  // (taken with no lock held: Python may call keep(), which takes the plan's lock)
      py::object seen = plan.refresh(slot, py::make_tuple(key[0], key[1], key[2], key[3], key[4]));
      if (!seen.is_none() && replay(plan, slot, key, seen.cast<int64_t>()) == Replayed::yes) return;
    }
  }
  py::gil_scoped_acquire gil;
  py::list py_inputs;
  for (const auto& t : inputs) py_inputs.append(t.defined() ? py::cast(t) : py::none());
  plan.fallback(slot, py::make_tuple(key[0], key[1], key[2], key[3], key[4]), py_inputs, out);
}

std::vector<int64_t> channels_first_dims(int64_t dim) {  // sum over every dim but the channel one (bias gradient)
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < dim; ++d) dims.push_back(d);
  return dims;
}

at::Tensor as(const at::Tensor& t, at::ScalarType dtype) {
  return (!t.defined() || t.scalar_type() == dtype) ? t : t.to(dtype);
}

// t (N, C, *spatial) with its memory channels-last, as it is where it is already, else copied so
at::Tensor channels_last(const at::Tensor& t) {
  at::Tensor v = t.movedim(1, -1);
  return v.is_contiguous() ? t : v.contiguous().movedim(-1, 1);
}

struct NativeConv : public torch::autograd::Function<NativeConv> {
  // (bias: an optional, not an undefined tensor - the Function's input metadata reads every tensor's device)
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x, at::Tensor w,
                            std::optional<at::Tensor> bias, int64_t plan_id, int64_t stream) {
    Plan& plan = plan_at(plan_id);
    at::Tensor xc = channels_last(as(x, plan.dtype)), wc = channels_last(as(w, plan.dtype));
    at::Tensor bc = bias.has_value() ? as(*bias, plan.dtype).contiguous() : at::Tensor();
    at::Tensor out = at::empty(plan.slots[kFwd].out_shape, xc.options());
    run_slot(plan, kFwd, {xc, wc, bc}, out, static_cast<uint64_t>(stream));
    ctx->save_for_backward({xc, wc});
    ctx->saved_data["plan"] = plan_id;
    ctx->saved_data["stream"] = stream;  // (the backward runs on the forward's stream, as torch's does)
    ctx->saved_data["bias"] = bias.has_value();
    return out.movedim(-1, 1);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    Plan& plan = plan_at(ctx->saved_data["plan"].toInt());
    auto stream = static_cast<uint64_t>(ctx->saved_data["stream"].toInt());
    auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    at::Tensor dy = channels_last(as(grads[0], plan.dtype));
    at::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) {
      at::Tensor out = at::empty(plan.slots[kBwdData].out_shape, dy.options());
      run_slot(plan, kBwdData, {dy, w}, out, stream);
      dx = out.movedim(-1, 1);
    }
    if (ctx->needs_input_grad(1)) {
      at::Tensor out = at::empty(plan.slots[kBwdWeight].out_shape, dy.options());
      run_slot(plan, kBwdWeight, {x, dy}, out, stream);
      dw = out.movedim(-1, 1);
    }
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) db = dy.sum(channels_first_dims(dy.dim()));
    return {dx, dw, db, at::Tensor(), at::Tensor()};
  }
};

// --- what Python calls -------------------------------------------------------------------------------------------

int64_t new_plan(const std::string& dtype, std::vector<std::vector<int64_t>> out_shapes, py::object fallback,
                 py::object refresh) {
  auto plan = std::make_unique<Plan>();  // (released into g_plans below)
  plan->dtype = dtype == "bfloat16" ? at::kBFloat16 : dtype == "float16" ? at::kHalf
              : dtype == "float32" ? at::kFloat : dtype == "float64" ? at::kDouble
              : throw std::invalid_argument("kernelgen native: dtype " + dtype);
  if (out_shapes.size() != kSlots) throw std::invalid_argument("kernelgen native: one output shape a slot");
  for (int s = 0; s < kSlots; ++s) plan->slots[s].out_shape = out_shapes[s];
  plan->fallback = std::move(fallback);
  plan->refresh = std::move(refresh);
  std::lock_guard<std::mutex> guard(g_plans_lock);
  g_plans->push_back(plan.release());
  return static_cast<int64_t>(g_plans->size()) - 1;
}

// keep a program for (stream, addresses): steps as (function address, [arguments]); uploads_at: the address of the
// ring's upload count (0: no maps) and `seen`, its value when the maps were read.  False where the slot was full and
// started again (the caller drops its own copies).
bool keep(int64_t plan_id, int slot, std::vector<uint64_t> key_words, std::vector<std::pair<uint64_t,
          std::vector<uint64_t>>> steps, uint64_t uploads_at, int64_t seen) {
  Plan& plan = plan_at(plan_id);
  if (slot < 0 || slot >= kSlots || key_words.size() != 5) throw std::invalid_argument("kernelgen native: keep");
  Program program;
  for (auto& [fn, args] : steps) {
    if (args.size() > 11) throw std::invalid_argument("kernelgen native: a step of more than 11 arguments");
    Step s{reinterpret_cast<DriverFn>(fn), {}};
    for (size_t i = 0; i < args.size(); ++i) s.args[i] = args[i];
    program.steps.push_back(s);
  }
  program.uploads = reinterpret_cast<const int64_t*>(uploads_at);
  program.seen = seen;
  Key key;
  for (int i = 0; i < 5; ++i) key[i] = key_words[i];
  std::lock_guard<std::mutex> guard(plan.lock);
  auto& programs = plan.slots[slot].programs;
  bool kept_all = programs.size() < kMaxPrograms;
  if (!kept_all) programs.clear();
  programs[key] = std::move(program);
  return kept_all;
}

size_t programs(int64_t plan_id, int slot) {
  Plan& plan = plan_at(plan_id);
  std::lock_guard<std::mutex> guard(plan.lock);
  return plan.slots[slot].programs.size();
}

at::Tensor conv(const at::Tensor& x, const at::Tensor& w, std::optional<at::Tensor> bias, int64_t plan_id,
                int64_t stream) {
  return NativeConv::apply(x, w, bias, plan_id, stream);
}

void run(int64_t plan_id, int slot, std::vector<std::optional<at::Tensor>> inputs, const at::Tensor& out,
         int64_t stream) {  // one slot, outside autograd (tests)
  std::vector<at::Tensor> tensors;
  for (auto& t : inputs) tensors.push_back(t.has_value() ? *t : at::Tensor());
  run_slot(plan_at(plan_id), slot, tensors, out, static_cast<uint64_t>(stream));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("conv", &conv, "a convolution through its plan (autograd: the plan's backward slots)");
  m.def("new_plan", &new_plan);
  m.def("keep", &keep);
  m.def("programs", &programs);
  m.def("run", &run);
  m.def("set_is_capturing", [](uint64_t fn) { g_is_capturing = reinterpret_cast<IsCapturingFn>(fn); });
}
