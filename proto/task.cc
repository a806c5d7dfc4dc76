#include "proto/task.h"

#include <cmath>

namespace estuary::proto {

Status CheckTask(const v1::TaskConfig& task) {
  if (task.model().empty()) return InvalidArgument("task: model is empty");
  if (task.epochs() == 0 || task.epochs() > 1000) {
    return InvalidArgument("task: epochs = {}: must be in [1, 1000]", task.epochs());
  }
  if (task.batch_size() == 0 || task.batch_size() > 65536) {
    return InvalidArgument("task: batch = {}: must be in [1, 65536]", task.batch_size());
  }
  if (!(task.learning_rate() > 0) || !std::isfinite(task.learning_rate())) {
    return InvalidArgument("task: lr = {}: must be a positive number", task.learning_rate());
  }
  if (!(task.momentum() >= 0 && task.momentum() < 1)) {
    return InvalidArgument("task: momentum = {}: must be in [0, 1)", task.momentum());
  }
  if (!(task.proximal_mu() >= 0) || !std::isfinite(task.proximal_mu())) {
    return InvalidArgument("task: proximal_mu = {}: must be a number >= 0", task.proximal_mu());
  }
  if (!(task.max_local_seconds() >= 0) || !std::isfinite(task.max_local_seconds())) {
    return InvalidArgument("task: max_local_seconds = {}: must be a number >= 0 (0: no cap)",
                           task.max_local_seconds());
  }
  if (!(task.weight_decay() >= 0) || !std::isfinite(task.weight_decay())) {
    return InvalidArgument("task: weight_decay = {}: must be a number >= 0", task.weight_decay());
  }
  if (task.seq_len() == 0 || task.seq_len() > 65536) {
    return InvalidArgument("task: seq_len = {}: must be in [1, 65536]", task.seq_len());
  }
  if (!task.optimizer().empty() && task.optimizer() != "sgd" && task.optimizer() != "adamw") {
    return InvalidArgument("task: optimizer = '{}': expected sgd or adamw", task.optimizer());
  }
  if (const std::string& t = task.prompt_template(); !t.empty()) {
    // models/prompt_template.h's names: proto/ sits below models/, so
    // tests/client/instruction_site_test checks that the two lists agree.
    if (t != "none" && t != "llama3" && t != "chatml" && t != "alpaca") {
      return InvalidArgument("task: template = '{}': expected one of llama3, chatml, alpaca, none", t);
    }
    if (!task.model().starts_with("llama") && !task.has_hf_base()) {
      return InvalidArgument("task: template = '{}' with model '{}': templates are for the language models", t,
                             task.model());
    }
  }
  if (!v1::UpdateKind_IsValid(task.update_kind())) {
    return InvalidArgument("task: update_kind = {}: expected full or lora", int(task.update_kind()));
  }
  if (task.has_hf_base()) {
    const std::string& sha = task.hf_base().sha256();
    if (sha.size() != 64 || sha.find_first_not_of("0123456789abcdef") != std::string::npos) {
      return InvalidArgument("task: hf_base.sha256 = '{}': expected 64 lowercase hex digits", sha);
    }
    if (task.hf_base().shape().empty()) return InvalidArgument("task: hf_base.shape is empty");
  }
  if (task.update_kind() == v1::UPDATE_LORA) {
    const v1::LoraTask& lora = task.lora();
    if (lora.rank() == 0 || lora.rank() > 4096) {
      return InvalidArgument("task: lora_rank = {}: must be in [1, 4096]", lora.rank());
    }
    if (lora.merge() != "naive" && lora.merge() != "exact" && lora.merge() != "frozen-a") {
      return InvalidArgument("task: lora_merge = '{}': expected naive, exact or frozen-a", lora.merge());
    }
    if (lora.mixed_ranks() && lora.merge() != "exact") {
      return InvalidArgument("task: lora_mixed_ranks with lora_merge = {}: only exact merges adapters of mixed ranks",
                             lora.merge());
    }
  }
  return Status::Ok();
}

}  // namespace estuary::proto
