// TextTrainer: a site's local training of a language model on its own text.
//
// The site's token stream is cut into non-overlapping windows of the task's
// seq_len + 1 tokens (inputs and the next-token targets); every epoch visits
// them in an order seeded by (task seed, round, client name), batch_size
// windows per step, with a fresh SGD or AdamW each round. The update is the
// weight delta, weighted in the average by the number of training tokens.
//
// With update kind lora the global buffer is a LoRA global layout
// (models/lora_federation.h): the trainer loads the base and the global
// adapter into a LoraLlama, trains only the adapter (under frozen-a only B;
// A is restored after every step) and uploads the adapter factors, named as
// PEFT saves them (under frozen-a the B factors alone).
// A site may train its own rank (set_lora_rank) where the federation takes
// mixed ranks (exact only): client/lora_round.h says what it uploads then.
// The adapted model is models::LoraLlama on the CPU or
// cuda::LoraLlamaEngine on a GPU (fp32 or bf16), trained by the same
// DataParallel step as a rank of a multi-rank site, over one rank.
// The model is a per-thread workspace on the site's device (lm_backend.h):
// the CPU, or a CUDA GPU in fp32, bf16 or fp16.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "client/compute.h"
#include "client/lora_round.h"
#include "client/trainer.h"

namespace estuary::client {

class TextTrainer : public Trainer {
 public:
  explicit TextTrainer(std::shared_ptr<const std::vector<int32_t>> tokens, Compute compute = {});

  uint64_t num_examples() const override { return tokens_->size(); }
  // This site's adapter rank in a lora federation (0: the federation's).
  void set_lora_rank(int rank) { lora_rank_ = rank; }
  // How a lora round keeps the frozen base: f32, or bf16 on the CPU (half
  // the memory; the model trains on the bf16-rounded base, models/lora.h).
  void set_lora_base(DType dtype) { lora_base_ = dtype; }
  Result<Update> Train(std::span<const float> global, const Manifest& manifest, const TaskConfig& task,
                       uint64_t round, std::string_view client_name) override;

 private:
  Result<Update> TrainLora(std::span<const float> global, const Manifest& manifest, const TaskConfig& task,
                           uint64_t round, std::string_view client_name);
  // Walks the round's BatchSchedule, calling step(inputs, targets, batch) per
  // batch; returns the mean loss over the last epoch's tokens.
  double RunSchedule(const TaskConfig& task, uint64_t round, std::string_view client_name, int seq,
                     const std::function<Result<float>(const int32_t*, const int32_t*, int)>& step,
                     Status* status) const;

  std::shared_ptr<const std::vector<int32_t>> tokens_;
  Compute compute_;
  int lora_rank_ = 0;
  DType lora_base_ = DType::kF32;
};

}  // namespace estuary::client
