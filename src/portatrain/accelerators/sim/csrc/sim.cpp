// portatrain's simulated accelerator: a PrivateUse1 device whose memory is host memory.
//
// What lives here, in the order a tensor meets it:
//   * SimAllocator: a c10::DeviceAllocator over aligned malloc with per-device statistics (so
//     the generic torch.accelerator memory API works) and an optional capacity that raises a
//     torch.OutOfMemoryError when exceeded (the Python subclass set by set_error_types).
//   * SimGuard: device and stream guard. Execution is synchronous, so streams are ids and events
//     are always complete; explicit synchronizes are still counted because on TPU/Trainium they
//     stall the host.
//   * SimHooks / SimGenerator: the PrivateUse1 hooks (device count, default generators, storage
//     resize, which FSDP2 uses to free and re-allocate unsharded parameters).
//   * Native kernels for allocation, views, copies and _local_scalar_dense.
//   * One boxed fallback that runs every other op on its CPU kernel without copying the inputs:
//     device tensors are aliased as CPU tensors over the same bytes, fresh outputs are copied into
//     device memory, and outputs that alias an input become views of the device tensor.
//   * Counters of what real accelerators punish (host syncs by kind, mixed-device ops, ops marked
//     unsupported). An op outside the active op-coverage profile, or marked unsupported, takes
//     at::native::cpu_fallback, the CPU fallback TorchTPU and torch-xla call: its device inputs
//     are copied to the host, it runs there and its results are copied back. The first occurrence of each key calls back into Python, which records the
//     Python stack and decides whether to warn or raise (see counters.py).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/copy_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

