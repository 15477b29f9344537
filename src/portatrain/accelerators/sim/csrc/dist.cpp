// The sim device's process-group backend ("simccl"): gloo over CPU aliases of device memory.
//
// FSDP2, tensor parallelism and DCP issue collectives on device tensors through the backend
// registered for the device type, and a Python c10d Backend cannot implement the entry points
// they call (_allgather_base, _reduce_scatter_base, ...). This C++ backend aliases each device
// tensor as a CPU tensor over the same bytes, runs the collective on an inner ProcessGroupGloo
// (built in Python on its own store prefix) and waits for it: execution is synchronous, as
// everything else on the sim device. Point-to-point sends and receives are the exception: they
// return in flight and complete at wait(), as gloo's and NCCL's do, because a pipeline schedule
// posts its stages' sends and receives together (torch.distributed.batch_isend_irecv) and waits
// for all of them after; a send that waited for its receiver there would deadlock two stages that
// both send first. Gloo has no AVG, which FSDP2 uses for fp32 gradient reductions: it is emulated
// as SUM followed by a division, and PREMUL_SUM as a scaling of the inputs followed by SUM.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

namespace portatrain_sim {

at::Tensor cpu_alias(const at::Tensor& t);  // sim.cpp

namespace {

at::Tensor host_view(const at::Tensor& t) {
  return t.device().type() == c10::DeviceType::PrivateUse1 ? cpu_alias(t) : t;
}
std::vector<at::Tensor> host_view(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(host_view(t));
  return out;
}
std::vector<std::vector<at::Tensor>> host_view(const std::vector<std::vector<at::Tensor>>& tss) {
  std::vector<std::vector<at::Tensor>> out;
  out.reserve(tss.size());
  for (const auto& ts : tss) out.push_back(host_view(ts));
  return out;
}

// A finished collective. Results live in the caller's device tensors already.
class DoneWork final : public c10d::Work {
 public:
  explicit DoneWork(c10d::OpType type) : c10d::Work(-1, type) {
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
    future->markCompleted(c10::IValue(c10::List<at::Tensor>()));
    future_ = future;
    finish();
  }
  bool wait(std::chrono::milliseconds) override { return true; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A send or receive in flight on the inner gloo group, through CPU aliases of device tensors.
// The aliases do not own the bytes: this holds the device tensors until the transfer is waited for.
class InFlightWork final : public c10d::Work {
 public:
  InFlightWork(c10::intrusive_ptr<c10d::Work> inner, std::vector<at::Tensor> tensors, c10d::OpType type)
      : c10d::Work(-1, type), inner_(std::move(inner)), tensors_(std::move(tensors)) {}
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  bool wait(std::chrono::milliseconds timeout) override {
    const bool done = inner_->wait(timeout);
    tensors_.clear();
    return done;
  }
  void abort() override { inner_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::vector<at::Tensor> tensors_;
};

c10::intrusive_ptr<c10d::Work> finish(const c10::intrusive_ptr<c10d::Work>& work, c10d::OpType type) {
  if (work) work->wait();
  return c10::make_intrusive<DoneWork>(type);
}

// Gloo supports SUM, PRODUCT, MIN, MAX and bitwise ops. Returns the op to run and the factors to
// apply before (PREMUL_SUM) and after (AVG) it.
struct Plan {
  c10d::ReduceOp op;
  double pre = 1.0;
  double post = 1.0;
};
Plan plan(const c10d::ReduceOp& op, int size) {
  if (op.op_ == c10d::ReduceOp::AVG) return {c10d::ReduceOp(c10d::ReduceOp::SUM), 1.0, 1.0 / size};
  if (op.op_ == c10d::ReduceOp::PREMUL_SUM) {
    auto* sup = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
    TORCH_CHECK(sup != nullptr, "simccl: PREMUL_SUM without a factor");
    const double f = sup->tensor_factor.defined() ? sup->tensor_factor.item<double>() : sup->double_factor;
    return {c10d::ReduceOp(c10d::ReduceOp::SUM), f, 1.0};
  }
  return {op, 1.0, 1.0};
}
void scale(const std::vector<at::Tensor>& ts, double f) {
  if (f == 1.0) return;
  for (const auto& t : ts) t.mul_(f);
}

}  // namespace

class SimBackend final : public c10d::Backend {
 public:
  SimBackend(c10::intrusive_ptr<c10d::Backend> inner, int rank, int size)
      : c10d::Backend(rank, size), inner_(std::move(inner)) {}

  const std::string getBackendName() const override { return "simccl"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    auto a = host_view(tensors);
    return finish(inner_->broadcast(a, opts), c10d::OpType::BROADCAST);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    auto a = host_view(tensors);
    Plan p = plan(opts.reduceOp, getSize());
    scale(a, p.pre);
    c10d::AllreduceOptions o = opts;
    o.reduceOp = p.op;
    auto w = finish(inner_->allreduce(a, o), c10d::OpType::ALLREDUCE);
    scale(a, p.post);
    return w;
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    for (auto& t : tensors) {
      std::vector<at::Tensor> one{t};
      allreduce(one, opts);
    }
    return c10::make_intrusive<DoneWork>(c10d::OpType::ALLREDUCE_COALESCED);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    auto a = host_view(tensors);
    Plan p = plan(opts.reduceOp, getSize());
    scale(a, p.pre);
    c10d::ReduceOptions o = opts;
    o.reduceOp = p.op;
    auto w = finish(inner_->reduce(a, o), c10d::OpType::REDUCE);
    if (getRank() == opts.rootRank) scale(a, p.post);
    return w;
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    auto o = host_view(outputs);
    auto i = host_view(inputs);
    return finish(inner_->allgather(o, i, opts), c10d::OpType::ALLGATHER);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    auto o = host_view(output);
    auto i = host_view(input);
    return finish(inner_->_allgather_base(o, i, opts), c10d::OpType::_ALLGATHER_BASE);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    for (size_t k = 0; k < outputs.size(); ++k) _allgather_base(outputs[k], inputs[k], opts);
    return c10::make_intrusive<DoneWork>(c10d::OpType::COALESCED);
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    auto o = host_view(outputs);
    auto i = host_view(inputs);
    return finish(inner_->gather(o, i, opts), c10d::OpType::GATHER);
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    auto o = host_view(outputs);
    auto i = host_view(inputs);
    return finish(inner_->scatter(o, i, opts), c10d::OpType::SCATTER);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    auto o = host_view(outputs);
    auto i = host_view(inputs);
    Plan p = plan(opts.reduceOp, getSize());
    // Scale copies: the inputs belong to the caller.
    if (p.pre != 1.0) {
      for (auto& list : i)
        for (auto& t : list) t = t.mul(p.pre);
    }
    c10d::ReduceScatterOptions ro = opts;
    ro.reduceOp = p.op;
    auto w = finish(inner_->reduce_scatter(o, i, ro), c10d::OpType::REDUCE_SCATTER);
    scale(o, p.post);
    return w;
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    auto o = host_view(output);
    auto i = host_view(input);
    Plan p = plan(opts.reduceOp, getSize());
    if (p.pre != 1.0) i = i.mul(p.pre);
    c10d::ReduceScatterOptions ro = opts;
    ro.reduceOp = p.op;
    auto w = finish(inner_->_reduce_scatter_base(o, i, ro), c10d::OpType::_REDUCE_SCATTER_BASE);
    scale(std::vector<at::Tensor>{o}, p.post);
    return w;
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    for (size_t k = 0; k < outputs.size(); ++k) _reduce_scatter_base(outputs[k], inputs[k], opts);
    return c10::make_intrusive<DoneWork>(c10d::OpType::COALESCED);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override {
    auto o = host_view(output);
    auto i = host_view(input);
    return finish(inner_->alltoall_base(o, i, output_splits, input_splits, opts),
                  c10d::OpType::ALLTOALL_BASE);
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    auto o = host_view(outputs);
    auto i = host_view(inputs);
    return finish(inner_->alltoall(o, i, opts), c10d::OpType::ALLTOALL);
  }

  // Not waited for here (see the top of the file): the caller waits.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    auto a = host_view(tensors);
    return c10::make_intrusive<InFlightWork>(inner_->send(a, dst, tag), tensors, c10d::OpType::SEND);
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    auto a = host_view(tensors);
    return c10::make_intrusive<InFlightWork>(inner_->recv(a, src, tag), tensors, c10d::OpType::RECV);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return finish(inner_->barrier(opts), c10d::OpType::BARRIER);
  }

 private:
  c10::intrusive_ptr<c10d::Backend> inner_;
};

void bind_dist(pybind11::module& m) {
  pybind11::module::import("torch.distributed");
  pybind11::class_<SimBackend, c10d::Backend, c10::intrusive_ptr<SimBackend>>(m, "SimBackend")
      .def(pybind11::init<c10::intrusive_ptr<c10d::Backend>, int, int>(), pybind11::arg("inner"),
           pybind11::arg("rank"), pybind11::arg("size"));
}

}  // namespace portatrain_sim
