#include "engine/data/token_source.h"

#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <span>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/string_util.h"
#include "io/env.h"

namespace zo::engine {
namespace {

constexpr int32_t kLlmcMagic = 20240520;
constexpr uint64_t kLlmcHeaderInts = 256;
constexpr uint64_t kLlmcHeaderBytes = kLlmcHeaderInts * sizeof(int32_t);

// Note [Data files are read, not mapped]
// Token files and text are read window by window with pread (io::ReadFile), never mapped: a mapped
// file that shrinks under the run (`cp new.bin data.bin` and `cat > data.txt` truncate it first)
// turns the next read of a page past its new end into SIGBUS, which killed the process with no
// message and exit 135. A read past the end is an error naming the file instead, returned by the
// step that reads it; what was saved before is untouched. Each window is one small read (seq_len + 1
// tokens) served by the page cache, as the mapping's pages were.

// A data file open for reading, with its size when opened; an empty file is refused.
class DataFile {
 public:
  static Result<std::unique_ptr<DataFile>> open(const std::string& path, io::Env* env) {
    ZO_ASSIGN_OR_RETURN(std::unique_ptr<io::ReadFile> file, env->open_read(path, "data file"));
    if (file->size_bytes() == 0) return invalid_argument(path + ": the file is empty");
    return std::unique_ptr<DataFile>(new DataFile(std::move(file)));
  }

  uint64_t size_bytes() const { return file_->size_bytes(); }
  // Bytes [offset, offset + out.size()); kCorruption naming the file when it has shrunk since it
  // was opened (Note [Data files are read, not mapped]). Thread-safe.
  Status read(uint64_t offset_bytes, std::span<std::byte> out) const {
    Status st = file_->read_exact(offset_bytes, out);
    if (st.is_ok() || st.code() != StatusCode::kCorruption) return st;
    return corruption(file_->path() + ": the file is shorter than the " + std::to_string(size_bytes()) +
                      " bytes it had when the run opened it: it was changed during the run (copying over or "
                      "redirecting into a data file truncates it); give the run a file nothing writes to while it "
                      "trains");
  }
  // The first bytes (headers): at most `n`.
  Result<std::vector<std::byte>> head(uint64_t n) const {
    std::vector<std::byte> out(std::min(n, size_bytes()));
    ZO_RETURN_IF_ERROR(read(0, out));
    return out;
  }

 private:
  explicit DataFile(std::unique_ptr<io::ReadFile> file) : file_(std::move(file)) {}
  std::unique_ptr<io::ReadFile> file_;
};

// Tokens of 1, 2 or 4 bytes (little-endian) at a byte offset of a file: llm.c, raw and text.
class FileTokens final : public TokenSource {
 public:
  FileTokens(std::string path, std::unique_ptr<DataFile> file, uint64_t offset_bytes, uint32_t token_bytes,
             uint64_t n_tokens, DataFormat format)
      : TokenSource(std::move(path)),
        file_(std::move(file)),
        offset_bytes_(offset_bytes),
        token_bytes_(token_bytes),
        n_tokens_(n_tokens),
        format_(format) {}

  uint64_t num_tokens() const override { return n_tokens_; }
  DataFormat format() const override { return format_; }
  std::optional<uint64_t> vocab_size() const override {
    return format_ == DataFormat::kText ? std::optional<uint64_t>(256) : std::nullopt;
  }

  Status read(uint64_t begin, uint64_t count, int32_t* tokens, int32_t* labels) const override {
    ZO_CHECK(begin <= n_tokens_ && count <= n_tokens_ - begin)
        << "read of tokens [" << begin << ", +" << count << ") past " << n_tokens_ << " in " << path();
    std::vector<std::byte> raw(count * token_bytes_);
    ZO_RETURN_IF_ERROR(file_->read(offset_bytes_ + begin * token_bytes_, raw));
    const std::byte* p = raw.data();
    for (uint64_t i = 0; i < count; ++i) {
      uint32_t v = 0;
      if (token_bytes_ == 1) {
        v = static_cast<uint8_t>(p[i]);
      } else if (token_bytes_ == 2) {
        uint16_t t;
        std::memcpy(&t, p + 2 * i, 2);
        v = t;
      } else {
        std::memcpy(&v, p + 4 * i, 4);
        if (v > static_cast<uint32_t>(std::numeric_limits<int32_t>::max()))
          return corruption(path() + ": token " + std::to_string(v) + " at index " + std::to_string(begin + i) +
                            " does not fit a signed 32-bit token id");
      }
      tokens[i] = static_cast<int32_t>(v);
    }
    if (labels != nullptr) std::memcpy(labels, tokens, count * sizeof(int32_t));
    return Status::ok();
  }