namespace portatrain_sim {

using c10::DeviceIndex;
constexpr c10::DeviceType kSim = c10::DeviceType::PrivateUse1;
constexpr int kMaxDevices = 64;

// ------------------------------------------------------------------------------------------
// Device count and current device
// ------------------------------------------------------------------------------------------
static DeviceIndex device_count_from_env() {
  const char* env = std::getenv("SIM_DEVICE_COUNT");
  long n = env ? std::strtol(env, nullptr, 10) : 4;
  if (n < 1) n = 1;
  if (n > kMaxDevices) n = kMaxDevices;
  return static_cast<DeviceIndex>(n);
}
static const DeviceIndex g_device_count = device_count_from_env();
static thread_local DeviceIndex t_current_device = 0;

static void check_index(DeviceIndex idx) {
  TORCH_CHECK(
      idx >= 0 && idx < g_device_count, "sim device index ", static_cast<int>(idx),
      " is out of range: ", static_cast<int>(g_device_count),
      " sim device(s) exist; set SIM_DEVICE_COUNT to have more");
}

// ------------------------------------------------------------------------------------------
// Counters
// ------------------------------------------------------------------------------------------
static std::mutex g_count_mutex;
static std::map<std::string, int64_t> g_counts;
static std::atomic<bool> g_notify_all{false};
static std::atomic<bool> g_counting{true};
static PyObject* g_callback = nullptr;  // deliberately leaked: must outlive static destructors
// Python exception types set by set_error_types (leaked likewise): an exception of g_user_error
// raised by the callback keeps its type, and an allocation over the capacity raises g_oom_error,
// so a user's mistake reaches the CLI as its one-line error rather than as a RuntimeError.
static PyObject* g_user_error = nullptr;
static PyObject* g_oom_error = nullptr;

// Counts one event under `key`. On the first occurrence since the last reset (or on every
// occurrence when Python asked for it: warn/raise modes) the Python callback gets the key; a
// non-empty string it returns is raised here, so the error unwinds through the dispatcher and
// the user sees a RuntimeError at the offending line. An exception of g_user_error the callback
// raises unwinds the same way with its own Python type (torch's bindings restore it).
// Set while at::native::cpu_fallback moves an op's tensors to the host and back: those copies are
// the fallback's own cost, counted once as fallback:<op>, not as host syncs of the user's code.
static thread_local bool t_in_cpu_fallback = false;

static void record_event(const std::string& key) {
  if (!g_counting.load() || t_in_cpu_fallback) return;
  bool first;
  {
    std::lock_guard<std::mutex> lock(g_count_mutex);
    first = (g_counts[key]++ == 0);
  }
  if (!(first || g_notify_all.load()) || g_callback == nullptr || !Py_IsInitialized()) return;
  std::string error;
  {
    pybind11::gil_scoped_acquire gil;
    PyObject* result =
        PyObject_CallFunction(g_callback, "sO", key.c_str(), first ? Py_True : Py_False);
    if (result == nullptr) {
      if (g_user_error != nullptr && PyErr_ExceptionMatches(g_user_error)) {
        throw pybind11::error_already_set();
      }
      PyErr_Print();  // a broken callback must not take the op down with an opaque error
    } else {
      if (PyUnicode_Check(result)) error = PyUnicode_AsUTF8(result);
      Py_DECREF(result);
    }
  }
  TORCH_CHECK(error.empty(), error);
}

// Ops marked unsupported on the device: the CPU fallback a TPU or Trainium would take.
static std::mutex g_unsupported_mutex;
static std::unordered_set<std::string> g_unsupported;
static std::atomic<bool> g_has_unsupported{false};
// The active op-coverage profile: the aten operator names (no overload) the impersonated backend
// runs natively. With a profile active every other aten op reaching the fallback falls back.
static std::unordered_set<std::string> g_native;
static std::atomic<bool> g_has_profile{false};
// The op census: every op reaching the fallback counted as op:<name> (the runtime audit's, so one
// run can be judged against every profile afterwards).
static std::atomic<bool> g_census{false};

// ------------------------------------------------------------------------------------------
// Allocator
// ------------------------------------------------------------------------------------------
struct Allocation {
  void* data;
  size_t size;
  DeviceIndex device;
};

// g_oom_error (a subclass of torch.OutOfMemoryError) when Python set one, else c10's own.
[[noreturn]] static void raise_out_of_memory(const std::string& message) {
  if (g_oom_error != nullptr && Py_IsInitialized()) {
    pybind11::gil_scoped_acquire gil;
    PyErr_SetString(g_oom_error, message.c_str());
    throw pybind11::error_already_set();
  }
  C10_THROW_ERROR(OutOfMemoryError, message);
}

class SimAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    const DeviceIndex device = t_current_device;
    std::string out_of_memory;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& stats = stats_[device];
      const int64_t allocated = stats.allocated_bytes[0].current;
      if (capacity_ > 0 && static_cast<int64_t>(nbytes) + allocated > capacity_) {
        stats.num_ooms += 1;
        out_of_memory = c10::str(
            "sim out of memory on device ", static_cast<int>(device), ". Tried to allocate ",
            mib(nbytes), "; ", mib(allocated), " already allocated of ", mib(capacity_),
            " capacity (SIM_MEMORY_CAPACITY). Reduce the micro-batch or sequence length, shard over "
            "more devices, or raise SIM_MEMORY_CAPACITY.");
      } else {
        for (auto* s : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes,
                        &stats.requested_bytes}) {
          (*s)[0].increase(nbytes);
        }
        for (auto* s : {&stats.allocation, &stats.segment, &stats.active}) (*s)[0].increase(1);
        stats.num_device_alloc += 1;
      }
    }
    if (!out_of_memory.empty()) raise_out_of_memory(out_of_memory);  // outside the lock: takes the GIL
    void* data = nullptr;
    if (nbytes > 0) {
      // 64-byte alignment: CPU kernels vectorize on it, as they do for CPU tensors.
      data = std::aligned_alloc(64, (nbytes + 63) / 64 * 64);
      TORCH_CHECK(data != nullptr, "sim: host allocation of ", nbytes, " bytes failed");
    }
    auto* ctx = new Allocation{data, nbytes, device};
    return {data, ctx, &SimAllocator::deleter, c10::Device(kSim, device)};
  }

  static void deleter(void* ctx);

  void release(Allocation* a) {
    std::free(a->data);
    std::lock_guard<std::mutex> lock(mutex_);
    auto& stats = stats_[a->device];
    for (auto* s : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes,
                    &stats.requested_bytes}) {
      (*s)[0].decrease(a->size);
    }
    for (auto* s : {&stats.allocation, &stats.segment, &stats.active}) (*s)[0].decrease(1);
    stats.num_device_free += 1;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {}  // nothing is cached: frees return at once
  void recordStream(const c10::DataPtr&, c10::Stream) override {}

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_[device];
  }
  void resetAccumulatedStats(DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    auto& s = stats_[device];
    for (auto* a : {&s.allocation, &s.segment, &s.active, &s.allocated_bytes, &s.reserved_bytes,
                    &s.active_bytes, &s.requested_bytes}) {
      for (auto& stat : *a) stat.reset_accumulated();
    }
    s.num_ooms = 0;
    s.num_device_alloc = 0;
    s.num_device_free = 0;
  }
  void resetPeakStats(DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    auto& s = stats_[device];
    for (auto* a : {&s.allocation, &s.segment, &s.active, &s.allocated_bytes, &s.reserved_bytes,
                    &s.active_bytes, &s.requested_bytes}) {
      for (auto& stat : *a) stat.reset_peak();
    }
  }
  std::pair<size_t, size_t> getMemoryInfo(DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t used = stats_[device].allocated_bytes[0].current;
    if (capacity_ > 0) {
      return {static_cast<size_t>(std::max<int64_t>(capacity_ - used, 0)),
              static_cast<size_t>(capacity_)};
    }
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGE_SIZE));
    return {static_cast<size_t>(sysconf(_SC_AVPHYS_PAGES)) * page,
            static_cast<size_t>(sysconf(_SC_PHYS_PAGES)) * page};
  }

  void set_capacity(int64_t bytes) { capacity_ = bytes; }
  int64_t capacity() const { return capacity_; }

 private:
  static std::string mib(int64_t n) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(n) / (1024.0 * 1024.0));
    return buf;
  }
  std::mutex mutex_;
  c10::CachingDeviceAllocator::DeviceStats stats_[kMaxDevices];
  int64_t capacity_ = 0;
};

