// Writing the streamed files (stream_file.h): the slot writer under StreamWriter and RangeWriter,
// preallocated files, staging sizes, and publishing a finished directory.
#include "engine/ckpt/stream_file.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <filesystem>
#include <limits>
#include <optional>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "common/check.h"
#include "common/crc32c.h"
#include "common/log.h"
#include "io/env.h"
#include "io/file.h"

namespace zo::engine {

// Note [Streaming writes]
// A checkpoint or export file is written front to back exactly once. The staging buffer is cut
// into slots; the caller fills the current slot (often by reading a swap file straight into it
// with O_DIRECT) while the earlier slots are being written by the I/O engine, so reading the next
// bytes and writing the last ones overlap. A full slot is submitted at once as one request (the
// engine splits it into block_size pieces and keeps queue_depth of them in flight). The last,
// partial slot is written rounded up to 4 KiB (O_DIRECT needs whole blocks) and the file is then
// truncated to its exact size before fdatasync, which also makes the size durable. CRC-32C is kept
// per kChecksumChunkBytes of file bytes, independent of the slot size, so a reader with any buffer
// size can verify the file.
//
// A RangeWriter (Note [Writing one file from many writers] in the header) runs the same machinery
// over a window of the file: slot i always holds file offsets congruent to i · slot_bytes modulo
// n_slots · slot_bytes, counted from the 4 KiB block holding begin_bytes, so every slot starts at a
// 4096-aligned file offset and the first slot simply starts `begin_bytes % 4096` bytes in. Each slot
// written is clipped to [range_begin, range_end) and cut at direct_begin/direct_end: the part
// between them (whole blocks) goes to the O_DIRECT descriptor, the head and tail parts to the
// buffered one, all under one ticket. A StreamWriter is the case range_begin = direct_begin = 0 and
// direct_end = range_end = ∞. Its CRCs are kept per intersection with a chunk (a whole chunk for a
// StreamWriter), cut where the file offset crosses a multiple of kChecksumChunkBytes.

namespace detail {

struct SlotWriter {
  io::IoEngine* io = nullptr;
  io::File file;       // O_DIRECT where the file system allows it
  io::File edge_file;  // buffered; open only for a RangeWriter
  std::string path;
  std::span<std::byte> staging;
  uint32_t n_slots = 0;
  uint64_t slot_bytes = 0;
  uint64_t range_begin = 0;  // file offsets this writer may write: [range_begin, range_end)
  uint64_t range_end = std::numeric_limits<uint64_t>::max();
  uint64_t direct_begin = 0;  // of which these go to `file`, the rest to `edge_file`
  uint64_t direct_end = std::numeric_limits<uint64_t>::max();
  std::vector<std::optional<io::Ticket>> tickets;  // per slot: a write in flight
  uint32_t cur = 0;                                // the slot being filled
  uint64_t fill = 0;        // bytes of it filled (for a RangeWriter's first slot, from the block start)
  uint64_t position = 0;    // file offset of the next byte to commit
  uint64_t span_bytes = 0;  // size of the span next_span() last returned (0: none outstanding)
  uint32_t res_slot = 0;    // where the next reservation starts (ahead of cur/fill while reserved)
  uint64_t res_fill = 0;
  std::deque<uint64_t> reservations;
  std::vector<uint32_t> crcs;  // per chunk (piece of a chunk) completed
  uint32_t chunk_crc = 0;
  uint64_t chunk_fill = 0;  // bytes in chunk_crc
  bool done = false;

  // kInvalidArgument unless `staging` can be cut into n_slots 4096-aligned slots.
  static Status check_staging(const std::string& path, std::span<std::byte> staging, uint32_t n_slots);
  void init(io::IoEngine& engine, std::string file_path, std::span<std::byte> buffer, uint32_t slots);

  std::byte* slot(uint32_t i) const { return staging.data() + uint64_t{i} * slot_bytes; }
  Status full_range_error() const;
  Status submit_current(uint64_t write_bytes);
  Status advance(uint64_t n);  // n bytes at cur/fill are the file's next: CRC, and submit a full slot
  Status wait_slot(uint32_t i);
  Status wait_all();