 private:
  std::unique_ptr<DataFile> file_;
  uint64_t offset_bytes_;
  uint32_t token_bytes_;
  uint64_t n_tokens_;
  DataFormat format_;
};

// JSONL examples concatenated into RAM (fine-tuning sets are small next to pre-training corpora).
class JsonlTokens final : public TokenSource {
 public:
  JsonlTokens(std::string path, std::vector<int32_t> tokens, std::vector<int32_t> labels, bool has_labels)
      : TokenSource(std::move(path)), tokens_(std::move(tokens)), labels_(std::move(labels)), has_labels_(has_labels) {}

  uint64_t num_tokens() const override { return tokens_.size(); }
  DataFormat format() const override { return DataFormat::kJsonl; }
  bool has_labels() const override { return has_labels_; }

  Status read(uint64_t begin, uint64_t count, int32_t* tokens, int32_t* labels) const override {
    ZO_CHECK(begin <= tokens_.size() && count <= tokens_.size() - begin)
        << "read of tokens [" << begin << ", +" << count << ") past " << tokens_.size() << " in " << path();
    std::memcpy(tokens, tokens_.data() + begin, count * sizeof(int32_t));
    if (labels != nullptr) std::memcpy(labels, labels_.data() + begin, count * sizeof(int32_t));
    return Status::ok();
  }

 private:
  std::vector<int32_t> tokens_;
  std::vector<int32_t> labels_;  // == tokens_ where a line had no "labels"
  bool has_labels_;
};

Result<std::unique_ptr<TokenSource>> open_raw(const std::string& path, std::unique_ptr<DataFile> file,
                                              uint32_t token_bytes) {
  if (token_bytes != 2 && token_bytes != 4)
    return invalid_argument(path + ": raw token width must be 2 (uint16) or 4 (uint32) bytes, got " +
                            std::to_string(token_bytes));
  const uint64_t size = file->size_bytes();
  if (size % token_bytes != 0)
    return corruption(path + ": " + std::to_string(size) + " bytes is not a whole number of " +
                      std::to_string(token_bytes) + "-byte tokens (raw token file without an llm.c header)");
  return std::unique_ptr<TokenSource>(
      new FileTokens(path, std::move(file), 0, token_bytes, size / token_bytes, DataFormat::kRawBin));
}

// A token file's size and its first three int32 (where an llm.c header has its magic, version and
// token count), read once at open.
struct FileHead {
  uint64_t size_bytes = 0;
  int32_t ints[3] = {0, 0, 0};  // zero beyond the file's end