static SimAllocator g_allocator;
void SimAllocator::deleter(void* ctx) {
  auto* a = static_cast<Allocation*>(ctx);
  g_allocator.release(a);
  delete a;
}
REGISTER_ALLOCATOR(kSim, &g_allocator)

// ------------------------------------------------------------------------------------------
// Device guard: synchronous device, streams are ids, events always complete
// ------------------------------------------------------------------------------------------
static thread_local std::map<DeviceIndex, c10::StreamId> t_current_stream;
static std::atomic<c10::StreamId> g_next_stream_id{1};

struct SimGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kSim; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    if (d.index() >= 0 && d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kSim, t_current_device); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kSim, "expected a sim device, got ", d);
    if (d.index() >= 0) {
      check_index(d.index());
      t_current_device = d.index();
    }
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) t_current_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    const DeviceIndex idx = d.index() >= 0 ? d.index() : t_current_device;
    auto it = t_current_stream.find(idx);
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kSim, idx),
                       it == t_current_stream.end() ? 0 : it->second);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    const DeviceIndex idx = d.index() >= 0 ? d.index() : t_current_device;
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(kSim, idx));
  }
  c10::Stream getNewStream(c10::Device d, int) const override {
    const DeviceIndex idx = d.index() >= 0 ? d.index() : t_current_device;
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kSim, idx), g_next_stream_id++);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return getNewStream(d, 0);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto old = getStream(s.device());
    t_current_stream[s.device_index()] = s.id();
    return old;
  }
  void record(void** event, const c10::Stream&, const DeviceIndex, const c10::EventFlag)
      const override {
    if (*event == nullptr) *event = new int(1);
  }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override {
    delete static_cast<int*>(event);
  }
  void block(void*, const c10::Stream&) const override {}  // device-side wait: free
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override { record_event("sync:synchronize"); }
  void synchronizeEvent(void*) const override { record_event("sync:synchronize"); }
  void synchronizeDevice(const DeviceIndex) const override { record_event("sync:synchronize"); }
  double elapsedTime(void*, void*, const DeviceIndex) const override { return 0.0; }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  DeviceIndex deviceCount() const noexcept override { return g_device_count; }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, SimGuardImpl);

// ------------------------------------------------------------------------------------------
// Generators and hooks
// ------------------------------------------------------------------------------------------
// The device generator is a CPU Philox-free mt19937 generator that reports the sim device: CPU
// kernels draw from a CPU generator loaded with its state (see with_device_generator), so a run
// seeded like a CPU run draws the same numbers.
struct SimGenerator final : public at::CPUGeneratorImpl {
  explicit SimGenerator(DeviceIndex idx) {
    device_ = c10::Device(kSim, idx);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }
};

