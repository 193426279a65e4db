// Streaming files of checkpoints and exports: StreamWriter writes a new file front to back through
// a caller-owned, bounded staging buffer with O_DIRECT (via io::IoEngine, asynchronously: the caller
// fills one slot while earlier slots are written) and a CRC-32C per fixed-size chunk; RangeWriter
// does the same for one byte range of a file that several writers (threads or processes) fill in
// parallel, and combine_range_digests joins their checksums; ChunkVerifier checks bytes read back
// against those CRCs; read_stream / read_stream_range read a file (or part of it) back through a
// bounded staging buffer, checked as it goes. None is thread-safe; one thread drives each (distinct
// writers may run on distinct threads). Every file is opened through an io::Env (the engine's with
// Env::open_file), so a FaultyEnv can fail any of them; small files are read whole with
// Env::read_file. The writers are in stream_writer.cpp, the readers and verifiers in
// stream_reader.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "io/env.h"
#include "io/io_engine.h"

namespace zo::engine {

// CRC-32C is kept per chunk of this many bytes of a file (the last chunk may be shorter), so a
// flipped byte is located to a chunk and a file can be verified in one sequential pass.
inline constexpr uint64_t kChecksumChunkBytes = uint64_t{16} << 20;

// What a finished file holds: its name relative to its directory, exact size and the CRC-32C of
// every kChecksumChunkBytes chunk.
struct FileDigest {
  std::string name;
  uint64_t size_bytes = 0;
  uint64_t chunk_bytes = kChecksumChunkBytes;
  std::vector<uint32_t> chunk_crc32c;
};

namespace detail {
struct SlotWriter;  // the staging slots, asynchronous writes and chunk CRCs both writers share
}  // namespace detail

class StreamWriter {
 public:
  // Creates `path` (which must not exist: kAlreadyExists) through `env` (Env::open_file) for
  // writing with O_DIRECT where the file system allows it. `staging` (4096-aligned, size a multiple
  // of 4096 × n_slots, ≥ 4096 × n_slots) is cut into n_slots slots; the writer never allocates
  // more than a few KiB itself.
  static Result<std::unique_ptr<StreamWriter>> create(io::IoEngine& io, const std::string& path,
                                                      std::span<std::byte> staging, io::Env* env, uint32_t n_slots = 4);
  ~StreamWriter();  // an unfinished writer waits for its writes and closes the file (left on disk)
  StreamWriter(const StreamWriter&) = delete;
  StreamWriter& operator=(const StreamWriter&) = delete;

  // A writable span of between 1 and max_bytes bytes in the current slot, for the caller to fill
  // and then commit(). When position() is a multiple of 4096 the span starts 4096-aligned (callers
  // read swap files into it with O_DIRECT). Blocks while every slot is being written; a failed
  // write of an earlier slot is returned here (with path, offset and errno).
  Result<std::span<std::byte>> next_span(uint64_t max_bytes);
  // The first n bytes of the span next_span() returned are the file's next bytes (n ≤ its size).
  Status commit(uint64_t n);
  // Read-ahead: up to n_slots - 1 spans may be reserved before the first is committed, so the
  // caller can have several reads into the staging slots in flight. reserve() hands out the span
  // after the last one reserved (between 1 and max_bytes bytes, within one slot; 4096-aligned when
  // it starts at a multiple of 4096 of the file), waiting for that slot's earlier write;
  // commit_reserved() commits the oldest reservation whole. Not mixed with next_span()/commit()
  // while reservations are outstanding.
  Result<std::span<std::byte>> reserve(uint64_t max_bytes);
  Status commit_reserved();
  size_t reserved() const;  // reservations outstanding
  // Copies `bytes` in (next_span + commit until done).
  Status append(std::span<const std::byte> bytes);
  uint64_t position() const;  // bytes committed so far

  // Writes the partial last slot, waits for every write, sets the exact size, fdatasyncs and
  // closes. Any error of any earlier write is returned here too. The writer is done after it.
  Result<FileDigest> finish();

