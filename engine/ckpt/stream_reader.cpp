// Reading and verifying the streamed files (stream_file.h): the CRC-32C of each chunk checked as
// the bytes arrive (ChunkVerifier), per-range digests combined into a file's, and reads of a whole
// file or a range through the I/O engine.
#include "engine/ckpt/stream_file.h"

#include <algorithm>
#include <optional>
#include <sstream>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "common/check.h"
#include "common/crc32c.h"
#include "io/env.h"
#include "io/file.h"

namespace zo::engine {

namespace {

// The number of kChecksumChunkBytes chunks that [begin, end) intersects.
uint64_t chunks_intersecting(uint64_t begin, uint64_t end) {
  if (begin >= end) return 0;
  return (end - 1) / kChecksumChunkBytes - begin / kChecksumChunkBytes + 1;
}

}  // namespace

Result<FileDigest> combine_range_digests(std::string name, uint64_t size_bytes, std::span<const RangeDigest> ranges) {
  FileDigest digest;
  digest.name = std::move(name);
  digest.size_bytes = size_bytes;
  const std::string what = "combining the range digests of " + digest.name;
  auto range_name = [](size_t i, const RangeDigest& r) {
    return "range " + std::to_string(i) + " [" + std::to_string(r.begin_bytes) + ", " + std::to_string(r.end_bytes) +
           ")";
  };
  uint64_t covered = 0;  // [0, covered) is tiled so far
  uint32_t chunk_crc = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const RangeDigest& r = ranges[i];
    if (r.begin_bytes > r.end_bytes) return invalid_argument(what + ": " + range_name(i, r) + " is reversed");
    if (r.begin_bytes > covered) {
      return invalid_argument(what + ": a gap [" + std::to_string(covered) + ", " + std::to_string(r.begin_bytes) +
                              ") before " + range_name(i, r));
    }
    if (r.begin_bytes < covered) {
      return invalid_argument(what + ": " + range_name(i, r) + " overlaps [" + std::to_string(r.begin_bytes) + ", " +
                              std::to_string(covered) + ") of the ranges before it");
    }
    if (r.end_bytes > size_bytes) {
      return invalid_argument(what + ": " + range_name(i, r) + " ends past the file's " + std::to_string(size_bytes) +
                              " bytes");
    }
    if (r.piece_crc32c.size() != chunks_intersecting(r.begin_bytes, r.end_bytes)) {
      return invalid_argument(what + ": " + range_name(i, r) + " has " + std::to_string(r.piece_crc32c.size()) +
                              " piece checksums, not one per chunk it intersects (" +
                              std::to_string(chunks_intersecting(r.begin_bytes, r.end_bytes)) + ")");
    }
    uint64_t at = r.begin_bytes;
    for (uint32_t piece : r.piece_crc32c) {
      const uint64_t piece_end = std::min(r.end_bytes, (at / kChecksumChunkBytes + 1) * kChecksumChunkBytes);
      chunk_crc = crc32c_combine(chunk_crc, piece, piece_end - at);
      at = piece_end;
      if (at % kChecksumChunkBytes == 0 || at == size_bytes) {
        digest.chunk_crc32c.push_back(chunk_crc);
        chunk_crc = 0;
      }
    }
    covered = r.end_bytes;
  }
  if (covered != size_bytes) {
    return invalid_argument(what + ": a gap [" + std::to_string(covered) + ", " + std::to_string(size_bytes) +
                            ") after the last range");
  }
  return digest;
}

ChunkVerifier::ChunkVerifier(const FileDigest& digest, std::string path, uint64_t start_bytes)
    : digest_(digest), path_(std::move(path)), position_(start_bytes) {
  ZO_CHECK(start_bytes % digest.chunk_bytes == 0 && start_bytes <= digest.size_bytes)
      << path_ << ": verification must start at a chunk, not at byte " << start_bytes;
}

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