static std::once_flag g_generators_once;
static std::vector<at::Generator> g_generators;

static const at::Generator& default_generator(DeviceIndex idx) {
  std::call_once(g_generators_once, [] {
    for (DeviceIndex i = 0; i < g_device_count; ++i) {
      g_generators.push_back(at::make_generator<SimGenerator>(i));
    }
  });
  if (idx < 0) idx = t_current_device;
  check_index(idx);
  return g_generators[idx];
}

struct SimHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  void init() const override {}
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return g_device_count; }
  void setCurrentDevice(DeviceIndex d) const override {
    check_index(d);
    t_current_device = d;
  }
  DeviceIndex getCurrentDevice() const override { return t_current_device; }
  DeviceIndex exchangeDevice(DeviceIndex d) const override {
    auto old = t_current_device;
    setCurrentDevice(d);
    return old;
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override { return exchangeDevice(d); }
  const at::Generator& getDefaultGenerator(DeviceIndex idx) const override {
    return default_generator(idx);
  }
  at::Generator getNewGenerator(DeviceIndex idx) const override {
    return at::make_generator<SimGenerator>(idx < 0 ? t_current_device : idx);
  }
  at::Device getDeviceFromPtr(void*) const override { return c10::Device(kSim, t_current_device); }
  bool isPinnedPtr(const void*) const override { return false; }
  at::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "sim: trying to resize a storage that is not resizable");
    const size_t old = impl->nbytes();
    const c10::DeviceGuard guard(storage.device());
    c10::DataPtr fresh = g_allocator.allocate(newsize);
    if (old > 0 && newsize > 0 && impl->data() != nullptr) {
      std::memcpy(fresh.get(), impl->data(), std::min(old, newsize));
    }
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};

static SimHooks* g_hooks = nullptr;
static void register_hooks() {
  if (g_hooks == nullptr) {
    g_hooks = new SimHooks();
    at::RegisterPrivateUse1HooksInterface(g_hooks);
  }
}

// ------------------------------------------------------------------------------------------
// Aliasing device memory as CPU tensors
// ------------------------------------------------------------------------------------------
// A CPU tensor over the same bytes. Its storage is resizable with the CPU allocator, so a CPU
// kernel that grows an out= argument gets fresh CPU memory; sync_back copies that into the
// device tensor afterwards.
at::Tensor cpu_alias(const at::Tensor& t) {
  const auto& st = t.storage();
  c10::Storage storage(c10::Storage::use_byte_size_t(), st.nbytes(),
                       c10::DataPtr(st.mutable_data(), c10::Device(c10::kCPU)),
                       c10::GetCPUAllocator(), /*resizable=*/true);
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return at::Tensor(std::move(impl));
}

// A device tensor over `storage` shaped like the CPU tensor `like` (a view of a device tensor).
static at::Tensor sim_view(const at::Tensor& base, const at::Tensor& like) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(base.storage()), base.key_set(), like.dtype());
  impl->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  return at::Tensor(std::move(impl));
}

// A fresh device tensor holding a copy of the CPU tensor `t`.
static at::Tensor to_sim(const at::Tensor& t, DeviceIndex device) {
  const c10::DeviceGuard guard(c10::Device(kSim, device));
  constexpr c10::DispatchKeySet ks(c10::DispatchKey::PrivateUse1);
  if (t.is_non_overlapping_and_dense()) {
    at::Tensor out = at::detail::empty_strided_generic(t.sizes(), t.strides(), &g_allocator, ks,
                                                       t.scalar_type());
    if (t.numel() > 0) std::memcpy(out.data_ptr(), t.data_ptr(), t.numel() * t.element_size());
    return out;
  }
  at::Tensor out = at::detail::empty_generic(t.sizes(), &g_allocator, ks, t.scalar_type(),
                                             std::nullopt);
  at::Tensor alias = cpu_alias(out);
  alias.copy_(t);
  return out;
}