  static Result<FileHead> read(const DataFile& file) {
    FileHead h;
    h.size_bytes = file.size_bytes();
    ZO_ASSIGN_OR_RETURN(const std::vector<std::byte> bytes, file.head(sizeof h.ints));
    std::memcpy(h.ints, bytes.data(), bytes.size());
    return h;
  }
};

bool has_llmc_magic(const FileHead& head) {
  return head.size_bytes >= sizeof(int32_t) && head.ints[0] == kLlmcMagic;
}

// Note [llm.c lookalike]
// Under kAuto a .bin is llm.c when it starts with the magic, else raw tokens. An llm.c file whose
// magic is damaged or was written wrong would then train as raw uint16, its 1024-byte header as 512
// tokens, without a word. So a .bin without the magic but with llm.c's header otherwise is refused:
// its second int32 is a version (1 or 2) and either its third, as that version's token count,
// accounts for the file's size exactly (1024 + count · 2 or 4 bytes), or its first is within
// kLookalikeMagicBits flipped bits of the magic (a damaged magic in a file that is also cut short).
// For a raw uint16 file to meet the first rule, tokens 2 and 3 must be (1 or 2, 0) and tokens 4–5
// must spell its own length; for the second, tokens 0–1 must also be about 55208 and 308 (the
// magic's halves): no real corpus does either by chance, and --data-format raw reads one that does.
constexpr int kLookalikeMagicBits = 2;

struct LlmcLookalike {
  int32_t magic, version, count;
};

std::optional<LlmcLookalike> llmc_lookalike(const FileHead& head) {
  if (head.size_bytes < kLlmcHeaderBytes) return std::nullopt;
  const LlmcLookalike h{head.ints[0], head.ints[1], head.ints[2]};
  if (h.magic == kLlmcMagic || (h.version != 1 && h.version != 2)) return std::nullopt;
  const uint64_t token_bytes = h.version == 1 ? 2 : 4;
  const bool size_fits =
      h.count >= 0 && head.size_bytes - kLlmcHeaderBytes == static_cast<uint64_t>(h.count) * token_bytes;
  const bool near_magic = std::popcount(static_cast<uint32_t>(h.magic ^ kLlmcMagic)) <= kLookalikeMagicBits;
  if (!size_fits && !near_magic) return std::nullopt;
  return h;
}

Result<std::unique_ptr<TokenSource>> open_llmc(const std::string& path, std::unique_ptr<DataFile> file,
                                               const FileHead& head) {
  const uint64_t size = head.size_bytes;
  if (size < kLlmcHeaderBytes)
    return corruption(path + ": " + std::to_string(size) + " bytes is shorter than the llm.c header (" +
                      std::to_string(kLlmcHeaderBytes) + " bytes)");
  const int32_t* header = head.ints;
  if (header[0] != kLlmcMagic)
    return corruption(path + ": bad llm.c magic " + std::to_string(header[0]) + " (expected " +
                      std::to_string(kLlmcMagic) + ")");
  if (header[1] != 1 && header[1] != 2)
    return corruption(path + ": unsupported llm.c version " + std::to_string(header[1]) +
                      " (1 = uint16 tokens, 2 = uint32 tokens)");
  const uint32_t token_bytes = header[1] == 1 ? 2 : 4;
  if (header[2] < 0) return corruption(path + ": negative llm.c token count " + std::to_string(header[2]));
  const auto count = static_cast<uint64_t>(header[2]);
  const uint64_t payload = size - kLlmcHeaderBytes;
  if (payload != count * token_bytes)
    return corruption(path + ": llm.c header says " + std::to_string(count) + " tokens (" +
                      std::to_string(count * token_bytes) + " bytes) but " + std::to_string(payload) +
                      " bytes follow the header");
  return std::unique_ptr<TokenSource>(
      new FileTokens(path, std::move(file), kLlmcHeaderBytes, token_bytes, count, DataFormat::kLlmcBin));
}

// At most this many bytes of the input are quoted in an error (a line can be megabytes long).
constexpr size_t kQuoteBytes = 64;

std::string bounded(std::string_view text) { return quote_excerpt(text, kQuoteBytes); }

// A value as an error names it: containers by kind (dumping one recurses through its nesting and
// may be megabytes), scalars as JSON, bounded.
std::string describe(const nlohmann::json& v) {
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return bounded(v.dump());
}

// A row is an object of flat arrays; anything nested deeper is refused, not followed.
constexpr int kMaxJsonDepth = 8;

// Reads one JSON array of token ids (or labels, where -100 is also allowed) for `key` on `where`.
Status read_ids(const nlohmann::json& array, const std::string& where, const char* key, bool allow_ignore,
                std::vector<int32_t>* out) {
  if (!array.is_array()) return invalid_argument(where + ": \"" + key + "\" must be an array of integers");
  for (size_t i = 0; i < array.size(); ++i) {
    const nlohmann::json& v = array[i];
    bool ok = false;
    int64_t value = 0;
    if (v.is_number_unsigned()) {
      const auto u = v.get<uint64_t>();
      ok = u <= static_cast<uint64_t>(std::numeric_limits<int32_t>::max());
      value = static_cast<int64_t>(u);
    } else if (v.is_number_integer()) {
      value = v.get<int64_t>();
      ok = (value >= 0 && value <= std::numeric_limits<int32_t>::max()) || (allow_ignore && value == kIgnoreLabel);
    }
    if (!ok)
      return invalid_argument(where + ": " + key + "[" + std::to_string(i) + "] = " + describe(v) + " is not " +
                              (allow_ignore ? "a token id in [0, 2^31) or -100" : "a token id in [0, 2^31)"));
    out->push_back(static_cast<int32_t>(value));
  }
  return Status::ok();
}

// Parses JSONL rows into token and label vectors, one line at a time.
class JsonlParser {
 public:
  explicit JsonlParser(std::string path) : path_(std::move(path)) {}