namespace {

Status read_checked(io::IoEngine& io, io::Env* env, const std::string& path, const FileDigest& digest,
                    std::span<std::byte> staging, uint64_t read_begin, uint64_t read_end, uint64_t from_bytes,
                    uint64_t until_bytes, const std::function<Status(uint64_t, std::span<const std::byte>)>& consume,
                    const std::function<void(uint64_t)>& on_bytes) {
  ZO_ASSIGN_OR_RETURN(io::File file, env->open_file(path, io::OpenMode::kRead, /*direct=*/true));
  ChunkVerifier verifier(digest, path, read_begin);
  const uint64_t size = digest.size_bytes;
  // read_begin is a chunk start, so 4096-aligned; read_end a chunk end (aligned) or the file's end.
  const uint64_t body = file.direct() ? read_end - read_end % kDirectIoAlignment : read_end;
  const uint64_t slot_bytes = staging.size() / kReadSlots / kDirectIoAlignment * kDirectIoAlignment;
  std::vector<std::optional<io::Ticket>> tickets(kReadSlots);
  std::vector<uint64_t> slot_len(kReadSlots, 0);
  auto slot = [&](uint32_t i) { return staging.data() + uint64_t{i} * slot_bytes; };
  uint64_t next_read = read_begin;
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
    const uint64_t lo = std::max(offset, from_bytes);
    const uint64_t hi = std::min(offset + bytes.size(), until_bytes);
    if (lo < hi) ZO_RETURN_IF_ERROR(consume(lo, bytes.subspan(lo - offset, hi - lo)));
    if (on_bytes) on_bytes(bytes.size());
    return Status::ok();
  };
  uint64_t offset = read_begin;
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
  if (s.is_ok() && body < read_end) {
    // The tail (less than one 4 KiB block) through the Env: a direct read past the end is short.
    ZO_ASSIGN_OR_RETURN(std::unique_ptr<io::ReadFile> tail, env->open_read(path, "checkpoint file"));
    const uint64_t n = read_end - body;
    ZO_RETURN_IF_ERROR(tail->read_exact(body, staging.first(n)));
    s = feed(body, {staging.data(), n});
  }
  // A read that stops before the file's end stops at a chunk boundary, where update() has checked
  // the last chunk; one that reaches it is checked for the file's size too.
  if (s.is_ok() && read_end == size) s = verifier.finish();
  return s;
}

}  // namespace

Status read_stream(io::IoEngine& io, io::Env* env, const std::string& path, const FileDigest& digest,
                   std::span<std::byte> staging, uint64_t from_bytes,
                   const std::function<Status(uint64_t, std::span<const std::byte>)>& consume,
                   const std::function<void(uint64_t)>& on_bytes) {
  return read_checked(io, env, path, digest, staging, 0, digest.size_bytes, from_bytes, digest.size_bytes, consume,
                      on_bytes);
}

Status read_stream_range(io::IoEngine& io, io::Env* env, const std::string& path, const FileDigest& digest,
                         std::span<std::byte> staging, uint64_t from_bytes, uint64_t until_bytes,
                         const std::function<Status(uint64_t, std::span<const std::byte>)>& consume,
                         const std::function<void(uint64_t)>& on_bytes) {
  if (from_bytes > until_bytes || until_bytes > digest.size_bytes) {
    return invalid_argument(path + ": cannot read bytes [" + std::to_string(from_bytes) + ", " +
                            std::to_string(until_bytes) + ") of a file of " + std::to_string(digest.size_bytes) +
                            " bytes");
  }
  if (from_bytes == until_bytes) return Status::ok();
  const uint64_t chunk = digest.chunk_bytes;
  const uint64_t read_begin = from_bytes / chunk * chunk;
  const uint64_t read_end = std::min(digest.size_bytes, (until_bytes + chunk - 1) / chunk * chunk);
  return read_checked(io, env, path, digest, staging, read_begin, read_end, from_bytes, until_bytes, consume, on_bytes);
}

}  // namespace zo::engine
