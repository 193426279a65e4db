#include "engine/ckpt/stream_file.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <filesystem>
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

struct StreamWriter::Impl {
  io::IoEngine* io = nullptr;
  io::File file;
  std::string path;
  std::span<std::byte> staging;
  uint32_t n_slots = 0;
  uint64_t slot_bytes = 0;
  std::vector<std::optional<io::Ticket>> tickets;  // per slot: a write in flight
  uint32_t cur = 0;          // the slot being filled
  uint64_t fill = 0;         // bytes of it filled
  uint64_t position = 0;     // bytes committed
  uint64_t span_bytes = 0;   // size of the span next_span() last returned (0: none outstanding)
  uint32_t res_slot = 0;     // where the next reservation starts (ahead of cur/fill while reserved)
  uint64_t res_fill = 0;
  std::deque<uint64_t> reservations;
  FileDigest digest;
  uint32_t chunk_crc = 0;
  uint64_t chunk_fill = 0;
  bool done = false;

  std::byte* slot(uint32_t i) const { return staging.data() + uint64_t{i} * slot_bytes; }
  Status submit_current(uint64_t write_bytes);
  Status advance(uint64_t n);  // n bytes at cur/fill are the file's next: CRC, and submit a full slot
  Status wait_slot(uint32_t i);
  Status wait_all();
};

Status StreamWriter::Impl::wait_slot(uint32_t i) {
  if (!tickets[i]) return Status::ok();
  const io::Ticket t = *tickets[i];
  tickets[i].reset();
  return io->wait(t);
}

Status StreamWriter::Impl::wait_all() {
  Status first;
  for (uint32_t i = 0; i < n_slots; ++i) {
    Status s = wait_slot(i);
    if (first.is_ok() && !s.is_ok()) first = std::move(s);
  }
  return first;
}

Status StreamWriter::Impl::submit_current(uint64_t write_bytes) {
  const uint64_t offset = position - fill;
  ZO_ASSIGN_OR_RETURN(io::Ticket t, io->submit(io::write_request(file, offset, slot(cur), write_bytes)));
  tickets[cur] = t;
  cur = (cur + 1) % n_slots;
  fill = 0;
  return Status::ok();
}

StreamWriter::StreamWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

StreamWriter::~StreamWriter() {
  if (impl_ && !impl_->done) {
    (void)impl_->wait_all();
    (void)impl_->file.close();
  }
}

Result<std::unique_ptr<StreamWriter>> StreamWriter::create(io::IoEngine& io, const std::string& path,
                                                           std::span<std::byte> staging, uint32_t n_slots,
                                                           io::Env& env) {
  if (n_slots == 0 || staging.size() < uint64_t{n_slots} * kDirectIoAlignment ||
      staging.size() % (uint64_t{n_slots} * kDirectIoAlignment) != 0 ||
      !is_aligned(reinterpret_cast<uintptr_t>(staging.data()), kDirectIoAlignment)) {
    return invalid_argument("stream writer for " + path + ": the staging buffer (" + std::to_string(staging.size()) +
                            " bytes) must be 4096-aligned and a multiple of 4096 x " + std::to_string(n_slots) +
                            " slots");
  }
  ZO_ASSIGN_OR_RETURN(const io::PathKind kind, env.path_kind(path));
  if (kind != io::PathKind::kMissing) return Status(StatusCode::kAlreadyExists, path + " already exists");
  auto impl = std::make_unique<Impl>();
  ZO_ASSIGN_OR_RETURN(impl->file, io::File::open(path, io::OpenMode::kCreate, /*direct=*/true));
  impl->io = &io;
  impl->path = path;
  impl->staging = staging;
  impl->n_slots = n_slots;
  impl->slot_bytes = staging.size() / n_slots;
  impl->tickets.resize(n_slots);
  const size_t slash = path.find_last_of('/');
  impl->digest.name = slash == std::string::npos ? path : path.substr(slash + 1);
  return std::unique_ptr<StreamWriter>(new StreamWriter(std::move(impl)));
}

