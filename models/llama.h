// Llama: a LLaMA-style decoder-only transformer on the CPU (the reference the
// CUDA engine is checked against, and a CPU site's training engine).
//
// Pre-norm blocks: h = x + Attn(RMSNorm(x)), x' = h + MLP(RMSNorm(h)), with
// rotary embeddings (Hugging Face's rotate_half convention), grouped-query
// causal attention and a SwiGLU MLP; a final RMSNorm and an LM head, which is
// the embedding table itself when tie_embeddings is set.
//
// Parameters live in one flat fp32 buffer and gradients in another of the
// same layout; manifest() names the tensors exactly as Hugging Face's
// LlamaForCausalLM state_dict does ("model.layers.0.self_attn.q_proj.weight",
// torch Linear layout [out, in]), so checkpoints map one to one.
// lm_head.weight is absent when tied.
//
// Activations live in an arena sized at Create() for (max_batch,
// max_seq_len): a training step never allocates. The arena is mapped pages
// that cost nothing until touched, and a step lays out its (batch, seq) from
// the arena's start, so memory follows the largest step run, not the
// context: llama-124m's arena is 1.4 GiB for 1 x 1024 tokens, 54 MiB
// resident after steps of 1 x 64. With recompute (activation checkpointing,
// chosen at Create) a block keeps only its input: the arena holds the
// num_layers + 1 residual streams and one block's activations, which every
// block's forward overwrites, and backward re-runs block l's forward from its
// kept input (up to the SwiGLU; the down projection's output is not needed)
// just before block l's backward. The last block's are still in place and are
// not re-run. The recomputation runs the same ops on the same inputs, so the
// loss and every gradient are bit for bit the plain path's (same threads);
// it costs about one more forward per step. A step is
//   auto loss = model.ForwardBackward(tokens, targets, batch, seq);  // fills gradients()
//   optimizer.Step(model.parameters(), model.gradients());
// Unlike Hugging Face's `labels`, targets are not shifted inside: targets[i]
// is the token expected after tokens[i]. A Llama is used by one thread at a
// time (the arena is per model); replicas give parallelism.
//
// For DDP and ZeRO (models/step_hooks.h), units() are the embedding (unit 0),
// each block (unit 1 + l), and the final norm with the LM head when untied
// (the last unit); ForwardBackward takes BackwardOptions. When tied, forward
// opens unit 0 twice (lookup, then LM head) and backward once (LM head: the
// lookup's backward reads no weight). Both flat buffers are page-aligned mmap
// memory (models/flat_buffer.h).
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "models/flat_buffer.h"
#include "models/layers.h"
#include "models/step_hooks.h"
#include "models/tensor.h"

namespace estuary::models {

// How RoPE's inverse frequencies are rescaled for a longer context
// (config.json's rope_scaling): kLinear divides every frequency by factor
// (positions divided by factor); kLlama3 divides the low frequencies (those
// whose wavelength exceeds original_max_position_embeddings / low_freq_factor)
// by factor, keeps the high ones (wavelength below original / high_freq_factor)
// and interpolates smoothly between, as transformers' llama3 rope type does.
struct RopeScaling {
  enum class Kind { kNone, kLinear, kLlama3 };
  Kind kind = Kind::kNone;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int original_max_position_embeddings = 8192;
};

struct LlamaConfig {
  int vocab_size = 0;
  int hidden_size = 0;        // D
  int intermediate_size = 0;  // the MLP's hidden width
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;       // divides num_heads; equal to it for plain multi-head attention
  int max_seq_len = 0;        // the context length (max_position_embeddings)
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  bool tie_embeddings = false;
  // config.json's head_dim where it is given (then q_proj is [heads * head_dim,
  // hidden], which need not be hidden); 0: hidden_size / num_heads.
  int explicit_head_dim = 0;
  RopeScaling rope_scaling;
  bool qkv_bias = false;  // q_proj, k_proj and v_proj have biases (attention_bias; Qwen2 always)
  bool o_bias = false;    // o_proj has one (attention_bias; never in Qwen2)
  bool mlp_bias = false;  // gate_proj, up_proj and down_proj have biases
  // config.json's max_position_embeddings, written back as read, where the
  // model runs at a shorter context (max_seq_len); 0: max_seq_len.
  int max_position_embeddings = 0;
  // config.json's sliding_window (Mistral, Qwen2), written back as read; it
  // is at least max_seq_len, so attention is plainly causal. 0: none.
  int sliding_window = 0;
  // What config.json names the model ("LlamaForCausalLM", "MistralForCausalLM"
  // or "Qwen2ForCausalLM"): the same computation, written back as read.
  std::string architecture = "LlamaForCausalLM";

