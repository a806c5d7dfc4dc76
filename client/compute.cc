#include "client/compute.h"

#include <charconv>

#include <fmt/format.h>

#ifdef ESTUARY_HAVE_CUDA
#include "models/cuda/device.h"
#endif

namespace estuary::client {

std::string Compute::ToString() const {
  const char* precision_name = precision == DType::kF32 ? "fp32" : precision == DType::kBF16 ? "bf16" : "fp16";
  if (device == Device::kCpu) return fmt::format("cpu {}", precision_name);
  return fmt::format("cuda:{} {}", device_index, precision_name);
}

Result<Compute> ParseCompute(std::string_view device, std::string_view precision) {
  Compute compute;
  if (precision == "fp32") {
    compute.precision = DType::kF32;
  } else if (precision == "bf16") {
    compute.precision = DType::kBF16;
  } else if (precision == "fp16") {
    compute.precision = DType::kF16;
  } else {
    return InvalidArgument("--precision '{}': expected fp32, bf16 or fp16", precision);
  }
  if (device == "cpu") {
    if (compute.precision != DType::kF32) {
      return InvalidArgument("--precision {} needs --device cuda: the CPU backend trains in fp32", precision);
    }
    return compute;
  }
  if (device != "cuda" && !device.starts_with("cuda:")) {
    return InvalidArgument("--device '{}': expected cpu, cuda or cuda:N", device);
  }
  compute.device = Device::kCuda;
  if (device.size() > 5) {
    const std::string_view digits = device.substr(5);
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), compute.device_index);
    if (ec != std::errc() || end != digits.data() + digits.size() || compute.device_index < 0) {
      return InvalidArgument("--device '{}': the device index must be a number", device);
    }
  }
#ifdef ESTUARY_HAVE_CUDA
  if (Status usable = models::cuda::CudaUsable(); !usable.ok()) {
    return FailedPrecondition("--device {}: {}", device, usable.message());
  }
  ESTUARY_ASSIGN_OR_RETURN(const int count, models::cuda::CudaDeviceCount());
  if (compute.device_index >= count) {
    return InvalidArgument("--device {}: {} CUDA device(s) visible", device, count);
  }
  return compute;
#else
  return FailedPrecondition("--device {}: this build has no CUDA backend (nvcc was not found when it was configured)",
                            device);
#endif
}

}  // namespace estuary::client