Result<std::span<std::byte>> StreamWriter::next_span(uint64_t max_bytes) {
  Impl& w = *impl_;
  ZO_CHECK(!w.done && w.reservations.empty()) << w.path << ": next_span after finish or with reservations outstanding";
  ZO_CHECK(max_bytes > 0) << w.path;
  if (w.fill == 0) {
    // Reusing this slot: its previous write must be complete.
    Status s = w.wait_slot(w.cur);
    if (!s.is_ok()) return s;
  }
  w.span_bytes = std::min(max_bytes, w.slot_bytes - w.fill);
  return std::span<std::byte>(w.slot(w.cur) + w.fill, w.span_bytes);
}

Status StreamWriter::Impl::advance(uint64_t n) {
  const std::byte* p = slot(cur) + fill;
  for (uint64_t left = n; left > 0;) {
    const uint64_t k = std::min(left, digest.chunk_bytes - chunk_fill);
    chunk_crc = crc32c_extend(chunk_crc, p, k);
    chunk_fill += k;
    p += k;
    left -= k;
    if (chunk_fill == digest.chunk_bytes) {
      digest.chunk_crc32c.push_back(chunk_crc);
      chunk_crc = 0;
      chunk_fill = 0;
    }
  }
  fill += n;
  position += n;
  if (fill == slot_bytes) return submit_current(slot_bytes);
  return Status::ok();
}

Status StreamWriter::commit(uint64_t n) {
  Impl& w = *impl_;
  ZO_CHECK_LE(n, w.span_bytes) << w.path << ": commit beyond the span handed out";
  w.span_bytes = 0;
  Status s = w.advance(n);
  w.res_slot = w.cur;
  w.res_fill = w.fill;
  return s;
}

Result<std::span<std::byte>> StreamWriter::reserve(uint64_t max_bytes) {
  Impl& w = *impl_;
  ZO_CHECK(!w.done && w.span_bytes == 0) << w.path << ": reserve after finish or with a span outstanding";
  ZO_CHECK(max_bytes > 0) << w.path;
  ZO_CHECK_LT(w.reservations.size(), size_t{w.n_slots - 1}) << w.path << ": more reservations than slots";
  if (w.res_fill == w.slot_bytes) {
    w.res_slot = (w.res_slot + 1) % w.n_slots;
    w.res_fill = 0;
  }
  if (w.res_fill == 0) {
    Status s = w.wait_slot(w.res_slot);
    if (!s.is_ok()) return s;
  }
  const uint64_t n = std::min(max_bytes, w.slot_bytes - w.res_fill);
  std::span<std::byte> span(w.slot(w.res_slot) + w.res_fill, n);
  w.res_fill += n;
  w.reservations.push_back(n);
  return span;
}

Status StreamWriter::commit_reserved() {
  Impl& w = *impl_;
  ZO_CHECK(!w.reservations.empty()) << w.path << ": nothing reserved";
  const uint64_t n = w.reservations.front();
  w.reservations.pop_front();
  return w.advance(n);
}

size_t StreamWriter::reserved() const { return impl_->reservations.size(); }

Status StreamWriter::append(std::span<const std::byte> bytes) {
  while (!bytes.empty()) {
    ZO_ASSIGN_OR_RETURN(std::span<std::byte> span, next_span(bytes.size()));
    std::memcpy(span.data(), bytes.data(), span.size());
    ZO_RETURN_IF_ERROR(commit(span.size()));
    bytes = bytes.subspan(span.size());
  }
  return Status::ok();
}

uint64_t StreamWriter::position() const { return impl_->position; }