  Status line(std::string_view line) {
    ++line_no_;
    if (line.find_first_not_of(" \t\r") == std::string::npos) return Status::ok();  // blank lines separate nothing
    const std::string where = path_ + ":" + std::to_string(line_no_);
    nlohmann::json obj;
    bool too_deep = false;
    try {
      // Deeper values are dropped as they are parsed (the callback's false), so a line nesting
      // 100,000 arrays costs neither memory nor recursion.
      obj = nlohmann::json::parse(line, [&](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
        if (depth <= kMaxJsonDepth) return true;
        too_deep = true;
        return false;
      });
    } catch (const nlohmann::json::exception& e) {  // parse_error, or out_of_range for a number too long
      return invalid_argument(where + ": not valid JSON (" + bounded(e.what()) + ")");
    }
    if (too_deep)
      return invalid_argument(where + ": nested deeper than " + std::to_string(kMaxJsonDepth) +
                              " levels (a row is an object of flat arrays of token ids)");
    if (!obj.is_object()) return invalid_argument(where + ": expected a JSON object with \"input_ids\"");
    if (!obj.contains("input_ids")) return invalid_argument(where + ": missing \"input_ids\"");
    const size_t first = tokens_.size();
    ZO_RETURN_IF_ERROR(read_ids(obj["input_ids"], where, "input_ids", false, &tokens_));
    if (obj.contains("labels")) {
      any_labels_ = true;
      const size_t before = labels_.size();
      ZO_RETURN_IF_ERROR(read_ids(obj["labels"], where, "labels", true, &labels_));
      if (labels_.size() - before != tokens_.size() - first)
        return invalid_argument(where + ": \"labels\" has " + std::to_string(labels_.size() - before) +
                                " entries but \"input_ids\" has " + std::to_string(tokens_.size() - first));
    } else {
      labels_.insert(labels_.end(), tokens_.begin() + static_cast<ptrdiff_t>(first), tokens_.end());
    }
    return Status::ok();
  }

  Result<std::unique_ptr<TokenSource>> finish() {
    if (tokens_.empty()) return invalid_argument(path_ + ": no tokens (no line with a non-empty \"input_ids\")");
    return std::unique_ptr<TokenSource>(new JsonlTokens(path_, std::move(tokens_), std::move(labels_), any_labels_));
  }