 private:
  explicit StreamWriter(std::unique_ptr<detail::SlotWriter> impl);
  std::unique_ptr<detail::SlotWriter> impl_;
};

// Creates `path` (kAlreadyExists if it exists, with no change to it) holding exactly `size_bytes`
// bytes that all read as zero (ftruncate: sparse where the file system allows it), fdatasynced and
// closed: the file that RangeWriters, one per range and possibly in other processes, then fill in
// place. Opened through `env` (Env::open_file); errors name the path and errno.
Status create_sized_file(const std::string& path, uint64_t size_bytes, io::Env* env);

// What a RangeWriter wrote: its range [begin_bytes, end_bytes) of the file and the CRC-32C of each
// intersection of that range with a kChecksumChunkBytes-aligned chunk of the file, in file order
// (the first and last pieces may be parts of chunks; no pieces for an empty range).
struct RangeDigest {
  uint64_t begin_bytes = 0;
  uint64_t end_bytes = 0;
  std::vector<uint32_t> piece_crc32c;
};

// Note [Writing one file from many writers]: RangeWriter writes bytes [begin_bytes, end_bytes) of
// an existing file (made by create_sized_file) front to back, while other writers, in this or other
// processes, write other, disjoint ranges of the same file. No byte outside its range is ever
// written: the 4 KiB blocks wholly inside the range go with O_DIRECT, the partial blocks at its head
// and tail (which a neighbour shares) with buffered writes on a second, non-O_DIRECT descriptor, so
// the kernel merges both writers' bytes in the page cache. Both kinds go through `io`, so its fault
// injector sees them. The caller API is StreamWriter's; `position()` counts the bytes committed so
// far from begin_bytes (file offset = begin_bytes + position()).
class RangeWriter {
 public:
  // Opens `path` twice through `env` (Env::open_file; it must exist and hold at least end_bytes
  // bytes: kInvalidArgument otherwise; errors opening it name the path and errno) to write
  // [begin_bytes, end_bytes), begin ≤ end. `staging` as for StreamWriter::create; the writer never
  // allocates more than a few KiB itself.
  static Result<std::unique_ptr<RangeWriter>> create(io::IoEngine& io, const std::string& path, uint64_t begin_bytes,
                                                     uint64_t end_bytes, std::span<std::byte> staging, io::Env* env,
                                                     uint32_t n_slots = 4);
  ~RangeWriter();  // an unfinished writer waits for its writes and closes the file
  RangeWriter(const RangeWriter&) = delete;
  RangeWriter& operator=(const RangeWriter&) = delete;

  // As StreamWriter's, with these differences: spans never reach past end_bytes, and once the
  // range is full next_span/reserve/append return kInvalidArgument naming the path and the range;
  // a span starts 4096-aligned when its file offset (begin_bytes + position()) is a multiple of 4096.
  Result<std::span<std::byte>> next_span(uint64_t max_bytes);
  Status commit(uint64_t n);
  Result<std::span<std::byte>> reserve(uint64_t max_bytes);
  Status commit_reserved();
  size_t reserved() const;
  Status append(std::span<const std::byte> bytes);
  uint64_t position() const;  // bytes committed so far, counted from begin_bytes

  // Writes what is left, waits for every write, fdatasyncs both descriptors and closes them.
  // kInvalidArgument naming the path and range when fewer than end_bytes - begin_bytes bytes were
  // committed (then the rest of the last slot is not written); any error of any write is returned
  // here too (path, offset, errno). The file's size is never changed. The writer is done after it.
  Result<RangeDigest> finish();

 private:
  explicit RangeWriter(std::unique_ptr<detail::SlotWriter> impl);
  std::unique_ptr<detail::SlotWriter> impl_;
};

// The FileDigest (named `name`, chunk_bytes kChecksumChunkBytes) that a StreamWriter writing the
// whole file would have returned, from the digests of RangeWriters that wrote it: `ranges` must
// tile [0, size_bytes) exactly, in order (empty ranges allowed), each with one piece CRC per chunk
// it intersects; kInvalidArgument naming the gap, overlap or range otherwise. CRCs of pieces of one
// chunk are joined with crc32c_combine; no file is read.
Result<FileDigest> combine_range_digests(std::string name, uint64_t size_bytes, std::span<const RangeDigest> ranges);

// Checks a file's bytes, fed in order from offset `start_bytes` (0, or the start of any chunk:
// a multiple of digest.chunk_bytes not past the end), against its digest. kCorruption naming the
// file, the chunk and its byte range on the first mismatch; finish() also checks that the bytes fed
// reached the end of the file. `digest` must outlive the verifier.
class ChunkVerifier {
 public:
  explicit ChunkVerifier(const FileDigest& digest, std::string path, uint64_t start_bytes = 0);
  Status update(std::span<const std::byte> bytes);
  Status finish();
  uint64_t position() const { return position_; }