// After a CPU kernel mutated `alias` (a CPU view of device tensor `orig`), carry any resize
// back: new memory if the kernel grew the storage, new sizes/strides if it restrided it.
static void sync_back(const at::Tensor& orig, const at::Tensor& alias, const void* orig_data) {
  if (alias.storage().data() != orig_data) {
    const size_t nbytes = alias.storage().nbytes();
    const c10::DeviceGuard guard(orig.device());
    c10::DataPtr fresh = g_allocator.allocate(nbytes);
    if (nbytes > 0) std::memcpy(fresh.get(), alias.storage().data(), nbytes);
    auto* st = orig.storage().unsafeGetStorageImpl();
    st->set_data_ptr_noswap(std::move(fresh));
    st->set_nbytes(nbytes);
  }
  if (!orig.sizes().equals(alias.sizes()) || !orig.strides().equals(alias.strides()) ||
      orig.storage_offset() != alias.storage_offset()) {
    orig.unsafeGetTensorImpl()->set_sizes_and_strides(alias.sizes(), alias.strides(),
                                                      alias.storage_offset());
  }
}

// ------------------------------------------------------------------------------------------
// Native kernels
// ------------------------------------------------------------------------------------------
static at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                                      std::optional<c10::Layout> layout,
                                      std::optional<c10::Device> device, std::optional<bool> pin,
                                      std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "sim supports strided tensors only");
  const c10::DeviceGuard guard(c10::device_or_default(device));
  constexpr c10::DispatchKeySet ks(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_generic(size, &g_allocator, ks, c10::dtype_or_default(dtype),
                                   memory_format);
}

static at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                                std::optional<c10::ScalarType> dtype,
                                std::optional<c10::Layout> layout,
                                std::optional<c10::Device> device, std::optional<bool> pin) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "sim supports strided tensors only");
  const c10::DeviceGuard guard(c10::device_or_default(device));
  constexpr c10::DispatchKeySet ks(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_strided_generic(size, stride, &g_allocator, ks,
                                           c10::dtype_or_default(dtype));
}

static at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size,
                             c10::SymIntArrayRef stride, std::optional<c10::SymInt> offset) {
  return at::native::as_strided_tensorimpl(
      self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride),
      offset ? std::optional<int64_t>(offset->expect_int()) : std::nullopt);
}

static at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

static at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size,
                                c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size),
                                    C10_AS_INTARRAYREF_SLOW(stride));
}

static const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                                 std::optional<at::MemoryFormat> memory_format) {
  // at::native::resize_ grows the storage through its allocator: ours.
  const c10::DeviceGuard guard(self.device());
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), memory_format);
}

static at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}
static at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) {
  return at::native::set_(self, source);
}
static at::Tensor& set_source_storage_offset(at::Tensor& self, at::Storage source, c10::SymInt offset,
                                             c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::set_storage_cpu_(self, source, offset.expect_int(),
                                      C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

static at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  // self is the source. Host-bound copies are the sync a real device pays for.
  const bool src_sim = self.device().type() == kSim;
  const bool dst_sim = dst.device().type() == kSim;
  if (src_sim && !dst_sim) record_event("sync:d2h");
  if (!src_sim && dst_sim) record_event("transfer:h2d");
  at::Tensor src_cpu = src_sim ? cpu_alias(self) : self;
  at::Tensor dst_cpu = dst_sim ? cpu_alias(dst) : dst;
  at::native::copy_(dst_cpu, src_cpu, non_blocking);
  return dst;
}

static at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  resize_(dst, c10::fromIntArrayRefSlow(self.sizes()), std::nullopt);
  return copy_from(self, dst, false);
}

static at::Scalar local_scalar_dense(const at::Tensor& self) {
  record_event("sync:item");
  return at::native::_local_scalar_dense_cpu(cpu_alias(self));
}

static void record_stream(at::Tensor&, c10::Stream) {}

// ------------------------------------------------------------------------------------------
// The boxed CPU fallback
// ------------------------------------------------------------------------------------------
// Ops whose output shape depends on tensor values: the host must wait for the device.
static const std::unordered_set<std::string> kDataDependent = {
    "aten::nonzero",           "aten::nonzero_numpy",      "aten::masked_select",
    "aten::_unique",           "aten::_unique2",           "aten::unique_dim",
    "aten::unique_consecutive", "aten::unique_dim_consecutive", "aten::repeat_interleave",
};
// Ops returning a Python scalar that only read metadata: no sync.
static const std::unordered_set<std::string> kMetadataScalar = {
    "aten::is_set_to", "aten::_nnz", "aten::dense_dim", "aten::sparse_dim", "aten::is_coalesced",
    "aten::is_pinned", "aten::_debug_has_internal_overlap", "aten::is_same_size",
};