Result<FileDigest> StreamWriter::finish() {
  Impl& w = *impl_;
  ZO_CHECK(!w.done && w.reservations.empty()) << w.path << ": finish twice or with reservations outstanding";
  w.done = true;
  Status s;
  if (w.fill > 0) {
    const uint64_t padded = align_up(w.fill, kDirectIoAlignment);
    std::memset(w.slot(w.cur) + w.fill, 0, padded - w.fill);
    s = w.submit_current(w.file.direct() ? padded : w.fill);
  }
  Status waited = w.wait_all();
  if (s.is_ok()) s = std::move(waited);
  if (s.is_ok()) s = w.file.truncate(w.position);
  if (s.is_ok()) s = w.file.sync();
  Status closed = w.file.close();
  if (s.is_ok()) s = std::move(closed);
  if (!s.is_ok()) return s;
  if (w.chunk_fill > 0) w.digest.chunk_crc32c.push_back(w.chunk_crc);
  w.digest.size_bytes = w.position;
  return w.digest;
}

ChunkVerifier::ChunkVerifier(const FileDigest& digest, std::string path) : digest_(digest), path_(std::move(path)) {}

Status ChunkVerifier::update(std::span<const std::byte> bytes) {
  const std::byte* p = bytes.data();
  uint64_t left = bytes.size();
  if (position_ + left > digest_.size_bytes) {
    return corruption(path_ + ": more than the manifest's " + std::to_string(digest_.size_bytes) + " bytes");
  }
  while (left > 0) {
    const uint64_t in_chunk = position_ % digest_.chunk_bytes;
    const uint64_t k = std::min(left, digest_.chunk_bytes - in_chunk);
    crc_ = crc32c_extend(crc_, p, k);
    position_ += k;
    p += k;
    left -= k;
    if (position_ % digest_.chunk_bytes == 0 || position_ == digest_.size_bytes) {
      const uint64_t chunk = (position_ - 1) / digest_.chunk_bytes;
      if (chunk >= digest_.chunk_crc32c.size() || digest_.chunk_crc32c[chunk] != crc_) {
        std::ostringstream msg;
        msg << path_ << ": checksum mismatch in chunk " << chunk << " (bytes " << chunk * digest_.chunk_bytes << ".."
            << position_ << "): crc32c " << std::hex << crc_ << ", the manifest says "
            << (chunk < digest_.chunk_crc32c.size() ? digest_.chunk_crc32c[chunk] : 0u);
        return corruption(msg.str());
      }
      crc_ = 0;
    }
  }
  return Status::ok();
}

Status ChunkVerifier::finish() {
  if (position_ != digest_.size_bytes) {
    return corruption(path_ + ": " + std::to_string(position_) + " bytes read, the manifest says " +
                      std::to_string(digest_.size_bytes));
  }
  return Status::ok();
}

Status publish_directory(io::Env& env, const std::string& tmp, const std::string& final_dir, bool* replaced) {
  bool exchanged = false;
  ZO_RETURN_IF_ERROR(env.rename_or_exchange(tmp, final_dir, &exchanged));
  if (replaced != nullptr) *replaced = exchanged;
  const std::string parent = std::filesystem::path(final_dir).lexically_normal().parent_path().string();
  ZO_RETURN_IF_ERROR(env.sync_dir(parent.empty() ? "." : parent));
  if (exchanged) {
    // What was replaced, now at the tmp name: gone for good (or, if this fails, by whoever cleans
    // the tmp names; it is no longer reachable under final_dir either way).
    Status rm = env.remove_all(tmp);
    if (!rm.is_ok()) ZO_LOG(kWarn) << "could not remove the replaced " << final_dir << " at " << tmp << ": " << rm.to_string();
  }
  return Status::ok();
}

Status check_staging_bytes(uint64_t bytes, std::string_view what) {
  if (bytes < kMinStagingBytes || bytes % kDirectIoAlignment != 0) {
    return invalid_argument(std::string(what) + ": the staging buffer must be at least 1 MiB and a multiple of 4096 bytes, not " +
                            std::to_string(bytes));
  }
  return Status::ok();
}

uint64_t staging_bytes_for(uint64_t configured, uint64_t file_bytes) {
  constexpr uint64_t kUnit = 4 * kDirectIoAlignment;
  return std::min(configured, std::max(kMinStagingBytes, align_up(file_bytes, kUnit))) / kUnit * kUnit;
}