  int head_dim() const {
    return explicit_head_dim > 0 ? explicit_head_dim : num_heads > 0 ? hidden_size / num_heads : 0;
  }
  // RoPE's head_dim / 2 inverse frequencies, theta^(-2j/head_dim) rescaled
  // as rope_scaling says; in double.
  std::vector<double> RopeInverseFrequencies() const;
  // About the floats one sequence of max_seq_len tokens keeps for backward
  // (the attention weights grow with its square), in double.
  double ActivationsPerSequence() const;
  // The parameters LayoutOf(*this) holds, in double so that any config.json's
  // values give a number (exact below 2^53).
  double ParameterCount() const;
  // Every size positive, heads dividing hidden_size into an even head_dim
  // (or an even explicit head_dim), kv heads dividing heads, rope_scaling's
  // numbers in range; the message names the field and its value.
  Status Validate() const;
};

// The first feature of `config` that the CUDA engine (models/cuda/llama_engine.h,
// which has no bias terms and takes head_dim as hidden_size / heads) does
// not implement, named as config.json names it, or empty when it
// implements them all. Here rather than in models/cuda/ so that builds without
// CUDA test it.
std::string GpuEngineLacks(const LlamaConfig& config);

// Where each tensor of a decoder lives in the flat buffer: Hugging Face's
// state_dict order, which, without biases, also makes q, k, v (and gate, up)
// adjacent, so each group is one [rows, hidden] matrix and one GEMM. The CPU model and the CUDA
// engine both lay out their buffers from this. Offsets count elements.
struct LlamaLayout {
  // Offsets of each block's tensors. Without biases q, k, v (and gate, up)
  // are adjacent, so qkv (gate_up) is one [rows, hidden] matrix; a bias
  // follows its weight, as in Hugging Face's state_dict, and splits the
  // group. kNone marks an absent bias.
  static constexpr uint64_t kNone = ~uint64_t(0);
  struct Layer {
    uint64_t qkv, o, gate_up, down, input_norm, post_norm;
    uint64_t k = 0, v = 0, up = 0;
    uint64_t q_bias = kNone, k_bias = kNone, v_bias = kNone, o_bias = kNone;
    uint64_t gate_bias = kNone, up_bias = kNone, down_bias = kNone;
  };
  Manifest manifest;
  std::vector<Layer> layers;
  uint64_t embed = 0, final_norm = 0, lm_head = 0;  // lm_head == embed when tied
  // models/step_hooks.h's units in buffer order: the embedding, each block
  // (its tensors up to the next block's), then the final norm and the LM head
  // when untied.
  std::vector<ParameterUnit> units;
};
LlamaLayout LayoutOf(const LlamaConfig& config);
// How many tensors LayoutOf(config) holds, counted without naming them (nine
// per block and its biases, the embedding, the final norm and an untied LM head): a reader
// compares it with a file's before a config's layer count can cost memory.
int64_t TensorCountOf(const LlamaConfig& config);

// Hugging Face's init into a buffer of manifest.total_elements floats:
// normal(0, 0.02) for every matrix (embedding, projections, LM head), ones for
// the norms (the 1-D tensors); from one generator seeded with `seed`, with
// explicit draws, so the same seed gives the same bits anywhere. Llama's and
// the GPU engine's Initialize both call it: the twins start from the same bits.
void InitializeLlamaParameters(const Manifest& manifest, uint64_t seed, std::span<float> params);

class Llama {
 public:
  // A model with zero parameters (call Initialize or load weights) and an
  // arena for batches of up to max_batch sequences of up to max_seq_len;
  // with recompute, an arena of one block's activations (see above).
  static Result<Llama> Create(const LlamaConfig& config, int max_batch, bool recompute = false);

  Llama(Llama&&) = default;
  Llama& operator=(Llama&&) = default;
  Llama(const Llama&) = delete;  // the layers point into this object's buffers
  Llama& operator=(const Llama&) = delete;

  const LlamaConfig& config() const { return config_; }
  int max_batch() const { return max_batch_; }
  bool recompute() const { return recompute_; }
  const Manifest& manifest() const { return manifest_; }
  std::span<float> parameters() { return params_; }
  std::span<const float> parameters() const { return params_; }
  std::span<float> gradients() { return grads_; }
  std::span<const float> gradients() const { return grads_; }
  std::vector<ParameterUnit> units() const { return units_; }
  // The activation arena (sized for max_batch x max_seq_len; only the pages
  // of the largest step run so far are resident, see above).
  std::span<const float> activation_arena() const { return {arena_.data(), arena_.size()}; }

  // InitializeLlamaParameters into parameters().
  void Initialize(uint64_t seed);

  // tokens and targets are [batch, seq]. Overwrites gradients() (or adds, see
  // BackwardOptions) and returns the mean cross-entropy over the targets that
  // are not -100 (kIgnoredTarget, models/transformer_ops.h: F.cross_entropy's
  // ignore_index), whose positions get no gradient; with every target
  // ignored the loss is 0 and every gradient 0. Fails, touching nothing, on a
  // token outside [0, vocab_size), a target outside it other than -100, a
  // batch or seq out of range, or a grad_scale that is not finite.
  Result<float> ForwardBackward(const int32_t* tokens, const int32_t* targets, int batch, int seq,
                                const BackwardOptions& options = {});

  // Writes logits [batch, seq, vocab_size].
  Status Forward(const int32_t* tokens, int batch, int seq, float* logits);