 private:
  std::string path_;
  std::vector<int32_t> tokens_;
  std::vector<int32_t> labels_;
  bool any_labels_ = false;
  uint64_t line_no_ = 0;
};

// JSONL is read in chunks of SourceOptions::jsonl_chunk_bytes (a line may span several: it is
// joined first).
Result<std::unique_ptr<TokenSource>> open_jsonl(const std::string& path, io::Env* env, uint64_t chunk_bytes) {
  if (chunk_bytes == 0) return invalid_argument("jsonl_chunk_bytes must be positive");
  // Read, not mapped (Note [Data files are read, not mapped]): the file may change while it is parsed.
  ZO_ASSIGN_OR_RETURN(std::unique_ptr<DataFile> file, DataFile::open(path, env));
  JsonlParser parser(path);
  std::string pending;  // the start of a line the last chunk cut
  std::string chunk;
  for (uint64_t offset = 0; offset < file->size_bytes();) {
    chunk.resize(std::min(chunk_bytes, file->size_bytes() - offset));
    ZO_RETURN_IF_ERROR(file->read(offset, std::as_writable_bytes(std::span(chunk))));
    offset += chunk.size();
    std::string_view text(chunk);
    for (size_t eol; (eol = text.find('\n')) != std::string_view::npos; text.remove_prefix(eol + 1)) {
      if (pending.empty()) {
        ZO_RETURN_IF_ERROR(parser.line(text.substr(0, eol)));
      } else {
        pending.append(text.substr(0, eol));
        ZO_RETURN_IF_ERROR(parser.line(pending));
        pending.clear();
      }
    }
    pending.append(text);
  }
  if (!pending.empty()) ZO_RETURN_IF_ERROR(parser.line(pending));  // the last line, without its newline
  return parser.finish();
}

}  // namespace

std::string_view to_string(DataFormat format) {
  switch (format) {
    case DataFormat::kAuto: return "auto";
    case DataFormat::kLlmcBin: return "llmc";
    case DataFormat::kRawBin: return "raw";
    case DataFormat::kJsonl: return "jsonl";
    case DataFormat::kText: return "text";
  }
  return "?";
}

Result<DataFormat> parse_data_format(std::string_view name) {
  for (DataFormat f :
       {DataFormat::kAuto, DataFormat::kLlmcBin, DataFormat::kRawBin, DataFormat::kJsonl, DataFormat::kText})
    if (name == to_string(f)) return f;
  return invalid_argument("unknown data format \"" + std::string(name) + "\" (auto, llmc, raw, jsonl, text)");
}

Result<std::unique_ptr<TokenSource>> open_token_source(const std::string& path, const SourceOptions& options) {
  ZO_RETURN_IF_ERROR(io::require_env(options.env, "SourceOptions::env"));
  // The Env refuses a FIFO before opening it: it would block the open forever.
  io::Env* env = options.env;
  DataFormat format = options.format;
  const std::string ext = std::filesystem::path(path).extension().string();
  if (format == DataFormat::kAuto && ext == ".jsonl") format = DataFormat::kJsonl;
  if (format == DataFormat::kJsonl) return open_jsonl(path, env, options.jsonl_chunk_bytes);

  ZO_ASSIGN_OR_RETURN(std::unique_ptr<DataFile> file, DataFile::open(path, env));
  ZO_ASSIGN_OR_RETURN(const FileHead head, FileHead::read(*file));
  if (format == DataFormat::kAuto) {
    if (ext != ".bin") {
      format = DataFormat::kText;
    } else if (has_llmc_magic(head)) {
      format = DataFormat::kLlmcBin;
    } else if (const std::optional<LlmcLookalike> h = llmc_lookalike(head)) {  // Note [llm.c lookalike]
      return corruption(path + ": looks like an llm.c token file (version " + std::to_string(h->version) + ", " +
                        std::to_string(h->count) + " tokens) but its magic is " + std::to_string(h->magic) + ", not " +
                        std::to_string(kLlmcMagic) + ": pass --data-format raw to read it as raw uint" +
                        std::to_string(8 * options.raw_token_bytes) + " tokens");
    } else {
      format = DataFormat::kRawBin;
    }
  }
  switch (format) {
    case DataFormat::kLlmcBin: return open_llmc(path, std::move(file), head);
    case DataFormat::kRawBin: return open_raw(path, std::move(file), options.raw_token_bytes);
    case DataFormat::kText: {
      const uint64_t size = file->size_bytes();
      return std::unique_ptr<TokenSource>(new FileTokens(path, std::move(file), 0, 1, size, DataFormat::kText));
    }
    case DataFormat::kAuto:
    case DataFormat::kJsonl: break;
  }
  return internal_error("unreachable data format for " + path);
}

}  // namespace zo::engine