  Result<std::span<std::byte>> next_span(uint64_t max_bytes);
  Status commit(uint64_t n);
  Result<std::span<std::byte>> reserve(uint64_t max_bytes);
  Status commit_reserved();
  Status append(std::span<const std::byte> bytes);
  // Submits the filled part of the current slot when `write_last` (padded with zeros to whole
  // blocks for an O_DIRECT file when `truncate_to`, the exact size set afterwards, is given), waits
  // for every write, then truncates, fdatasyncs and closes the open files; the first error wins.
  Status close_out(bool write_last, std::optional<uint64_t> truncate_to);
  void abandon();  // for a destructor: waits for the writes and closes, errors dropped
};

Status SlotWriter::check_staging(const std::string& path, std::span<std::byte> staging, uint32_t n_slots) {
  if (n_slots == 0 || staging.size() < uint64_t{n_slots} * kDirectIoAlignment ||
      staging.size() % (uint64_t{n_slots} * kDirectIoAlignment) != 0 ||
      !is_aligned(reinterpret_cast<uintptr_t>(staging.data()), kDirectIoAlignment)) {
    return invalid_argument("stream writer for " + path + ": the staging buffer (" + std::to_string(staging.size()) +
                            " bytes) must be 4096-aligned and a multiple of 4096 x " + std::to_string(n_slots) +
                            " slots");
  }
  return Status::ok();
}

void SlotWriter::init(io::IoEngine& engine, std::string file_path, std::span<std::byte> buffer, uint32_t slots) {
  io = &engine;
  path = std::move(file_path);
  staging = buffer;
  n_slots = slots;
  slot_bytes = buffer.size() / slots;
  tickets.resize(slots);
}

Status SlotWriter::wait_slot(uint32_t i) {
  if (!tickets[i]) return Status::ok();
  const io::Ticket t = *tickets[i];
  tickets[i].reset();
  return io->wait(t);
}

Status SlotWriter::wait_all() {
  Status first;
  for (uint32_t i = 0; i < n_slots; ++i) {
    Status s = wait_slot(i);
    if (first.is_ok() && !s.is_ok()) first = std::move(s);
  }
  return first;
}

Status SlotWriter::submit_current(uint64_t write_bytes) {
  const uint64_t offset = position - fill;  // the slot's first byte in the file
  const uint64_t end = offset + write_bytes;
  io::IoRequest batch[3];
  size_t n = 0;
  auto add = [&](const io::File& f, uint64_t a, uint64_t b) {
    a = std::max(a, offset);
    b = std::min(b, end);
    if (a < b) batch[n++] = io::write_request(f, a, slot(cur) + (a - offset), b - a);
  };
  add(edge_file, range_begin, direct_begin);
  add(file, direct_begin, direct_end);
  add(edge_file, direct_end, range_end);
  if (n > 0) {
    ZO_ASSIGN_OR_RETURN(io::Ticket t, io->submit(std::span<const io::IoRequest>(batch, n)));
    tickets[cur] = t;
  }
  cur = (cur + 1) % n_slots;
  fill = 0;
  return Status::ok();
}

Status SlotWriter::full_range_error() const {
  return invalid_argument(path + ": the range [" + std::to_string(range_begin) + ", " + std::to_string(range_end) +
                          ") is full; nothing more may be written to it");
}

Result<std::span<std::byte>> SlotWriter::next_span(uint64_t max_bytes) {
  ZO_CHECK(!done && reservations.empty()) << path << ": next_span after finish or with reservations outstanding";
  ZO_CHECK(max_bytes > 0) << path;
  if (position == range_end) return full_range_error();
  if (fill == 0) {
    // Reusing this slot: its previous write must be complete.
    Status s = wait_slot(cur);
    if (!s.is_ok()) return s;
  }
  span_bytes = std::min({max_bytes, slot_bytes - fill, range_end - position});
  return std::span<std::byte>(slot(cur) + fill, span_bytes);
}

Status SlotWriter::advance(uint64_t n) {
  const std::byte* p = slot(cur) + fill;
  const uint64_t chunk_bytes = kChecksumChunkBytes;
  uint64_t at = position;
  for (uint64_t left = n; left > 0;) {
    const uint64_t k = std::min(left, chunk_bytes - at % chunk_bytes);
    chunk_crc = crc32c_extend(chunk_crc, p, k);
    chunk_fill += k;
    p += k;
    at += k;
    left -= k;
    if (at % chunk_bytes == 0) {
      crcs.push_back(chunk_crc);
      chunk_crc = 0;
      chunk_fill = 0;
    }
  }
  fill += n;
  position += n;
  if (fill == slot_bytes) return submit_current(slot_bytes);
  return Status::ok();
}

Status SlotWriter::commit(uint64_t n) {
  ZO_CHECK_LE(n, span_bytes) << path << ": commit beyond the span handed out";
  span_bytes = 0;
  Status s = advance(n);
  res_slot = cur;
  res_fill = fill;
  return s;
}

Result<std::span<std::byte>> SlotWriter::reserve(uint64_t max_bytes) {
  ZO_CHECK(!done && span_bytes == 0) << path << ": reserve after finish or with a span outstanding";
  ZO_CHECK(max_bytes > 0) << path;
  ZO_CHECK_LT(reservations.size(), size_t{n_slots - 1}) << path << ": more reservations than slots";
  uint64_t reserved_bytes = 0;
  for (uint64_t r : reservations) reserved_bytes += r;
  if (position + reserved_bytes == range_end) return full_range_error();
  if (res_fill == slot_bytes) {
    res_slot = (res_slot + 1) % n_slots;
    res_fill = 0;
  }
  if (res_fill == 0) {
    Status s = wait_slot(res_slot);
    if (!s.is_ok()) return s;
  }
  const uint64_t n = std::min({max_bytes, slot_bytes - res_fill, range_end - position - reserved_bytes});
  std::span<std::byte> span(slot(res_slot) + res_fill, n);
  res_fill += n;
  reservations.push_back(n);
  return span;
}

Status SlotWriter::commit_reserved() {
  ZO_CHECK(!reservations.empty()) << path << ": nothing reserved";
  const uint64_t n = reservations.front();
  reservations.pop_front();
  return advance(n);
}

Status SlotWriter::append(std::span<const std::byte> bytes) {
  while (!bytes.empty()) {
    ZO_ASSIGN_OR_RETURN(std::span<std::byte> span, next_span(bytes.size()));
    std::memcpy(span.data(), bytes.data(), span.size());
    ZO_RETURN_IF_ERROR(commit(span.size()));
    bytes = bytes.subspan(span.size());
  }
  return Status::ok();
}

Status SlotWriter::close_out(bool write_last, std::optional<uint64_t> truncate_to) {
  ZO_CHECK(!done && reservations.empty()) << path << ": finish twice or with reservations outstanding";
  done = true;
  Status s;
  if (write_last && fill > 0) {
    uint64_t write_bytes = fill;
    if (truncate_to && file.direct()) {
      write_bytes = align_up(fill, kDirectIoAlignment);
      std::memset(slot(cur) + fill, 0, write_bytes - fill);
    }
    s = submit_current(write_bytes);
  }
  Status waited = wait_all();
  if (s.is_ok()) s = std::move(waited);
  if (s.is_ok() && truncate_to) s = file.truncate(*truncate_to);
  if (s.is_ok()) s = file.sync();
  if (s.is_ok() && edge_file.is_open()) s = edge_file.sync();
  Status closed = file.close();
  if (s.is_ok()) s = std::move(closed);
  closed = edge_file.close();
  if (s.is_ok()) s = std::move(closed);
  if (s.is_ok() && chunk_fill > 0) crcs.push_back(chunk_crc);
  return s;
}

void SlotWriter::abandon() {
  if (done) return;
  (void)wait_all();
  (void)file.close();
  (void)edge_file.close();
}

}  // namespace detail

StreamWriter::StreamWriter(std::unique_ptr<detail::SlotWriter> impl) : impl_(std::move(impl)) {}

StreamWriter::~StreamWriter() {
  if (impl_) impl_->abandon();
}

Result<std::unique_ptr<StreamWriter>> StreamWriter::create(io::IoEngine& io, const std::string& path,
                                                           std::span<std::byte> staging, io::Env* env,
                                                           uint32_t n_slots) {
  ZO_RETURN_IF_ERROR(detail::SlotWriter::check_staging(path, staging, n_slots));
  ZO_ASSIGN_OR_RETURN(const io::PathKind kind, env->path_kind(path));
  if (kind != io::PathKind::kMissing) return Status(StatusCode::kAlreadyExists, path + " already exists");
  auto impl = std::make_unique<detail::SlotWriter>();
  ZO_ASSIGN_OR_RETURN(impl->file, env->open_file(path, io::OpenMode::kCreate, /*direct=*/true));
  impl->init(io, path, staging, n_slots);
  return std::unique_ptr<StreamWriter>(new StreamWriter(std::move(impl)));
}

Result<std::span<std::byte>> StreamWriter::next_span(uint64_t max_bytes) { return impl_->next_span(max_bytes); }
Status StreamWriter::commit(uint64_t n) { return impl_->commit(n); }
Result<std::span<std::byte>> StreamWriter::reserve(uint64_t max_bytes) { return impl_->reserve(max_bytes); }
Status StreamWriter::commit_reserved() { return impl_->commit_reserved(); }
size_t StreamWriter::reserved() const { return impl_->reservations.size(); }
Status StreamWriter::append(std::span<const std::byte> bytes) { return impl_->append(bytes); }
uint64_t StreamWriter::position() const { return impl_->position; }

Result<FileDigest> StreamWriter::finish() {
  detail::SlotWriter& w = *impl_;
  ZO_RETURN_IF_ERROR(w.close_out(/*write_last=*/true, w.position));
  FileDigest digest;
  const size_t slash = w.path.find_last_of('/');
  digest.name = slash == std::string::npos ? w.path : w.path.substr(slash + 1);
  digest.size_bytes = w.position;
  digest.chunk_crc32c = std::move(w.crcs);
  return digest;
}

Status create_sized_file(const std::string& path, uint64_t size_bytes, io::Env* env) {
  ZO_ASSIGN_OR_RETURN(io::File file, env->open_file(path, io::OpenMode::kCreateNew, /*direct=*/false));
  Status s = file.truncate(size_bytes);
  if (s.is_ok()) s = file.sync();
  Status closed = file.close();
  return s.is_ok() ? closed : s;
}

RangeWriter::RangeWriter(std::unique_ptr<detail::SlotWriter> impl) : impl_(std::move(impl)) {}

RangeWriter::~RangeWriter() {
  if (impl_) impl_->abandon();
}

Result<std::unique_ptr<RangeWriter>> RangeWriter::create(io::IoEngine& io, const std::string& path,
                                                         uint64_t begin_bytes, uint64_t end_bytes,
                                                         std::span<std::byte> staging, io::Env* env, uint32_t n_slots) {
  ZO_RETURN_IF_ERROR(detail::SlotWriter::check_staging(path, staging, n_slots));
  const std::string range = "[" + std::to_string(begin_bytes) + ", " + std::to_string(end_bytes) + ")";
  if (begin_bytes > end_bytes)
    return invalid_argument("range writer for " + path + ": the range " + range + " is reversed");
  auto impl = std::make_unique<detail::SlotWriter>();
  ZO_ASSIGN_OR_RETURN(impl->file, env->open_file(path, io::OpenMode::kReadWrite, /*direct=*/true));
  ZO_ASSIGN_OR_RETURN(const uint64_t size, impl->file.size_bytes());
  if (size < end_bytes) {
    return invalid_argument("range writer for " + path + ": the range " + range + " ends past the file's " +
                            std::to_string(size) + " bytes");
  }
  ZO_ASSIGN_OR_RETURN(impl->edge_file, env->open_file(path, io::OpenMode::kReadWrite, /*direct=*/false));
  impl->init(io, path, staging, n_slots);
  impl->range_begin = begin_bytes;
  impl->range_end = end_bytes;
  impl->direct_begin = align_up(begin_bytes, kDirectIoAlignment);
  impl->direct_end = end_bytes / kDirectIoAlignment * kDirectIoAlignment;
  if (impl->direct_begin >= impl->direct_end) impl->direct_begin = impl->direct_end = end_bytes;  // no whole block
  impl->position = begin_bytes;
  impl->fill = impl->res_fill = begin_bytes % kDirectIoAlignment;
  return std::unique_ptr<RangeWriter>(new RangeWriter(std::move(impl)));
}

Result<std::span<std::byte>> RangeWriter::next_span(uint64_t max_bytes) { return impl_->next_span(max_bytes); }
Status RangeWriter::commit(uint64_t n) { return impl_->commit(n); }
Result<std::span<std::byte>> RangeWriter::reserve(uint64_t max_bytes) { return impl_->reserve(max_bytes); }
Status RangeWriter::commit_reserved() { return impl_->commit_reserved(); }
size_t RangeWriter::reserved() const { return impl_->reservations.size(); }
Status RangeWriter::append(std::span<const std::byte> bytes) { return impl_->append(bytes); }
uint64_t RangeWriter::position() const { return impl_->position - impl_->range_begin; }

Result<RangeDigest> RangeWriter::finish() {
  detail::SlotWriter& w = *impl_;
  const bool complete = w.position == w.range_end;
  // The last slot's direct part ends at direct_end, a block boundary, only when the range is complete.
  Status s = w.close_out(/*write_last=*/complete, std::nullopt);
  if (!complete) {
    return invalid_argument(w.path + ": " + std::to_string(w.position - w.range_begin) +
                            " bytes committed to the range [" + std::to_string(w.range_begin) + ", " +
                            std::to_string(w.range_end) + "), which holds " +
                            std::to_string(w.range_end - w.range_begin));
  }
  if (!s.is_ok()) return s;
  return RangeDigest{w.range_begin, w.range_end, std::move(w.crcs)};
}

Status publish_directory(io::Env* env, const std::string& tmp, const std::string& final_dir, bool* replaced) {
  bool exchanged = false;
  ZO_RETURN_IF_ERROR(env->rename_or_exchange(tmp, final_dir, &exchanged));
  if (replaced != nullptr) *replaced = exchanged;
  const std::string parent = std::filesystem::path(final_dir).lexically_normal().parent_path().string();
  ZO_RETURN_IF_ERROR(env->sync_dir(parent.empty() ? "." : parent));
  if (exchanged) {
    // What was replaced, now at the tmp name: gone for good (or, if this fails, by whoever cleans
    // the tmp names; it is no longer reachable under final_dir either way).
    Status rm = env->remove_all(tmp);
    if (!rm.is_ok())
      ZO_LOG(kWarn) << "could not remove the replaced " << final_dir << " at " << tmp << ": " << rm.to_string();
  }
  return Status::ok();
}

Status check_staging_bytes(uint64_t bytes, std::string_view what) {
  if (bytes < kMinStagingBytes || bytes % kDirectIoAlignment != 0) {
    return invalid_argument(std::string(what) +
                            ": the staging buffer must be at least 1 MiB and a multiple of 4096 bytes, not " +
                            std::to_string(bytes));
  }
  return Status::ok();
}

uint64_t staging_bytes_for(uint64_t configured, uint64_t file_bytes) {
  constexpr uint64_t kUnit = 4 * kDirectIoAlignment;
  return std::min(configured, std::max(kMinStagingBytes, align_up(file_bytes, kUnit))) / kUnit * kUnit;
}

// Note [Reading a stream]: the mirror of StreamWriter. kReadSlots slots of the staging buffer are
// read ahead of the consumer, so the disk is busy while the previous slot is checked and consumed.
// read_stream reads and checks the whole file; read_stream_range only the chunks [read_begin,
// read_end) that its range touches. Both hand `consume` the bytes in [from_bytes, until_bytes).
}  // namespace zo::engine