 private:
  const FileDigest& digest_;
  std::string path_;
  uint64_t position_ = 0;
  uint32_t crc_ = 0;  // of the current chunk so far
};

// Reads `path` front to back through `staging` (4096-aligned, a multiple of 4096 × kReadSlots;
// Note [Reading a stream] in the .cpp): every byte is checked against `digest` and the bytes at and
// after `from_bytes` are handed to `consume(file_offset, bytes)` in order; `on_bytes` (may be empty)
// hears how many bytes each slot held. The file is opened through `env`; whole 4 KiB blocks are
// read with O_DIRECT through `io`, the tail through `env`. Errors name the file and offset;
// kCorruption for a checksum mismatch or a file shorter than the digest; consume's own error stops
// the read and is returned.
inline constexpr uint32_t kReadSlots = 4;
Status read_stream(io::IoEngine& io, io::Env* env, const std::string& path, const FileDigest& digest,
                   std::span<std::byte> staging, uint64_t from_bytes,
                   const std::function<Status(uint64_t, std::span<const std::byte>)>& consume,
                   const std::function<void(uint64_t)>& on_bytes = {});
// Reads only part of `path`: the chunks of `digest` that intersect [from_bytes, until_bytes)
// (whole chunks, from the start of the first to the end of the last, or the file's end), checks
// each of them against `digest`, and hands `consume` exactly the bytes in [from_bytes, until_bytes),
// in order. Nothing is read for an empty range. kInvalidArgument unless from ≤ until ≤ the digest's
// size; otherwise as read_stream (kCorruption names the chunk; chunks outside are not read).
Status read_stream_range(io::IoEngine& io, io::Env* env, const std::string& path, const FileDigest& digest,
                         std::span<std::byte> staging, uint64_t from_bytes, uint64_t until_bytes,
                         const std::function<Status(uint64_t, std::span<const std::byte>)>& consume,
                         const std::function<void(uint64_t)>& on_bytes = {});

// Note [Publishing a directory]: checkpoints and exports are written into a temporary sibling of
// their final directory, every file fdatasynced and the sibling itself fsynced by the writer, and
// then published whole by this one step: renamed into place (or, when `final_dir` exists and is
// not empty, swapped with it by renameat2(RENAME_EXCHANGE), so a reader never sees it missing or
// partial), the parent fsynced, and what the swap displaced removed. *replaced says whether it
// replaced something. An error before the rename leaves `final_dir` as it was and `tmp` for the
// caller to remove; an error after it (the parent's fsync) leaves the new contents in place but
// not yet durable, and is returned all the same.
Status publish_directory(io::Env* env, const std::string& tmp, const std::string& final_dir, bool* replaced = nullptr);

// The staging buffers checkpoints and exports stream through: at least this many bytes, and a
// multiple of 4096 (O_DIRECT).
inline constexpr uint64_t kMinStagingBytes = uint64_t{1} << 20;
// kInvalidArgument "<what>: the staging buffer must be at least 1 MiB and a multiple of 4096
// bytes, not N" unless `bytes` is such a size.
Status check_staging_bytes(uint64_t bytes, std::string_view what);
// The staging to allocate for streaming files of at most `file_bytes`: `configured`, or less when
// such a file needs less (a small model saves and loads with a few MiB), never below
// kMinStagingBytes, in whole units of 4 slots of 4096 bytes.
uint64_t staging_bytes_for(uint64_t configured, uint64_t file_bytes);

// The size cap for reading a small file of a checkpoint or an export whole (manifest, trainer
// state, config, a tokenizer file) with Env::read_file.
inline constexpr uint64_t kMaxSmallFileBytes = uint64_t{64} << 20;

}  // namespace zo::engine
