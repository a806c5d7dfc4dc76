// _estuary: the compiled half of the Python SDK (python/estuary/). It runs
// estuary::RunSite (include/estuary/client.h) with a Trainer that calls a
// Python function (and, for the server's evaluation rounds, another), and reads and writes the safetensors files a federation
// of a custom model starts from (models/custom_model.h).
//
// Threads: run_site releases the GIL for the whole of RunSite (TLS, framing,
// streaming, reconnects and heartbeats run without it) and the trainer takes
// it back only while it calls into Python, on RunSite's training thread.
//
// Zero copy: the arrays `fit` receives are read-only NumPy views of the
// tensors RunSite hands to Train. Those tensors are RunSite's own temporary,
// which it discards when Train returns (client/run_site.cc); so that a view
// the Python code keeps past `fit` (or one derived from it, or a torch tensor
// over it) stays valid, the trainer takes each tensor's buffer over into the
// view's owner when `fit` returns: a move, which keeps the buffer where it is.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "estuary/client.h"
#include "models/custom_model.h"

namespace py = pybind11;

namespace {

// The NumPy view's base: empty while fit runs (the view borrows RunSite's
// buffer), then the owner of that buffer.
struct Borrowed {
  std::vector<float> owned;
};

py::dict TaskDict(const estuary::TaskInfo& task) {
  py::dict d;
  d["model"] = task.model;
  d["round"] = task.round;
  d["site"] = task.site;
  d["epochs"] = task.epochs;
  d["batch_size"] = task.batch_size;
  d["learning_rate"] = task.learning_rate;
  d["momentum"] = task.momentum;
  d["weight_decay"] = task.weight_decay;
  d["optimizer"] = task.optimizer;
  d["max_local_steps"] = task.max_local_steps;
  d["max_local_seconds"] = task.max_local_seconds;
  d["proximal_mu"] = task.proximal_mu;
  d["seed"] = task.seed;
  return d;
}

// The Trainer RunSite calls. `call` is the Python wrapper of the user's fit
// (estuary/_client.py): it returns (dict name -> float32 C-contiguous array,
// num_examples, dict name -> float) or raises with a one-line message.
class PythonTrainer : public estuary::Trainer {
 public:
  // `evaluate`: None, or the wrapper of the user's evaluate: it returns
  // (loss, num_examples, accuracy or None) or raises with a one-line message.
  PythonTrainer(py::object call, py::object evaluate, uint64_t examples)
      : call_(std::move(call)), evaluate_(std::move(evaluate)), evaluates_(!evaluate_.is_none()), examples_(examples) {}

  uint64_t num_examples() const override { return examples_; }

  estuary::TrainResult Train(const std::vector<estuary::Tensor>& global, const estuary::TaskInfo& task) override {
    const auto start = std::chrono::steady_clock::now();
    py::gil_scoped_acquire gil;
    // What leaves here is read by RunSite without the GIL: a plain exception.
    try {
      estuary::TrainResult result = TrainHoldingGil(global, task);
      train_s_.push_back(Seconds(start));
      return result;
    } catch (py::error_already_set& e) {
      throw std::runtime_error(py::str(e.value()).cast<std::string>());
    }
  }

  // The server's evaluation rounds: the global model as arrays of their own
  // (copies: evaluation is rare, and nothing here outlives the call).
  estuary::EvalResult Evaluate(const std::vector<estuary::Tensor>& global, const estuary::TaskInfo& task) override {
    if (!evaluates_) return {};
    py::gil_scoped_acquire gil;
    try {
      py::dict weights;
      for (const estuary::Tensor& t : global) {
        py::array_t<float> array(std::vector<py::ssize_t>(t.shape.begin(), t.shape.end()), t.data.data());
        py::detail::array_proxy(array.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
        weights[py::str(t.name)] = std::move(array);
      }
      auto parts = evaluate_(weights, TaskDict(task)).cast<py::tuple>();
      estuary::EvalResult result{.supported = true,
                                 .num_examples = parts[1].cast<uint64_t>(),
                                 .loss = parts[0].cast<double>()};
      if (!parts[2].is_none()) {
        result.has_accuracy = true;
        result.accuracy = parts[2].cast<double>();
      }
      return result;
    } catch (py::error_already_set& e) {
      throw std::runtime_error(py::str(e.value()).cast<std::string>());
    }
  }

  // Each round's Train call that returned an update, in seconds: taking the
  // GIL, the views, fit itself and copying its result.
  const std::vector<double>& train_s() const { return train_s_; }

  // Seconds spent on this side of `fit`: building the views and the task,
  // and copying the returned arrays into the update.
  double overhead_s() const { return overhead_s_; }

 private:
  estuary::TrainResult TrainHoldingGil(const std::vector<estuary::Tensor>& global, const estuary::TaskInfo& task) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<Borrowed*> views;
    py::dict weights;
    for (const estuary::Tensor& t : global) {
      auto* owner = new Borrowed;
      py::capsule base(owner, [](void* p) { delete static_cast<Borrowed*>(p); });
      py::array_t<float> array(std::vector<py::ssize_t>(t.shape.begin(), t.shape.end()), t.data.data(), base);
      py::detail::array_proxy(array.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
      weights[py::str(t.name)] = std::move(array);
      views.push_back(owner);
    }
    py::dict config = TaskDict(task);
    overhead_s_ += Seconds(start);

    py::object returned;
    std::optional<std::string> failure;
    try {
      returned = call_(weights, config);
    } catch (py::error_already_set& e) {
      failure = py::str(e.value()).cast<std::string>();
    }
    // RunSite's tensors are its temporary, discarded once Train returns: the
    // views take their buffers (a move; the data stay where they are).
    const auto after = std::chrono::steady_clock::now();
    for (size_t i = 0; i < global.size(); ++i) {
      views[i]->owned = std::move(const_cast<std::vector<float>&>(global[i].data));
    }
    if (failure) throw std::runtime_error(*failure);

    estuary::TrainResult result;
    auto parts = returned.cast<py::tuple>();
    for (const auto& [name, value] : parts[0].cast<py::dict>()) {
      auto array = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(value);
      if (!array) throw py::error_already_set();
      estuary::Tensor& t = result.tensors.emplace_back();
      t.name = name.cast<std::string>();
      t.shape.assign(array.shape(), array.shape() + array.ndim());
      t.data.assign(array.data(), array.data() + array.size());
    }
    result.num_examples = parts[1].cast<uint64_t>();
    result.metrics = parts[2].cast<std::map<std::string, double>>();
    // "local_steps": the optimizer steps fit took (a whole number >= 1, as _update_of checked).
    if (auto steps = result.metrics.find("local_steps"); steps != result.metrics.end()) {
      result.local_steps = uint64_t(steps->second);
    }
    overhead_s_ += Seconds(after);
    return result;
  }

  static double Seconds(std::chrono::steady_clock::time_point since) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
  }

