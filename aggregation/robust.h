// Byzantine-robust aggregation rules: pure functions over all of a round's
// updates at once, as opposed to the streaming Strategy (strategy.h).
//
// Each rule reads its updates through an UpdateSource, coordinate block by
// block, so that the updates need not all be in memory at once (the server
// keeps them staged as files). Memory, for n updates of d values and a block
// of b values (kDefaultBlock unless given):
//   CoordinateMedian, TrimmedMean   n·b floats (+ n doubles)
//   Krum, MultiKrum                 n·b floats + n² doubles (pairwise distances)
//   Bulyan                          n·b floats + n² doubles
// plus the d-float output. Every rule reads each update once per pass:
// median and trimmed mean one pass, Krum and Bulyan two (distances, then the
// selected updates' mean).
//
// The rules are unweighted, as in the papers: every update counts once, however
// many examples its site trained on (a Byzantine site could claim any number).
//
// Ties (equal scores, equal distances) go to the lower update index, so a
// rule's result does not depend on anything but its inputs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "base/status.h"

namespace estuary::aggregation {

// A round's updates, each size() values, read by coordinate range.
class UpdateSource {
 public:
  virtual ~UpdateSource() = default;
  virtual size_t size() const = 0;   // values per update
  virtual size_t count() const = 0;  // updates
  // Copies values [offset, offset + out.size()) of update `update` into out.
  // Fails on a range outside [0, size()) or an update >= count().
  virtual Status Read(size_t update, size_t offset, std::span<float> out) const = 0;
};

// A round's updates, kept until its rule runs: each either a copy (Add) or
// a view of memory someone else owns (Keep: the server's staged update, a
// file it mapped), held alive by a shared owner until Clear or destruction.
class KeptUpdates final : public UpdateSource {
 public:
  explicit KeptUpdates(size_t size) : size_(size) {}
  // Fails, adding nothing, unless values.size() == size().
  Status Add(std::span<const float> values);
  Status Keep(std::shared_ptr<const void> owner, std::span<const float> values);
  void Clear() { kept_.clear(); }

  size_t size() const override { return size_; }
  size_t count() const override { return kept_.size(); }
  Status Read(size_t update, size_t offset, std::span<float> out) const override;
  // Floats copied by Add (what the kept updates take of the heap).
  size_t copied_floats() const;

 private:
  struct Kept {
    std::shared_ptr<const void> owner;
    std::span<const float> values;
    bool copied = false;
  };
  size_t size_;
  std::vector<Kept> kept_;
};

inline constexpr size_t kDefaultBlock = 1 << 16;

// Coordinate-wise median (Yin, Chen, Ramchandran and Bartlett, "Byzantine-
// Robust Distributed Learning: Towards Optimal Statistical Rates", ICML 2018):
// out[j] = median over updates of value j; for an even count, the mean of the
// two middle values (in double, as NumPy's median). Needs n >= 1.
Status CoordinateMedian(const UpdateSource& updates, std::span<float> out, size_t block = kDefaultBlock);

// Coordinate-wise trimmed mean (Yin et al. 2018): per coordinate, drop the
// ⌊β n⌋ largest and the ⌊β n⌋ smallest values and average the rest (summed
// in ascending order, in double). Needs β in [0, 0.5) and n - 2⌊β n⌋ >= 1.
Status TrimmedMean(const UpdateSource& updates, double beta, std::span<float> out, size_t block = kDefaultBlock);

// Squared L2 distances between every pair of updates, n×n row-major, summed
// block by block in double (directly as Σ (x_i - x_j)², not from a Gram
// matrix, whose G_ii + G_jj - 2 G_ij cancels badly for nearby updates).
Result<std::vector<double>> PairwiseSquaredDistances(const UpdateSource& updates, size_t block = kDefaultBlock);

// Krum scores (Blanchard, El Mhamdi, Guerraoui and Stainer, "Machine Learning
// with Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017): the
// score of update i is the sum of its squared distances to its n - f - 2
// nearest other updates. `distances` as PairwiseSquaredDistances; `among`
// the updates taking part (all of them if empty), n = among.size().
// Needs n >= 2f + 3.
Result<std::vector<double>> KrumScores(std::span<const double> distances, size_t total, size_t f,
                                       std::span<const size_t> among = {});

// The m updates of lowest Krum score, lowest first (ties: lower index).
// Krum is m = 1; Multi-Krum any m in [1, n - f]. Needs n >= 2f + 3.
Result<std::vector<size_t>> KrumSelect(const UpdateSource& updates, size_t f, size_t m, size_t block = kDefaultBlock);

// Krum's choice (m = 1), or Multi-Krum's: the unweighted mean of the m
// selected updates. Writes the result into out; returns the selection.
Result<std::vector<size_t>> MultiKrum(const UpdateSource& updates, size_t f, size_t m, std::span<float> out,
                                      size_t block = kDefaultBlock);

// Bulyan (El Mhamdi, Guerraoui and Rouault, "The Hidden Vulnerability of
// Distributed Learning in Byzantium", ICML 2018): select θ = n - 2f updates
// by Krum repeatedly (each time over those not yet selected, with the same
// f; a Krum over fewer than f + 3 takes no neighbours into account and
// picks the lowest index), then per coordinate average the β = θ - 2f
// selected values closest to their median. Needs n >= 4f + 3. Returns the
// selection, in the order picked.
Result<std::vector<size_t>> Bulyan(const UpdateSource& updates, size_t f, std::span<float> out,
                                   size_t block = kDefaultBlock);

}  // namespace estuary::aggregation
