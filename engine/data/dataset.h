// Dataset: fixed-length training windows packed from one TokenSource, shuffled per epoch by
// (seed, epoch), cut into micro-batches and dealt to ranks; its read position is a plain value a
// checkpoint stores so a resumed run reads exactly the batches it would have read. Packing, order
// and rank split in docs/training.md ("Data"). Not synchronised: one trainer thread per Dataset.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/data/token_source.h"

namespace zo::engine {

struct DataOptions {
  std::string path;
  SourceOptions source;
  uint64_t seq_len = 0;      // tokens per row of inputs (and of targets); > 0
  uint64_t micro_batch = 1;  // windows per batch; > 0
  uint64_t seed = 0;
  bool shuffle = true;  // false: windows in file order every epoch
  uint64_t rank = 0;    // this process's rank, < world_size
  uint64_t world_size = 1;
};

// Where reading continues: `index` global batches of epoch `epoch` have been handed out (to all
// ranks together), so it is the same value on every rank after the same number of steps.
struct DataPosition {
  uint64_t epoch = 0;
  uint64_t index = 0;
  bool operator==(const DataPosition&) const = default;
};

// One micro-batch, row-major [batch × seq_len]. targets[r][j] is the label of the token after
// inputs[r][j]; kIgnoreLabel (-100) where it is masked out of the loss.
struct Batch {
  uint64_t batch = 0;
  uint64_t seq_len = 0;
  std::vector<int32_t> inputs;
  std::vector<int32_t> targets;
  std::vector<uint64_t> windows;  // the window index of each row (for logs and tests)
  DataPosition position;          // the position this batch was read from
};

class Dataset {
 public:
  // Opens options.path (open_token_source) and checks the sizes. kInvalidArgument for bad options
  // (seq_len or micro_batch 0, rank ≥ world_size), for data too short to give every rank one
  // batch per epoch, naming the file, its token count and what the options need, and for labels
  // that mask every target the windows read ("PATH: every label is -100 (masked): ...").
  static Result<std::unique_ptr<Dataset>> open(const DataOptions& options);
  // The same over an already open source (options.path is ignored).
  static Result<std::unique_ptr<Dataset>> create(std::unique_ptr<TokenSource> source, const DataOptions& options);

  const TokenSource& source() const { return *source_; }
  const DataOptions& options() const { return options_; }
  // Windows of seq_len + 1 tokens starting every seq_len tokens: (num_tokens − 1) / seq_len.
  uint64_t num_windows() const { return num_windows_; }
  // Full micro-batches in one epoch, all ranks together: num_windows / micro_batch.
  uint64_t batches_per_epoch() const { return batches_per_epoch_; }
  // Batches this rank reads per epoch (every rank the same): batches_per_epoch / world_size.
  uint64_t steps_per_epoch() const { return batches_per_epoch_ / options_.world_size; }

  DataPosition position() const { return position_; }
  // Continues from a checkpointed position (any epoch; index ≤ batches_per_epoch, else
  // kInvalidArgument naming both). Positions are meaningful across world sizes: index counts
  // global batches.
  Status set_position(DataPosition position);

  // Fills `out` with this rank's next batch and advances the position by world_size batches,
  // rolling over to the next epoch when fewer than world_size remain. Errors only from the source
  // (a token that does not fit int32). Reuses out's vectors.
  Status next_batch(Batch* out);

 private:
  Dataset(std::unique_ptr<TokenSource> source, const DataOptions& options, uint64_t num_windows);
  // The window at slot `slot` of epoch `epoch`'s order.
  uint64_t window_at(uint64_t epoch, uint64_t slot);

  std::unique_ptr<TokenSource> source_;
  DataOptions options_;
  uint64_t num_windows_ = 0;
  uint64_t batches_per_epoch_ = 0;
  DataPosition position_;
  uint64_t order_epoch_ = 0;     // the epoch order_ belongs to
  std::vector<uint64_t> order_;  // empty until first needed, or when not shuffling
  std::vector<int32_t> labels_;  // scratch: one window's labels
};

}  // namespace zo::engine
