// TokenSource: one training file seen as a flat stream of int32 tokens (with per-token labels for
// JSONL), read by range. Token files and text are read window by window (pread, never mapped or read
// into RAM whole: Note [Data files are read, not mapped] in the .cpp); JSONL
// is parsed at open. Formats in docs/training.md ("Data"). Immutable after open; read() is
// thread-safe. Tokens are little-endian on disk, as llm.c and nanoGPT write them.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "common/status.h"
#include "io/env.h"

namespace zo::engine {

enum class DataFormat {
  kAuto,     // by extension: .bin → llm.c if the file starts with its magic, else raw (but see
             // open_token_source); .jsonl → JSONL; else text
  kLlmcBin,  // llm.c: 256 int32 header (magic 20240520, version 1 = uint16 / 2 = uint32 tokens, count), tokens
  kRawBin,   // nanoGPT: tokens only, uint16 unless SourceOptions::raw_token_bytes is 4
  kJsonl,    // one object per line: "input_ids" [ints], optional "labels" (same length, -100 = masked)
  kText,     // any bytes; byte-level tokenizer: token = byte value, vocabulary 256
};

std::string_view to_string(DataFormat format);
// "auto", "llmc", "raw", "jsonl", "text"; kInvalidArgument listing them otherwise.
Result<DataFormat> parse_data_format(std::string_view name);

// The label that masks a target out of the loss (PyTorch's ignore_index).
inline constexpr int32_t kIgnoreLabel = -100;

struct SourceOptions {
  DataFormat format = DataFormat::kAuto;
  uint32_t raw_token_bytes = 2;     // kRawBin (and .bin without llm.c magic): 2 = uint16, 4 = uint32
  uint64_t jsonl_chunk_bytes = uint64_t{16} << 20;  // JSONL is read this much at a time; > 0
  io::Env* env = nullptr;  // reads the file; must outlive the source; required (io::require_env)
};

class TokenSource {
 public:
  virtual ~TokenSource() = default;

  virtual uint64_t num_tokens() const = 0;
  // Copies tokens [begin, begin + count) to `tokens` and, if `labels` is not null, their labels:
  // the JSONL "labels" where given, else the tokens themselves. Range outside num_tokens(): aborts.
  // kCorruption naming the file and token index for a uint32 token that does not fit int32.
  virtual Status read(uint64_t begin, uint64_t count, int32_t* tokens, int32_t* labels) const = 0;

  virtual DataFormat format() const = 0;  // never kAuto: what the file was read as
  virtual bool has_labels() const { return false; }
  // The vocabulary the format implies: 256 for kText, nullopt when the tokenizer is external.
  virtual std::optional<uint64_t> vocab_size() const { return std::nullopt; }
  const std::string& path() const { return path_; }

 protected:
  explicit TokenSource(std::string path) : path_(std::move(path)) {}

 private:
  std::string path_;
};

// Opens `path` as `options.format` says (kAuto: by extension). Errors name the path and what is
// wrong: kNotFound / kIoError with errno for open and read; kCorruption for a bad llm.c header (magic,
// version, token count vs file size) or a raw file whose size is not a multiple of the token
// width; kCorruption under kAuto for a .bin without the magic whose header is otherwise llm.c's
// (Note [llm.c lookalike] in the .cpp; kRawBin reads it raw); kInvalidArgument "PATH:LINE: ..."
// for a malformed JSONL line; kInvalidArgument for an empty file.
Result<std::unique_ptr<TokenSource>> open_token_source(const std::string& path, const SourceOptions& options);

}  // namespace zo::engine