  py::object call_, evaluate_;
  bool evaluates_;  // read without the GIL
  uint64_t examples_;
  double overhead_s_ = 0;
  std::vector<double> train_s_;
};

py::dict RunSite(const std::string& server, const std::string& cert, const std::string& key, const std::string& ca,
                 const std::string& crl, const std::string& expected_model, double max_backoff_s, uint64_t examples,
                 py::object call, py::object evaluate) {
  estuary::SiteOptions options;
  options.server = server;
  options.cert = cert;
  options.key = key;
  options.ca = ca;
  options.crl = crl;
  options.expected_model = expected_model;
  options.max_backoff_s = max_backoff_s;
  PythonTrainer trainer(std::move(call), std::move(evaluate), examples);
  estuary::SiteResult result;
  {
    py::gil_scoped_release release;
    result = estuary::RunSite(options, trainer);
  }
  py::dict out;
  out["ok"] = result.ok;
  out["error"] = result.error;
  out["rounds_trained"] = result.rounds_trained;
  out["overhead_seconds"] = trainer.overhead_s();
  out["train_seconds"] = trainer.train_s();
  return out;
}

std::string ModelName(const std::vector<std::tuple<std::string, std::vector<int64_t>, std::string>>& tensors) {
  std::vector<estuary::TensorLayout> layout;
  for (const auto& [name, shape, dtype] : tensors) layout.push_back({name, shape, dtype});
  return estuary::ModelName(layout);
}

// tensors: (name, dtype, shape, value) in file order; value is a float32
// array (exactly the tensor's values, widened) for F32/BF16/F16 tensors of at
// least one element, the tensor's raw bytes for every other.
void SaveModel(const std::string& path, const py::list& tensors) {
  estuary::models::CustomModel model;
  for (const py::handle item : tensors) {
    auto entry = item.cast<py::tuple>();
    estuary::models::CustomTensor t{.name = entry[0].cast<std::string>(),
                                    .shape = entry[2].cast<std::vector<int64_t>>(),
                                    .dtype = entry[1].cast<std::string>()};
    int64_t elements = 1;
    for (int64_t d : t.shape) elements *= d;
    if (estuary::models::IsFederatedDType(t.dtype) && elements > 0) {
      auto values = entry[3].cast<py::array_t<float, py::array::c_style | py::array::forcecast>>();
      model.manifest.Append(t.name, t.shape.empty() ? std::vector<int64_t>{1} : t.shape);
      model.values.insert(model.values.end(), values.data(), values.data() + values.size());
    } else {
      model.held[t.name] = entry[3].cast<std::string>();
    }
    model.layout.push_back(std::move(t));
  }
  model.name = estuary::models::CustomModelName(model.layout);
  if (auto saved = estuary::models::SaveCustomModel(path, model); !saved.ok()) {
    throw std::runtime_error(saved.message());
  }
}

// (name, [(name, dtype, shape, value)]) as SaveModel takes them.
py::tuple LoadModel(const std::string& path) {
  auto loaded = estuary::models::LoadCustomModel(path);
  if (!loaded.ok()) throw std::runtime_error(loaded.status().message());
  py::list tensors;
  size_t federated = 0;
  for (const auto& t : loaded->layout) {
    py::object value;
    if (const auto held = loaded->held.find(t.name); held != loaded->held.end()) {
      value = py::bytes(held->second);
    } else {
      const estuary::TensorSpec& spec = loaded->manifest.tensors.at(federated++);
      value = py::array_t<float>(py::ssize_t(spec.numel()), loaded->values.data() + spec.offset);
    }
    tensors.append(py::make_tuple(t.name, t.dtype, t.shape, value));
  }
  return py::make_tuple(loaded->name, tensors);
}

}  // namespace

PYBIND11_MODULE(_estuary, m) {
  m.doc() = "The compiled half of the estuary package; use estuary, not this module.";
  m.def("run_site", &RunSite, py::arg("server"), py::arg("cert"), py::arg("key"), py::arg("ca"), py::arg("crl"),
        py::arg("expected_model"), py::arg("max_backoff_s"), py::arg("num_examples"), py::arg("call"),
        py::arg("evaluate") = py::none());
  m.def("model_name", &ModelName, py::arg("tensors"));
  m.def("save_model", &SaveModel, py::arg("path"), py::arg("tensors"));
  m.def("load_model", &LoadModel, py::arg("path"));
}
