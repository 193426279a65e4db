#include "engine/data/dataset.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "engine/data/shuffle.h"

namespace zo::engine {

// Note [Packing]
// The token stream (JSONL examples concatenated in file order, no separator added) is read as
// overlapping windows: window w is tokens [w·T, w·T + T] (T + 1 tokens), inputs its first T and
// targets its last T, as llm.c and nanoGPT read their token files. Consecutive windows share one
// token, so every token but the first is a target exactly once per epoch; the tail that cannot
// fill a window is never read. Targets are the labels of those tokens: the tokens themselves, or
// JSONL "labels" with their -100 masks. A window that crosses from one JSONL example into the next
// keeps that boundary target unmasked, as Hugging Face's packing (group_texts) does.

// Note [Nothing to train on]
// A data set whose every target is -100 trains with loss 0 (the masked sum over a count clamped to
// 1) and learns nothing, silently. Dataset refuses it at open: the labels that some window reads as
// a target, [1, windows · T], must hold at least one that is not -100. A file with real labels only
// at its first token or in its unread tail is refused as well, with a message that says where they
// are. Only sources with labels (JSONL) can mask anything; the scan stops at the first real label.
// A window or a batch that is fully masked, among others that are not, is left alone: its loss and
// gradients are 0 for that micro-batch, as PyTorch's ignore_index gives, and the run still learns.
namespace {

constexpr uint64_t kScanTokens = uint64_t{1} << 16;

// Whether any label of tokens [begin, end) of `source` is not kIgnoreLabel.
Result<bool> any_unmasked(const TokenSource& source, uint64_t begin, uint64_t end) {
  std::vector<int32_t> tokens(kScanTokens), labels(kScanTokens);
  for (uint64_t at = begin; at < end; at += kScanTokens) {
    const uint64_t n = std::min(kScanTokens, end - at);
    ZO_RETURN_IF_ERROR(source.read(at, n, tokens.data(), labels.data()));
    if (std::any_of(labels.begin(), labels.begin() + static_cast<ptrdiff_t>(n),
                    [](int32_t l) { return l != kIgnoreLabel; }))
      return true;
  }
  return false;
}

Status check_something_to_train_on(const TokenSource& source, uint64_t windows, uint64_t seq_len) {
  if (!source.has_labels()) return Status::ok();
  const uint64_t target_end = windows * seq_len + 1;  // window w's targets are tokens w·T + 1 ... w·T + T
  ZO_ASSIGN_OR_RETURN(bool targets, any_unmasked(source, 1, target_end));
  if (targets) return Status::ok();
  ZO_ASSIGN_OR_RETURN(bool first, any_unmasked(source, 0, 1));
  ZO_ASSIGN_OR_RETURN(bool tail, any_unmasked(source, target_end, source.num_tokens()));
  if (!first && !tail)
    return invalid_argument(source.path() + ": every label is -100 (masked): there is nothing to train on");
  return invalid_argument(
      source.path() + ": every target of its " + std::to_string(windows) + " windows of seq_len " +
      std::to_string(seq_len) + " is -100 (masked); its other labels are " +
      (first ? "at token 0, which is never a target" : "") + (first && tail ? ", and " : "") +
      (tail ? "in the last " + std::to_string(source.num_tokens() - target_end) + " tokens, which fill no window"
            : "") +
      ": there is nothing to train on");
}

}  // namespace

Result<std::unique_ptr<Dataset>> Dataset::open(const DataOptions& options) {
  ZO_ASSIGN_OR_RETURN(std::unique_ptr<TokenSource> source, open_token_source(options.path, options.source));
  return create(std::move(source), options);
}

Result<std::unique_ptr<Dataset>> Dataset::create(std::unique_ptr<TokenSource> source, const DataOptions& options) {
  ZO_CHECK(source != nullptr);
  if (options.seq_len == 0) return invalid_argument("data: seq_len must be > 0");
  if (options.micro_batch == 0) return invalid_argument("data: micro_batch must be > 0");
  if (options.world_size == 0 || options.rank >= options.world_size)
    return invalid_argument("data: rank " + std::to_string(options.rank) + " is not below world_size " +
                            std::to_string(options.world_size));
  const uint64_t n = source->num_tokens();
  const uint64_t windows = n == 0 ? 0 : (n - 1) / options.seq_len;
  const uint64_t needed_windows = options.micro_batch * options.world_size;
  if (windows < needed_windows) {
    const uint64_t needed_tokens = needed_windows * options.seq_len + 1;
    return invalid_argument(source->path() + ": too little data: " + std::to_string(n) + " tokens (" +
                            std::string(to_string(source->format())) + ") make " + std::to_string(windows) +
                            " windows of seq_len " + std::to_string(options.seq_len) + " + 1; micro_batch " +
                            std::to_string(options.micro_batch) + " × world_size " +
                            std::to_string(options.world_size) + " needs " + std::to_string(needed_windows) +
                            " windows, i.e. at least " + std::to_string(needed_tokens) + " tokens");
  }
  ZO_RETURN_IF_ERROR(check_something_to_train_on(*source, windows, options.seq_len));  // Note [Nothing to train on]
  return std::unique_ptr<Dataset>(new Dataset(std::move(source), options, windows));
}

Dataset::Dataset(std::unique_ptr<TokenSource> source, const DataOptions& options, uint64_t num_windows)
    : source_(std::move(source)),
      options_(options),
      num_windows_(num_windows),
      batches_per_epoch_(num_windows / options.micro_batch) {}

Status Dataset::set_position(DataPosition position) {
  if (position.index > batches_per_epoch_)
    return invalid_argument("data position: batch index " + std::to_string(position.index) + " of epoch " +
                            std::to_string(position.epoch) + " is past the " + std::to_string(batches_per_epoch_) +
                            " batches an epoch of " + source_->path() + " has with these options");
  position_ = position;
  return Status::ok();
}

uint64_t Dataset::window_at(uint64_t epoch, uint64_t slot) {
  if (!options_.shuffle) return slot;
  if (order_.empty() || order_epoch_ != epoch) {
    order_ = epoch_permutation(num_windows_, options_.seed, epoch);
    order_epoch_ = epoch;
  }
  return order_[slot];
}

Status Dataset::next_batch(Batch* out) {
  // Rank r reads global batches index + r; all ranks step index by world_size together and roll
  // over at the same point, so the global batches that do not fill a last round are skipped.
  if (position_.index + options_.world_size > batches_per_epoch_) position_ = {position_.epoch + 1, 0};
  const uint64_t global_batch = position_.index + options_.rank;
  const uint64_t mb = options_.micro_batch;
  const uint64_t t = options_.seq_len;

  out->batch = mb;
  out->seq_len = t;
  out->position = position_;
  out->inputs.resize(mb * t);
  out->targets.resize(mb * t);
  out->windows.resize(mb);
  labels_.resize(t + 1);
  for (uint64_t row = 0; row < mb; ++row) {
    const uint64_t w = window_at(position_.epoch, global_batch * mb + row);
    out->windows[row] = w;
    int32_t* inputs = out->inputs.data() + row * t;
    // The window's first T tokens go straight into inputs; the (T+1)-th is only needed as a label.
    ZO_RETURN_IF_ERROR(source_->read(w * t, t, inputs, labels_.data()));
    int32_t last_token;
    ZO_RETURN_IF_ERROR(source_->read(w * t + t, 1, &last_token, labels_.data() + t));
    std::copy(labels_.begin() + 1, labels_.end(), out->targets.begin() + static_cast<ptrdiff_t>(row * t));
  }
  position_.index += options_.world_size;
  return Status::ok();
}

}  // namespace zo::engine