static bool has_bool_index(const c10::IValue& v) {
  if (!v.isList()) return false;
  for (const c10::IValue& e : v.toListRef()) {
    if (e.isTensor()) {
      const auto st = e.toTensor().scalar_type();
      if (st == at::kBool || st == at::kByte) return true;
    }
  }
  return false;
}

static bool is_optional_tensor_list(const c10::TypePtr& type) {
  if (type->kind() != c10::TypeKind::ListType) return false;
  const auto& elem = type->castRaw<c10::ListType>()->getElementType();
  return elem->kind() == c10::TypeKind::OptionalType &&
         elem->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::TensorType;
}

static bool takes_generator(const c10::FunctionSchema& schema) {
  for (const auto& arg : schema.arguments()) {
    const auto& type = arg.type();
    if (type->kind() == c10::TypeKind::OptionalType &&
        type->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::GeneratorType) {
      return true;
    }
  }
  return false;
}

struct Aliased {
  at::Tensor orig;
  at::Tensor alias;
  const void* data;
  bool mutated;
};

static void sim_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& name = schema.operator_name();
  const size_t nargs = schema.arguments().size();
  const size_t begin = stack->size() - nargs;

  const std::string& base = name.name;
  std::string full;  // "aten::add.Tensor"; built lazily, most ops never need it
  auto full_name = [&]() -> const std::string& {
    if (full.empty()) full = name.overload_name.empty() ? base : base + "." + name.overload_name;
    return full;
  };

  if (g_census.load()) record_event("op:" + full_name());
  bool falls_back = false;
  if (g_has_unsupported.load() || g_has_profile.load()) {
    std::lock_guard<std::mutex> lock(g_unsupported_mutex);
    falls_back = g_unsupported.count(base) || g_unsupported.count(full_name()) ||
                 (g_has_profile.load() && base.rfind("aten::", 0) == 0 && !g_native.count(base));
  }
  if (falls_back) record_event("fallback:" + full_name());
  if (kDataDependent.count(base)) record_event("sync:data_dependent:" + full_name());
  if ((base == "aten::index" || base == "aten::index_put_" || base == "aten::index_put" ||
       base == "aten::_index_put_impl_") &&
      nargs >= 2 && has_bool_index((*stack)[begin + 1])) {
    record_event("sync:data_dependent:" + full_name() + "[bool mask]");
  }

  // The real CPU fallback, except for random ops: cpu_fallback would draw from the CPU generator,
  // while the aliasing path below keeps drawing from the device's.
  if (falls_back && !takes_generator(schema)) {
    t_in_cpu_fallback = true;
    try {
      at::native::cpu_fallback(op, stack, /*error_on_views=*/false, c10::DispatchKey::CPU);
    } catch (...) {
      t_in_cpu_fallback = false;
      throw;
    }
    t_in_cpu_fallback = false;
    // A scalar result read from device tensors is still a host sync of the user's code.
    for (size_t i = stack->size() - schema.returns().size(); i < stack->size(); ++i) {
      const c10::IValue& v = (*stack)[i];
      if ((v.isBool() || v.isInt() || v.isDouble()) && !kMetadataScalar.count(base)) {
        record_event("sync:scalar_result:" + full_name());
        break;
      }
    }
    return;
  }

  // Replace device tensors (and device arguments) by CPU aliases.
  std::vector<Aliased> aliased;
  DeviceIndex device = -1;
  bool cpu_nonscalar = false;
  bool cross_device = false;
  at::Generator device_generator;
  int generator_arg = -1;
  auto note_device = [&](const at::Tensor& t) {
    if (device < 0) device = t.device().index();
    else if (t.device().index() != device) cross_device = true;
  };
  auto alias_tensor = [&](const at::Tensor& t, bool is_write) -> at::Tensor {
    if (!t.defined()) return t;
    if (t.device().type() == kSim) {
      note_device(t);
      at::Tensor a = cpu_alias(t);
      aliased.push_back({t, a, t.storage().data(), is_write});
      return a;
    }
    if (t.device().is_cpu() && t.dim() > 0) cpu_nonscalar = true;
    return t;
  };

  for (size_t i = 0; i < nargs; ++i) {
    c10::IValue& v = (*stack)[begin + i];
    const auto& arg = schema.arguments()[i];
    const bool is_write = arg.alias_info() != nullptr && arg.alias_info()->isWrite();
    if (v.isTensor()) {
      v = alias_tensor(v.toTensor(), is_write);
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) list.set(j, alias_tensor(list.get(j), is_write));
      v = list;
    } else if (v.isList() && is_optional_tensor_list(arg.type())) {
      // Tensor?[] (index, index_put_)
      auto generic = v.toList();
      c10::List<std::optional<at::Tensor>> list;
      bool all_tensors = true;
      for (const c10::IValue& e : generic) {
        if (e.isNone()) list.push_back(std::nullopt);
        else if (e.isTensor()) list.push_back(alias_tensor(e.toTensor(), is_write));
        else { all_tensors = false; break; }
      }
      if (all_tensors) v = list;
    } else if (v.isDevice() && v.toDevice().type() == kSim) {
      if (device < 0) device = v.toDevice().has_index() ? v.toDevice().index() : t_current_device;
      v = c10::IValue(c10::Device(c10::kCPU));
    } else if (arg.type()->kind() == c10::TypeKind::OptionalType &&
               arg.type()->castRaw<c10::OptionalType>()->getElementType()->kind() ==
                   c10::TypeKind::GeneratorType) {
      generator_arg = static_cast<int>(i);
    }
  }
  if (device < 0) device = t_current_device;
  if (cross_device || (cpu_nonscalar && !aliased.empty())) {
    record_event("mixed_device:" + full_name());
  }

  // Random ops draw from the device generator: load its state into a CPU generator for the
  // CPU kernel and store the advanced state back.
  at::Generator cpu_generator;
  if (generator_arg >= 0) {
    c10::IValue& g = (*stack)[begin + generator_arg];
    if (g.isNone()) device_generator = default_generator(device);
    else if (g.toGenerator().device().type() == kSim) device_generator = g.toGenerator();
    if (device_generator.defined()) {
      cpu_generator = at::make_generator<at::CPUGeneratorImpl>();
      std::lock_guard<std::mutex> lock(device_generator.mutex());
      cpu_generator.set_state(device_generator.get_state());
      g = c10::IValue(cpu_generator);
    }
  }

  {
    const c10::DeviceGuard guard(c10::Device(kSim, device));
    op.callBoxed(stack);
  }

  if (device_generator.defined()) {
    std::lock_guard<std::mutex> lock(device_generator.mutex());
    device_generator.set_state(cpu_generator.get_state());
  }
  for (const auto& a : aliased) {
    if (a.mutated) sync_back(a.orig, a.alias, a.data);
  }

  // Map outputs back: in-place/out results are the device argument itself, views of an input
  // become device views, everything else is copied into device memory.
  const auto& returns = schema.returns();
  const size_t nret = returns.size();
  const size_t rbegin = stack->size() - nret;
  auto map_back = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || t.device().type() != c10::kCPU) return t;
    const void* data = t.storage().data();
    for (const auto& a : aliased) {
      if (a.alias.is_same(t)) return a.orig;
    }
    for (const auto& a : aliased) {
      if (data != nullptr && a.alias.storage().data() == data) return sim_view(a.orig, t);
    }
    return to_sim(t, device);
  };
  bool scalar_result = false;
  for (size_t i = 0; i < nret; ++i) {
    c10::IValue& v = (*stack)[rbegin + i];
    if (v.isTensor()) {
      v = map_back(v.toTensor());
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) list.set(j, map_back(list.get(j)));
      v = list;
    } else if (v.isBool() || v.isInt() || v.isDouble() || v.isComplexDouble()) {
      scalar_result = true;
    }
  }
  if (scalar_result && !aliased.empty() && !kMetadataScalar.count(base)) {
    record_event("sync:scalar_result:" + full_name());
  }
}

}  // namespace portatrain_sim

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace portatrain_sim;
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("resize_", resize_);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_source_storage_offset);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("record_stream", record_stream);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&portatrain_sim::sim_fallback>());
}