Result<std::string> read_small_file(io::Env& env, const std::string& path) {
  ZO_ASSIGN_OR_RETURN(std::unique_ptr<io::ReadFile> file, env.open_read(path, "file"));
  const uint64_t size = file->size_bytes();
  if (size > kMaxSmallFileBytes) return corruption(path + ": " + std::to_string(size) + " bytes is too large");
  std::string text(size, '\0');
  ZO_RETURN_IF_ERROR(file->read_exact(0, std::as_writable_bytes(std::span(text))));
  return text;
}

// Note [Reading a stream]: the mirror of StreamWriter. kReadSlots slots of the staging buffer are
// read ahead of the consumer, so the disk is busy while the previous slot is checked and consumed.
Status read_stream(io::IoEngine& io, io::Env& env, const std::string& path, const FileDigest& digest,
                   std::span<std::byte> staging, uint64_t from_bytes,
                   const std::function<Status(uint64_t, std::span<const std::byte>)>& consume,
                   const std::function<void(uint64_t)>& on_bytes) {
  ZO_ASSIGN_OR_RETURN(io::File file, io::File::open(path, io::OpenMode::kRead, /*direct=*/true));
  ChunkVerifier verifier(digest, path);
  const uint64_t size = digest.size_bytes;
  const uint64_t body = file.direct() ? size - size % kDirectIoAlignment : size;
  const uint64_t slot_bytes = staging.size() / kReadSlots / kDirectIoAlignment * kDirectIoAlignment;
  std::vector<std::optional<io::Ticket>> tickets(kReadSlots);
  std::vector<uint64_t> slot_len(kReadSlots, 0);
  auto slot = [&](uint32_t i) { return staging.data() + uint64_t{i} * slot_bytes; };
  uint64_t next_read = 0;
  uint32_t next_slot = 0;
  auto issue = [&]() -> Status {
    while (next_read < body && !tickets[next_slot]) {
      const uint64_t n = std::min(slot_bytes, body - next_read);
      ZO_ASSIGN_OR_RETURN(io::Ticket t, io.submit(io::read_request(file, next_read, slot(next_slot), n)));
      tickets[next_slot] = t;
      slot_len[next_slot] = n;
      next_read += n;
      next_slot = (next_slot + 1) % kReadSlots;
    }
    return Status::ok();
  };
  auto drain = [&]() {
    for (auto& t : tickets) {
      if (t) (void)io.wait(*t);
      t.reset();
    }
  };
  auto feed = [&](uint64_t offset, std::span<const std::byte> bytes) -> Status {
    ZO_RETURN_IF_ERROR(verifier.update(bytes));
    if (offset + bytes.size() > from_bytes) {
      const uint64_t skip = offset < from_bytes ? from_bytes - offset : 0;
      ZO_RETURN_IF_ERROR(consume(offset + skip, bytes.subspan(skip)));
    }
    if (on_bytes) on_bytes(bytes.size());
    return Status::ok();
  };
  uint64_t offset = 0;
  uint32_t cur = 0;
  Status s = issue();
  while (s.is_ok() && offset < body) {
    const io::Ticket t = *tickets[cur];
    tickets[cur].reset();
    s = io.wait(t);
    if (!s.is_ok()) break;
    s = feed(offset, {slot(cur), slot_len[cur]});
    offset += slot_len[cur];
    cur = (cur + 1) % kReadSlots;
    if (s.is_ok()) s = issue();
  }
  drain();
  if (s.is_ok() && body < size) {
    // The tail (less than one 4 KiB block) through the Env: a direct read past the end is short.
    ZO_ASSIGN_OR_RETURN(std::unique_ptr<io::ReadFile> tail, env.open_read(path, "checkpoint file"));
    const uint64_t n = size - body;
    ZO_RETURN_IF_ERROR(tail->read_exact(body, staging.first(n)));
    s = feed(body, {staging.data(), n});
  }
  if (s.is_ok()) s = verifier.finish();
  return s;
}


}  // namespace zo::engine