 private:
  // The adapted model runs this model's own arena and ops, with adapters
  // added around the projections and a frozen backward (models/lora.h).
  friend class LoraLlama;
  // The incremental decoder (models/generate.h) reads the weights and RoPE
  // tables and calls the same ops as RunForward, one token at a time.
  friend class KvCacheDecoder;

  struct Layer {
    LinearGroup qkv, gate_up;  // one GEMM each unless biases split them (layers.h)
    Linear o, down;
    float *input_norm = nullptr, *d_input_norm = nullptr, *post_norm = nullptr, *d_post_norm = nullptr;
  };
  // What one block keeps for backward (n = batch * seq rows).
  struct LayerActivations {
    float *rstd1, *xn1;     // input RMSNorm: [n], [n, D]
    float *qkv;             // fused projection after RoPE: [n, (H + 2 KV) * head_dim]
    float *probs;           // [batch, H, seq, seq]
    float *attn;            // [n, H * head_dim], before o_proj
    float *h;               // the residual stream after attention: [n, D]
    float *rstd2, *xn2;     // post-attention RMSNorm: [n], [n, D]
    float *gate_up, *act;   // [n, 2 I], silu(gate) * up: [n, I]
  };
  // Pointers into arena_ for one (batch, seq); layers has num_layers entries,
  // sized once, so carving allocates nothing.
  struct Activations {
    float* resid = nullptr;  // num_layers + 1 blocks of [n, D]: the embeddings, then each block's output
    size_t resid_stride = 0;
    std::vector<LayerActivations> layers;
    float *rstd_final, *xn_final, *logits;  // [n], [n, D], [n, V]; backward turns logits into their gradient
    // Backward scratch, reused by every block.
    float *dresid, *dxn, *dqkv, *dattn, *dscores, *dgate_up, *dact;
  };

  Llama(const LlamaConfig& config, int max_batch, bool recompute);
  Status CheckInput(const int32_t* tokens, const int32_t* targets, int batch, int seq) const;
  // Points acts_ into `base` laid out for (batch, seq) and returns the floats
  // used; with base == nullptr it only measures. With recompute every block's
  // LayerActivations are the same one region.
  size_t Carve(int batch, int seq, float* base);
  void RunForward(const int32_t* tokens, int batch, int seq, float* logits, StepHooks& hooks);
  // Block l's forward from its input (resid block l) into acts_.layers[l]:
  // through the SwiGLU, then, with to_output, the down projection and the
  // residual into resid block l + 1 (backward's recomputation stops before).
  void ForwardBlock(int l, int batch, int seq, bool to_output);

  LlamaConfig config_;
  int max_batch_ = 0;
  bool recompute_ = false;
  Manifest manifest_;
  std::vector<ParameterUnit> units_;
  FlatBuffer<float> params_, grads_;
  FlatBuffer<float> arena_;
  std::vector<float> rope_cos_, rope_sin_;
  std::vector<Layer> layers_;
  float *embed_ = nullptr, *d_embed_ = nullptr, *final_norm_ = nullptr, *d_final_norm_ = nullptr;
  Linear lm_head_;
  Activations acts_;
};

// A Hugging Face model directory: model.safetensors (fp32, names as
// manifest()) and config.json (LlamaConfig's keys, architectures as
// config.architecture), which transformers' from_pretrained(dir) loads.
// Both files are written atomically; the directory is created if needed.
Status SaveHfCheckpoint(const std::filesystem::path& dir, const Llama& model);

struct HfLoadOptions {
  int max_batch = 1;
  // The context the model runs at (its arena and RoPE tables); 0: config.json's
  // max_position_embeddings. Published models claim 32k to 128k positions,
  // whose attention arena no CPU step needs.
  int max_seq_len = 0;
  // The most bytes the fp32 weights and gradients may take, and apart from
  // them the activation arena; 0: the machine's physical memory.
  uint64_t max_bytes = 0;
  // Activation recompute (Llama::Create): one block's activations in the arena.
  bool recompute = false;
};

// Reads dir/config.json: LlamaForCausalLM, MistralForCausalLM (no sliding
// window shorter than the context) and Qwen2ForCausalLM, with transformers'
// defaults for absent keys; anything else is refused in one line naming the
// key. max_seq_len as in HfLoadOptions.
Result<LlamaConfig> ReadHfConfig(const std::filesystem::path& dir, int max_seq_len = 0);

// Reads such a directory into a model with an arena for max_batch sequences:
// config.json, and model.safetensors or the shards that
// model.safetensors.index.json's weight_map names (each tensor in exactly the
// shard it names), stored as F32, BF16 or F16 (widened exactly to fp32).
// Every tensor's name and shape is checked, then the fp32 weights and
// gradients the model would map against options.max_bytes, before the model
// is made; the first error is reported with the file and the tensor's name.
Result<Llama> LoadHfCheckpoint(const std::filesystem::path& dir, const HfLoadOptions& options);
Result<Llama> LoadHfCheckpoint(const std::filesystem::path& dir, int max_batch = 1);

// What LoadHfCheckpoint will check the weights and gradients against: the
// machine's physical memory.
uint64_t PhysicalMemoryBytes();

}  // namespace estuary::models