// Autocast on the device: CUDA's op lists (torch's own macros), so `torch.autocast("sim", bf16)`
// runs matmuls and convolutions in bf16 and keeps reductions, norms and losses in fp32.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

namespace at::autocast {
#define SIM_LOW_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define SIM_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define SIM_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define SIM_FP32_APPEND_DTYPE(...) KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE(__VA_ARGS__)
#define SIM_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  AT_FORALL_LOWER_PRECISION_FP(SIM_LOW_PRECISION_FP)
  AT_FORALL_FP32(SIM_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(SIM_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(SIM_FP32_APPEND_DTYPE)
  AT_FORALL_PROMOTE(SIM_PROMOTE)
}
}  // namespace at::autocast

// ------------------------------------------------------------------------------------------
// Python bindings (private: portatrain.accelerators.sim wraps them)
// ------------------------------------------------------------------------------------------
namespace portatrain_sim {
void bind_dist(pybind11::module& m);  // dist.cpp
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace portatrain_sim;
  bind_dist(m);
  m.def("register_hooks", &register_hooks);
  m.def("device_count", [] { return static_cast<int>(g_device_count); });
  m.def("current_device", [] { return static_cast<int>(t_current_device); });
  m.def("set_device", [](int idx) {
    check_index(static_cast<DeviceIndex>(idx));
    t_current_device = static_cast<DeviceIndex>(idx);
  });
  m.def("default_generator", [](int idx) { return default_generator(static_cast<DeviceIndex>(idx)); });
  m.def("set_capacity", [](int64_t bytes) { g_allocator.set_capacity(bytes); });
  m.def("capacity", [] { return g_allocator.capacity(); });
  m.def("set_callback", [](pybind11::object fn) {
    PyObject* old = g_callback;
    if (fn.is_none()) {
      g_callback = nullptr;
    } else {
      g_callback = fn.ptr();
      Py_INCREF(g_callback);
    }
    Py_XDECREF(old);
  });
  m.def("set_error_types", [](pybind11::object user_error, pybind11::object oom_error) {
    for (auto [slot, type] : {std::pair{&g_user_error, user_error}, std::pair{&g_oom_error, oom_error}}) {
      PyObject* old = *slot;
      *slot = type.is_none() ? nullptr : type.ptr();
      Py_XINCREF(*slot);
      Py_XDECREF(old);
    }
  });
  m.def("set_notify_all", [](bool v) { g_notify_all = v; });
  m.def("set_counting", [](bool v) { g_counting = v; });
  m.def("record_event", [](const std::string& key) { record_event(key); });
  m.def("counts", [] {
    std::lock_guard<std::mutex> lock(g_count_mutex);
    return g_counts;
  });
  m.def("reset_counts", [] {
    std::lock_guard<std::mutex> lock(g_count_mutex);
    g_counts.clear();
  });
  m.def("set_unsupported", [](const std::vector<std::string>& ops) {
    std::lock_guard<std::mutex> lock(g_unsupported_mutex);
    g_unsupported = std::unordered_set<std::string>(ops.begin(), ops.end());
    g_has_unsupported = !g_unsupported.empty();
  });
  // The op-coverage profile: aten operator names run natively; None (or no call) = no profile.
  // Composite ops the profiled backend implements as one kernel (aten::repeat): registered for the
  // device so they reach the fallback whole instead of as the ops their composite calls. Each call
  // replaces the previous set: destroying a Library removes its registrations.
  m.def("set_leaf_ops", [](const std::vector<std::string>& ops) {
    static std::unique_ptr<torch::Library> library;
    library.reset();
    if (ops.empty()) return;
    library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                               __FILE__, __LINE__);
    for (const auto& op : ops) {
      library->impl(op.c_str(), torch::CppFunction::makeFromBoxedFunction<&sim_fallback>());
    }
  });
  m.def("set_census", [](bool v) { g_census = v; });
  m.def("set_native", [](std::optional<std::vector<std::string>> ops) {
    std::lock_guard<std::mutex> lock(g_unsupported_mutex);
    g_native = ops ? std::unordered_set<std::string>(ops->begin(), ops->end()) : std::unordered_set<std::string>{};
    g_has_profile = ops.has_value();
  });
}
