#include "engine/ckpt/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <random>
#include <sstream>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "common/check.h"
#include "common/crc32c.h"
#include "common/log.h"
#include "common/string_util.h"
#include "engine/model/safetensors.h"
#include "io/file.h"

namespace zo::engine {
namespace fs = std::filesystem;
using json = nlohmann::json;

// Note [Checkpoint commit protocol]
// A save writes everything into DIR/tmp-<step>-<random>: the state files (fdatasynced by their
// writers), trainer_state.json and config.json (fdatasynced), then manifest.json last (fdatasynced)
// and fsyncs the tmp directory. Only then is the directory renamed to DIR/step-<N> (one atomic
// rename) and DIR fsynced; DIR/latest is replaced by writing DIR/latest.tmp-<random>, fdatasync,
// rename over DIR/latest, fsync DIR. Old checkpoints are pruned last, each by an atomic rename to
// DIR/tmp-pruned-... before its files are removed, so a kill mid-prune never leaves a step-<N>
// directory with missing files. A kill at any moment therefore leaves either the previous `latest`
// (pointing at a complete, renamed checkpoint) or the new one; tmp-* directories of a killed save
// are removed by clean_stale_checkpoints() at the next start. A directory without manifest.json is
// never loaded: open_checkpoint() refuses it.

namespace {

constexpr const char* kFormatName = "zoffload-checkpoint";
constexpr uint32_t kSlots = 4;

const StateKind kSavedKinds[] = {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq};

const char* file_of(StateKind kind) {
  switch (kind) {
    case StateKind::kMaster: return kMasterFile;
    case StateKind::kExpAvg: return kExpAvgFile;
    case StateKind::kExpAvgSq: return kExpAvgSqFile;
    default: break;
  }
  ZO_CHECK(false) << "no checkpoint file for state " << state_name(kind);
  return "";
}

std::string random_suffix() {
  std::random_device rd;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%08x%08x", rd(), rd());
  return buf;
}

std::string hex32(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

// Writes a small file in one go through the Env (fdatasynced; nothing left on failure) and
// returns its digest.
Result<FileDigest> write_small_file(io::Env& env, const std::string& dir, const std::string& name, const std::string& text) {
  ZO_RETURN_IF_ERROR(env.write_file(dir + "/" + name, text));
  FileDigest d;
  d.name = name;
  d.size_bytes = text.size();
  for (uint64_t off = 0; off < text.size(); off += d.chunk_bytes) {
    d.chunk_crc32c.push_back(crc32c(text.data() + off, std::min<uint64_t>(d.chunk_bytes, text.size() - off)));
  }
  return d;
}

Result<json> parse_json_text(const std::string& text, const std::string& source) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return corruption(source + ": not a JSON object");
  return j;
}

// Reads a json field of the expected kind or fails naming it.
template <typename T>
Status get(const json& j, const char* key, T* out, const std::string& source) {
  auto it = j.find(key);
  if (it == j.end()) return corruption(source + ": missing \"" + key + "\"");
  try {
    *out = it->get<T>();
  } catch (const json::exception& e) {
    return corruption(source + ": \"" + key + "\": " + e.what());
  }
  return Status::ok();
}

// Reads a file front to back through `staging` cut into slots, with reads in flight ahead of the
// consumer, feeding every byte to a ChunkVerifier and the bytes at and after `from_bytes` to
// `consume(file_offset, bytes)`. Whole 4 KiB blocks are read with O_DIRECT; the tail through a
// buffered descriptor (a direct read past the end of the file is short).
Status stream_file(io::IoEngine& io, const std::string& path, const FileDigest& digest, std::span<std::byte> staging,
                   uint64_t from_bytes, const std::function<Status(uint64_t, std::span<const std::byte>)>& consume,
                   const std::function<void(uint64_t)>& on_bytes) {
  ZO_ASSIGN_OR_RETURN(io::File file, io::File::open(path, io::OpenMode::kRead, /*direct=*/true));
  ChunkVerifier verifier(digest, path);
  const uint64_t size = digest.size_bytes;
  const uint64_t body = file.direct() ? size - size % kDirectIoAlignment : size;
  const uint64_t slot_bytes = staging.size() / kSlots / kDirectIoAlignment * kDirectIoAlignment;
  std::vector<std::optional<io::Ticket>> tickets(kSlots);
  std::vector<uint64_t> slot_len(kSlots, 0);
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
      next_slot = (next_slot + 1) % kSlots;
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
    cur = (cur + 1) % kSlots;
    if (s.is_ok()) s = issue();
  }
  drain();
  if (s.is_ok() && body < size) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno_status("opening " + path, errno);
    const uint64_t n = size - body;
    uint64_t got = 0;
    while (got < n) {  // short reads continue; EINTR retries; end of file is corruption
      const ssize_t r = ::pread(fd, staging.data() + got, n - got, static_cast<off_t>(body + got));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) {
        const int err = errno;
        ::close(fd);
        return errno_status("reading " + path + " at offset " + std::to_string(body + got), err);
      }
      if (r == 0) break;
      got += static_cast<uint64_t>(r);
    }
    ::close(fd);
    if (got != n) {
      return corruption(path + ": end of file at offset " + std::to_string(body + got) + ", " + std::to_string(n - got) +
                        " bytes before the size its manifest says");
    }
    s = feed(body, {staging.data(), n});
  }
  if (s.is_ok()) s = verifier.finish();
  return s;
}

// The tensors of a store, as a checkpoint lists them.
std::vector<CheckpointTensor> tensors_of(const ParamRegistry& registry) {
  std::vector<CheckpointTensor> out;
  for (const ParamInfo& p : registry.params()) out.push_back({p.name, p.shape, p.n_elems});
  return out;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

std::string_view save_phase_name(SavePhase phase) {
  switch (phase) {
    case SavePhase::kStarted: return "started";
    case SavePhase::kStateFileDone: return "state-file-done";
    case SavePhase::kManifestWritten: return "manifest-written";
    case SavePhase::kRenamed: return "renamed";
    case SavePhase::kLatestUpdated: return "latest-updated";
    case SavePhase::kPruned: return "pruned";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// TrainingState, Manifest

json TrainingState::to_json() const {
  return {{"steps_done", steps_done},
          {"optimizer_steps", optimizer_steps},
          {"loss_scaler",
           {{"cur_scale", loss_scaler.cur_scale},
            {"cur_iter", loss_scaler.cur_iter},
            {"last_overflow_iter", loss_scaler.last_overflow_iter},
            {"cur_hysteresis", loss_scaler.cur_hysteresis}}},
          {"data_position", {{"epoch", data_position.epoch}, {"index", data_position.index}}},
          {"seed", seed},
          {"model", model},
          {"data", data},
          {"seq_len", seq_len},
          {"config", config}};
}

Result<TrainingState> TrainingState::from_json(const json& j, const std::string& source) {
  TrainingState s;
  ZO_RETURN_IF_ERROR(get(j, "steps_done", &s.steps_done, source));
  ZO_RETURN_IF_ERROR(get(j, "optimizer_steps", &s.optimizer_steps, source));
  ZO_RETURN_IF_ERROR(get(j, "seed", &s.seed, source));
  ZO_RETURN_IF_ERROR(get(j, "model", &s.model, source));
  ZO_RETURN_IF_ERROR(get(j, "data", &s.data, source));
  ZO_RETURN_IF_ERROR(get(j, "seq_len", &s.seq_len, source));
  json scaler, data;
  ZO_RETURN_IF_ERROR(get(j, "loss_scaler", &scaler, source));
  ZO_RETURN_IF_ERROR(get(scaler, "cur_scale", &s.loss_scaler.cur_scale, source + " loss_scaler"));
  ZO_RETURN_IF_ERROR(get(scaler, "cur_iter", &s.loss_scaler.cur_iter, source + " loss_scaler"));
  ZO_RETURN_IF_ERROR(get(scaler, "last_overflow_iter", &s.loss_scaler.last_overflow_iter, source + " loss_scaler"));
  ZO_RETURN_IF_ERROR(get(scaler, "cur_hysteresis", &s.loss_scaler.cur_hysteresis, source + " loss_scaler"));
  ZO_RETURN_IF_ERROR(get(j, "data_position", &data, source));
  ZO_RETURN_IF_ERROR(get(data, "epoch", &s.data_position.epoch, source + " data_position"));
  ZO_RETURN_IF_ERROR(get(data, "index", &s.data_position.index, source + " data_position"));
  ZO_RETURN_IF_ERROR(get(j, "config", &s.config, source));
  if (s.optimizer_steps > s.steps_done) {
    return corruption(source + ": optimizer_steps " + std::to_string(s.optimizer_steps) + " > steps_done " +
                      std::to_string(s.steps_done));
  }
  return s;
}

json Manifest::to_json() const {
  json files_j = json::array();
  for (const FileDigest& f : files) {
    json crcs = json::array();
    for (uint32_t c : f.chunk_crc32c) crcs.push_back(hex32(c));
    files_j.push_back({{"name", f.name}, {"size_bytes", f.size_bytes}, {"chunk_bytes", f.chunk_bytes}, {"crc32c", crcs}});
  }
  json tensors_j = json::array();
  for (const CheckpointTensor& t : tensors) tensors_j.push_back({{"name", t.name}, {"dtype", "F32"}, {"shape", t.shape}});
  return {{"format", kFormatName}, {"format_version", format_version}, {"step", step},
          {"state_files", {kMasterFile, kExpAvgFile, kExpAvgSqFile}}, {"tensors", tensors_j}, {"files", files_j}};
}

Result<Manifest> Manifest::from_json(const json& j, const std::string& source) {
  Manifest m;
  std::string format;
  ZO_RETURN_IF_ERROR(get(j, "format", &format, source));
  if (format != kFormatName) return corruption(source + ": format \"" + format + "\" is not " + kFormatName);
  ZO_RETURN_IF_ERROR(get(j, "format_version", &m.format_version, source));
  if (m.format_version != kCheckpointFormatVersion) {
    return invalid_argument(source + ": format_version " + std::to_string(m.format_version) +
                            " is not supported (this zoffload reads version " +
                            std::to_string(kCheckpointFormatVersion) + ")");
  }
  ZO_RETURN_IF_ERROR(get(j, "step", &m.step, source));
  json files_j, tensors_j;
  ZO_RETURN_IF_ERROR(get(j, "files", &files_j, source));
  ZO_RETURN_IF_ERROR(get(j, "tensors", &tensors_j, source));
  if (!files_j.is_array() || !tensors_j.is_array()) return corruption(source + ": files and tensors must be arrays");
  for (const json& f : files_j) {
    FileDigest d;
    std::vector<std::string> crcs;
    ZO_RETURN_IF_ERROR(get(f, "name", &d.name, source + " files"));
    ZO_RETURN_IF_ERROR(get(f, "size_bytes", &d.size_bytes, source + " " + d.name));
    ZO_RETURN_IF_ERROR(get(f, "chunk_bytes", &d.chunk_bytes, source + " " + d.name));
    ZO_RETURN_IF_ERROR(get(f, "crc32c", &crcs, source + " " + d.name));
    if (d.name.empty() || d.name.find('/') != std::string::npos || d.chunk_bytes == 0 ||
        crcs.size() != (d.size_bytes + d.chunk_bytes - 1) / d.chunk_bytes) {
      return corruption(source + ": file entry \"" + d.name + "\" is malformed (name, chunk_bytes or crc32c count)");
    }
    for (const std::string& c : crcs) {
      char* end = nullptr;
      const bool hex = c.size() == 8 && std::all_of(c.begin(), c.end(), [](char x) { return std::isxdigit(static_cast<unsigned char>(x)) != 0; });
      const unsigned long v = hex ? std::strtoul(c.c_str(), &end, 16) : 0;
      if (!hex || *end != '\0') return corruption(source + ": " + d.name + ": bad crc32c \"" + c + "\"");
      d.chunk_crc32c.push_back(static_cast<uint32_t>(v));
    }
    // Two entries for one file would let the second's sizes and checksums go unchecked.
    if (m.find(d.name) != nullptr) return corruption(source + ": file entry \"" + quote_excerpt(d.name) + "\" appears twice");
    m.files.push_back(std::move(d));
  }
  for (const json& t : tensors_j) {
    CheckpointTensor ct;
    ZO_RETURN_IF_ERROR(get(t, "name", &ct.name, source + " tensors"));
    ZO_RETURN_IF_ERROR(get(t, "shape", &ct.shape, source + " " + ct.name));
    ct.n_elems = 1;
    for (int64_t d : ct.shape) {
      if (d < 1) return corruption(source + ": tensor " + ct.name + " has shape " + shape_string(ct.shape));
      if (__builtin_mul_overflow(ct.n_elems, static_cast<uint64_t>(d), &ct.n_elems) || ct.n_elems > (uint64_t{1} << 50)) {
        return corruption(source + ": tensor " + ct.name + " has an impossible shape " + shape_string(ct.shape));
      }
    }
    if (std::any_of(m.tensors.begin(), m.tensors.end(), [&](const CheckpointTensor& x) { return x.name == ct.name; }))
      return corruption(source + ": tensor \"" + quote_excerpt(ct.name) + "\" appears twice");
    m.tensors.push_back(std::move(ct));
  }
  return m;
}

const FileDigest* Manifest::find(std::string_view name) const {
  for (const FileDigest& f : files) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

// ---------------------------------------------------------------------------------------------
// Save

namespace {

// Moves `victim` (a step directory) out of the way atomically, then deletes it.
Status prune_one(io::Env& env, const std::string& dir, const std::string& victim) {
  const std::string doomed = dir + "/tmp-pruned-" + victim + "-" + random_suffix();
  ZO_RETURN_IF_ERROR(env.rename(dir + "/" + victim, doomed).with_context("moving " + victim + " away to prune it"));
  ZO_RETURN_IF_ERROR(env.sync_dir(dir));
  return env.remove_all(doomed);
}

// Note [Replacing a step directory]: DIR/step-<N> can exist already — left by a save killed after
// its rename but before `latest` was updated, or by a run that went further before this one resumed
// from an older checkpoint. publish_directory (Note [Publishing a directory]) swaps the new one in
// with one atomic renameat2(RENAME_EXCHANGE) and removes the old one from the tmp name, so
// `latest`, whichever it names, never points at a missing or partial directory. File systems
// without RENAME_EXCHANGE get kAlreadyExists.

// step-<N> directories of DIR, oldest first.
std::vector<std::pair<uint64_t, std::string>> step_dirs(const std::string& dir) {
  std::vector<std::pair<uint64_t, std::string>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) != 0 || name.size() == 5) continue;
    if (name.find_first_not_of("0123456789", 5) != std::string::npos) continue;
    uint64_t step = 0;
    const auto [ptr, err] = std::from_chars(name.data() + 5, name.data() + name.size(), step);
    if (err != std::errc() || ptr != name.data() + name.size()) continue;
    out.emplace_back(step, name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

Status write_state_file(StateStore& store, StateKind kind, const std::string& path, std::span<std::byte> staging,
                        const std::vector<CheckpointTensor>& tensors, FileDigest* digest,
                        const std::function<void(uint64_t)>& on_bytes) {
  std::vector<SafetensorsEntry> entries;
  for (const CheckpointTensor& t : tensors) entries.push_back({t.name, DType::kF32, t.shape});
  const std::string header = safetensors_header(entries, {{"format", "pt"}, {"zoffload_state", std::string(state_name(kind))}});
  ZO_ASSIGN_OR_RETURN(auto writer, StreamWriter::create(store.io(), path, staging, kSlots));
  ZO_RETURN_IF_ERROR(writer->append(std::as_bytes(std::span(header.data(), header.size()))));
  // Note [Save pipeline]: up to kSlots - 1 reads from the swap file are in flight into reserved
  // staging spans while the oldest is checksummed and committed, and full slots are being written:
  // the drive reads and writes at once and the CRC overlaps both.
  std::deque<std::pair<StateStore::PendingRead, uint64_t>> inflight;
  auto drain = [&] {
    for (auto& [p, n] : inflight) {
      if (p.file != nullptr) (void)p.file->wait(p.ticket);
    }
    inflight.clear();
  };
  const auto groups = store.registry().sub_groups();
  size_t gi = 0;
  uint64_t off = 0;
  Status s;
  while (s.is_ok()) {
    while (s.is_ok() && gi < groups.size() && inflight.size() < kSlots - 1) {
      const uint64_t bytes = store.state_bytes(groups[gi].index, kind);
      if (off == bytes) {
        ++gi;
        off = 0;
        continue;
      }
      auto span = writer->reserve(bytes - off);
      if (!span.is_ok()) {
        s = span.status();
        break;
      }
      auto pending = store.read_state_range_async(groups[gi].index, kind, off, *span);
      if (!pending.is_ok()) {
        s = pending.status();
        break;
      }
      inflight.emplace_back(*pending, span->size());
      off += span->size();
    }
    if (!s.is_ok() || inflight.empty()) break;
    auto [pending, n] = inflight.front();
    inflight.pop_front();
    if (pending.file != nullptr) s = pending.file->wait(pending.ticket);
    if (s.is_ok()) s = writer->commit_reserved();
    if (s.is_ok() && on_bytes) on_bytes(n);
  }
  if (!s.is_ok()) {
    drain();
    return s;
  }
  ZO_ASSIGN_OR_RETURN(*digest, writer->finish());
  return Status::ok();
}

}  // namespace

Result<SaveResult> save_checkpoint(StateStore& store, const TrainingState& state, const std::string& model_config_json,
                                   const SaveOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string name = "step-" + std::to_string(state.steps_done);
  const std::string context = "saving checkpoint " + options.dir + "/" + name;
  if (options.dir.empty()) return invalid_argument(context + ": no checkpoint directory (zoffload.checkpoint.dir)");
  io::Env& env = options.env != nullptr ? *options.env : *io::Env::posix();
  ZO_RETURN_IF_ERROR(check_staging_bytes(options.staging_bytes, context));
  if (!store.torn_reason().empty()) {
    return failed_precondition(context + ": the states are torn by a failed optimizer step (" + store.torn_reason() +
                               "): nothing consistent to save");
  }
  std::error_code ec;
  const bool existed = fs::is_directory(options.dir, ec);
  fs::create_directories(options.dir, ec);
  if (ec) return errno_status(context + ": creating " + options.dir, ec.value());
  if (!existed) {
    // The new directory's own entry must survive a power cut too.
    const fs::path parent = fs::absolute(options.dir).lexically_normal().parent_path();
    ZO_RETURN_IF_ERROR(env.sync_dir(parent.string()).with_context(context));
  }
  const std::string final_dir = options.dir + "/" + name;

  const std::string tmp = options.dir + "/tmp-" + std::to_string(state.steps_done) + "-" + random_suffix();
  ZO_RETURN_IF_ERROR(env.make_dir(tmp).with_context(context));
  auto phase = [&](SavePhase p) {
    if (options.on_phase) options.on_phase(p);
  };
  phase(SavePhase::kStarted);

  SaveResult result;
  Manifest manifest;
  manifest.step = state.steps_done;
  manifest.tensors = tensors_of(store.registry());
  // Everything up to the rename happens in tmp: on failure, remove it and report.
  auto write_all = [&]() -> Status {
    uint64_t total = 0, done = 0;
    for (StateKind kind : kSavedKinds) {
      for (const SubGroup& g : store.registry().sub_groups()) total += store.state_bytes(g.index, kind);
    }
    // No more staging than one state file (and 1 MiB for its header) needs.
    ZO_ASSIGN_OR_RETURN(AlignedBuffer staging, AlignedBuffer::allocate(staging_bytes_for(
                                                   options.staging_bytes, total / 3 + (uint64_t{1} << 20))));
    auto on_bytes = [&](uint64_t n) {
      done += n;
      if (options.progress) options.progress(done, total);
    };
    for (StateKind kind : kSavedKinds) {
      FileDigest digest;
      ZO_RETURN_IF_ERROR(write_state_file(store, kind, tmp + "/" + file_of(kind), staging.bytes(), manifest.tensors,
                                          &digest, on_bytes));
      manifest.files.push_back(std::move(digest));
      phase(SavePhase::kStateFileDone);
    }
    ZO_ASSIGN_OR_RETURN(FileDigest st, write_small_file(env, tmp, kTrainerStateFile, state.to_json().dump(2) + "\n"));
    manifest.files.push_back(std::move(st));
    ZO_ASSIGN_OR_RETURN(FileDigest cfg, write_small_file(env, tmp, kModelConfigFile, model_config_json));
    manifest.files.push_back(std::move(cfg));
    ZO_ASSIGN_OR_RETURN(FileDigest mf, write_small_file(env, tmp, kManifestFile, manifest.to_json().dump(1) + "\n"));
    result.bytes += mf.size_bytes;
    ZO_RETURN_IF_ERROR(env.sync_dir(tmp));
    phase(SavePhase::kManifestWritten);
    // Note [A save that fails after its rename]: once published, step-<N> is complete, but
    // `latest` still names the previous checkpoint, which stays intact and is what a resume
    // loads. An error from then on (DIR's fsync, updating `latest`) is reported all the same; the
    // directory is left for the next save of the same step to replace, or for keep_last to prune.
    bool replaced = false;
    ZO_RETURN_IF_ERROR(publish_directory(env, tmp, final_dir, &replaced));
    if (replaced) ZO_LOG(kInfo) << "replaced the existing " << final_dir << " with the new checkpoint of the same step";
    return Status::ok();
  };
  Status s = write_all();
  if (!s.is_ok()) {
    // Before the rename tmp is this save; after an exchange whose fsync failed, the replaced
    // checkpoint. Either is removable (a missing tmp is fine).
    Status rm = env.remove_all(tmp);
    if (!rm.is_ok()) ZO_LOG(kWarn) << context << ": could not remove " << tmp << ": " << rm.to_string();
    return s.with_context(context);
  }
  for (const FileDigest& f : manifest.files) result.bytes += f.size_bytes;
  phase(SavePhase::kRenamed);

  // Point `latest` at it: a new file renamed over the old one.
  const std::string latest_tmp = "latest.tmp-" + random_suffix();
  auto written = write_small_file(env, options.dir, latest_tmp, name + "\n");
  if (!written.is_ok()) {
    Status st = written.status();
    return st.with_context(context + " (updating latest)");
  }
  Status replaced = env.rename(options.dir + "/" + latest_tmp, options.dir + "/" + kLatestFile);
  if (!replaced.is_ok()) {
    (void)env.remove_all(options.dir + "/" + latest_tmp);
    return replaced.with_context(context + " (updating latest)");
  }
  ZO_RETURN_IF_ERROR(env.sync_dir(options.dir).with_context(context + " (updating latest)"));
  phase(SavePhase::kLatestUpdated);

  if (options.keep_last > 0) {
    auto dirs = step_dirs(options.dir);
    // Newest first by step; the one just written is never pruned. Steps beyond it belong to a run
    // this one resumed before (`latest` now names this one, and this run would overwrite them when
    // it gets there): they do not count as the newest and are pruned.
    std::reverse(dirs.begin(), dirs.end());
    uint64_t kept = 0;
    for (const auto& [step, dir_name] : dirs) {
      if (dir_name == name || (step < state.steps_done && kept < options.keep_last - 1)) {
        if (dir_name != name) ++kept;
        continue;
      }
      Status p = prune_one(env, options.dir, dir_name);
      if (!p.is_ok()) {
        ZO_LOG(kWarn) << context << ": pruning " << dir_name << " failed (the new checkpoint is complete): "
                      << p.to_string();
        continue;
      }
      result.pruned.push_back(dir_name);
    }
  }
  phase(SavePhase::kPruned);
  result.path = final_dir;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

Result<std::vector<std::string>> clean_stale_checkpoints(const std::string& dir, io::Env* env_or_null) {
  io::Env& env = env_or_null != nullptr ? *env_or_null : *io::Env::posix();
  std::vector<std::string> removed;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return removed;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("tmp-", 0) != 0 && name.rfind("latest.tmp-", 0) != 0) continue;
    ZO_RETURN_IF_ERROR(env.remove_all(e.path().string()).with_context("removing a stale save"));
    removed.push_back(name);
  }
  if (ec) return errno_status("listing " + dir, ec.value());
  if (!removed.empty()) ZO_RETURN_IF_ERROR(env.sync_dir(dir));
  return removed;
}

// ---------------------------------------------------------------------------------------------
// Open, verify, load

Result<std::string> resolve_checkpoint(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return not_found("checkpoint " + path + " does not exist");
  if (fs::exists(path + "/" + kManifestFile, ec)) return path;
  if (fs::exists(path + "/" + kLatestFile, ec)) {
    ZO_ASSIGN_OR_RETURN(std::string text, read_small_file(path + "/" + kLatestFile));
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    if (text.rfind("step-", 0) != 0 || text.find('/') != std::string::npos) {
      return corruption(path + "/" + kLatestFile + " names \"" + quote_excerpt(text) + "\", not a step-<N> directory");
    }
    const std::string target = path + "/" + text;
    if (!fs::exists(target + "/" + kManifestFile, ec)) {
      return corruption(path + "/" + kLatestFile + " names " + quote_excerpt(text) + ", which has no " + kManifestFile);
    }
    return target;
  }
  fs::path norm = fs::path(path).lexically_normal();
  if (norm.filename().empty()) norm = norm.parent_path();
  const std::string base = norm.filename().string();
  if (fs::is_directory(path, ec) && (base.rfind("step-", 0) == 0 || base.rfind("tmp-", 0) == 0)) {
    return corruption(path + " has no " + kManifestFile + ": an incomplete save, never loaded");
  }
  if (fs::is_directory(path, ec)) {
    return not_found(path + " is not a checkpoint: it has neither " + kManifestFile + " (a step directory) nor " +
                     kLatestFile + " (a checkpoint directory)");
  }
  return not_found(path + " is not a checkpoint directory");
}

Result<CheckpointInfo> open_checkpoint(const std::string& path) {
  CheckpointInfo info;
  info.path = path;
  const std::string mpath = path + "/" + kManifestFile;
  auto mtext = read_small_file(mpath);
  if (!mtext.is_ok()) {
    if (mtext.status().code() == StatusCode::kNotFound) {
      return corruption(path + " has no " + kManifestFile + ": an incomplete save, never loaded");
    }
    return mtext.status();
  }
  ZO_ASSIGN_OR_RETURN(json mj, parse_json_text(*mtext, mpath));
  ZO_ASSIGN_OR_RETURN(info.manifest, Manifest::from_json(mj, mpath));
  for (const char* required : {kMasterFile, kExpAvgFile, kExpAvgSqFile, kTrainerStateFile, kModelConfigFile}) {
    if (!info.manifest.find(required)) return corruption(mpath + ": lists no " + required);
  }
  std::error_code ec;
  for (const FileDigest& f : info.manifest.files) {
    const std::string fpath = path + "/" + f.name;
    const uint64_t size = fs::file_size(fpath, ec);
    if (ec) return corruption(fpath + ": listed in the manifest but " + ec.message());
    if (size != f.size_bytes) {
      return corruption(fpath + ": " + std::to_string(size) + " bytes, the manifest says " + std::to_string(f.size_bytes));
    }
  }
  // The small files are read whole and checked here; the state files by verify/load.
  auto small = [&](const char* name) -> Result<std::string> {
    const std::string fpath = path + "/" + name;
    ZO_ASSIGN_OR_RETURN(std::string text, read_small_file(fpath));
    ChunkVerifier v(*info.manifest.find(name), fpath);
    ZO_RETURN_IF_ERROR(v.update(std::as_bytes(std::span(text.data(), text.size()))));
    ZO_RETURN_IF_ERROR(v.finish());
    return text;
  };
  ZO_ASSIGN_OR_RETURN(std::string stext, small(kTrainerStateFile));
  ZO_ASSIGN_OR_RETURN(json sj, parse_json_text(stext, path + "/" + kTrainerStateFile));
  ZO_ASSIGN_OR_RETURN(info.state, TrainingState::from_json(sj, path + "/" + kTrainerStateFile));
  ZO_ASSIGN_OR_RETURN(info.model_config_json, small(kModelConfigFile));
  if (info.state.steps_done != info.manifest.step) {
    return corruption(mpath + ": step " + std::to_string(info.manifest.step) + " but " + kTrainerStateFile +
                      " says steps_done " + std::to_string(info.state.steps_done));
  }
  // The state files' headers must list the manifest's tensors, in order, as F32.
  for (StateKind kind : kSavedKinds) {
    const std::string fpath = path + "/" + file_of(kind);
    ZO_ASSIGN_OR_RETURN(auto st, SafetensorsFile::open(fpath));
    const auto& ts = st->tensors();
    if (ts.size() != info.manifest.tensors.size()) {
      return corruption(fpath + ": " + std::to_string(ts.size()) + " tensors, the manifest lists " +
                        std::to_string(info.manifest.tensors.size()));
    }
    uint64_t expect_offset = ts.empty() ? 0 : ts.front().data_offset_bytes;
    if (expect_offset % 4 != 0) {
      return corruption(fpath + ": the data starts at offset " + std::to_string(expect_offset) +
                        ", not a multiple of 4 (a zoffload checkpoint pads it to 4096)");
    }
    for (size_t i = 0; i < ts.size(); ++i) {
      const CheckpointTensor& t = info.manifest.tensors[i];
      if (ts[i].name != t.name || ts[i].shape != t.shape || ts[i].dtype != DType::kF32 ||
          ts[i].data_offset_bytes != expect_offset) {
        return corruption(fpath + ": tensor " + std::to_string(i) + " is " + ts[i].name + " " +
                          shape_string(ts[i].shape) + ", the manifest says " + t.name + " " + shape_string(t.shape) +
                          " F32, stored back to back");
      }
      expect_offset += ts[i].size_bytes;
    }
    if (expect_offset != st->file_size_bytes()) {
      return corruption(fpath + ": the tensors end at " + std::to_string(expect_offset) + " but the file has " +
                        std::to_string(st->file_size_bytes()) + " bytes");
    }
  }
  return info;
}

Status verify_checkpoint(const CheckpointInfo& ckpt, io::IoEngine& io, std::span<std::byte> staging,
                         const std::function<void(uint64_t, uint64_t)>& progress) {
  ZO_RETURN_IF_ERROR(check_staging_bytes(staging.size(), "verifying " + ckpt.path));
  uint64_t total = 0, done = 0;
  for (const FileDigest& f : ckpt.manifest.files) total += f.size_bytes;
  for (const FileDigest& f : ckpt.manifest.files) {
    ZO_RETURN_IF_ERROR(stream_file(
        io, ckpt.path + "/" + f.name, f, staging, f.size_bytes, [](uint64_t, std::span<const std::byte>) { return Status::ok(); },
        [&](uint64_t n) {
          done += n;
          if (progress) progress(done, total);
        }));
  }
  return Status::ok();
}

Status load_checkpoint(const CheckpointInfo& ckpt, StateStore& store, io::IoEngine& io, std::span<std::byte> staging) {
  const std::string context = "loading checkpoint " + ckpt.path;
  ZO_RETURN_IF_ERROR(check_staging_bytes(staging.size(), context));
  const ParamRegistry& reg = store.registry();
  const auto& tensors = ckpt.manifest.tensors;
  if (tensors.size() != reg.params().size()) {
    return invalid_argument(context + ": it holds " + std::to_string(tensors.size()) + " tensors, the model has " +
                            std::to_string(reg.params().size()) + " parameters");
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const ParamInfo& p = reg.params()[i];
    if (p.name != tensors[i].name || p.shape != tensors[i].shape) {
      return invalid_argument(context + ": tensor " + std::to_string(i) + " is " + tensors[i].name + " " +
                              shape_string(tensors[i].shape) + " but the model's parameter " + std::to_string(i) +
                              " is " + p.name + " " + shape_string(p.shape) + ": a checkpoint of a different model");
    }
  }
  for (StateKind kind : kSavedKinds) {
    const std::string fpath = ckpt.path + "/" + file_of(kind);
    ZO_ASSIGN_OR_RETURN(auto header, SafetensorsFile::open(fpath));
    const uint64_t data_start = header->tensors().empty() ? header->file_size_bytes()
                                                          : header->tensors().front().data_offset_bytes;
    // File bytes [data_start, ...) are the flat fp32 state of every sub-group in order.
    uint32_t g = 0;
    auto consume = [&](uint64_t offset, std::span<const std::byte> bytes) -> Status {
      uint64_t flat = offset - data_start;
      while (!bytes.empty()) {
        while (g < reg.sub_groups().size() &&
               flat >= (reg.sub_groups()[g].first_elem + reg.sub_groups()[g].n_elems) * 4) {
          ++g;
        }
        if (g == reg.sub_groups().size()) return corruption(fpath + ": more data than the model's parameters");
        const SubGroup& sg = reg.sub_groups()[g];
        const uint64_t in_group = flat - sg.first_elem * 4;
        const uint64_t n = std::min<uint64_t>(bytes.size(), sg.n_elems * 4 - in_group);
        ZO_RETURN_IF_ERROR(store.write_state_range(g, kind, in_group, bytes.first(n)));
        if (kind == StateKind::kMaster) {
          ZO_CHECK(in_group % 4 == 0 && n % 4 == 0) << fpath << ": unaligned fp32 run";
          const auto* values = reinterpret_cast<const float*>(bytes.data());
          ZO_RETURN_IF_ERROR(store.write_compute_from_master(g, in_group / 4, {values, n / 4}));
        }
        bytes = bytes.subspan(n);
        flat += n;
      }
      return Status::ok();
    };
    ZO_RETURN_IF_ERROR(
        stream_file(io, fpath, *ckpt.manifest.find(file_of(kind)), staging, data_start, consume, {}).with_context(context));
  }
  return Status::ok();
}

json describe_checkpoint(const CheckpointInfo& ckpt) {
  uint64_t params = 0, bytes = 0;
  for (const CheckpointTensor& t : ckpt.manifest.tensors) params += t.n_elems;
  json files = json::object();
  for (const FileDigest& f : ckpt.manifest.files) {
    files[f.name] = f.size_bytes;
    bytes += f.size_bytes;
  }
  json model = json::parse(ckpt.model_config_json, nullptr, false);
  json out = {{"path", ckpt.path},
              {"format_version", ckpt.manifest.format_version},
              {"step", ckpt.state.steps_done},
              {"optimizer_steps", ckpt.state.optimizer_steps},
              {"skipped_steps", ckpt.state.steps_done - ckpt.state.optimizer_steps},
              {"loss_scale", ckpt.state.loss_scaler.cur_scale},
              {"data_position", {{"epoch", ckpt.state.data_position.epoch}, {"index", ckpt.state.data_position.index}}},
              {"seed", ckpt.state.seed},
              {"model", ckpt.state.model},
              {"data", ckpt.state.data},
              {"seq_len", ckpt.state.seq_len},
              {"tensors", ckpt.manifest.tensors.size()},
              {"parameters", params},
              {"bytes", bytes},
              {"files", files}};
  if (model.is_object()) {
    for (const char* k : {"model_type", "hidden_size", "num_hidden_layers", "vocab_size"}) {
      if (model.contains(k)) out["model_config"][k] = model[k];
    }
  }
  const json& c = ckpt.state.config;
  if (c.is_object()) {
    json highlights = json::object();
    for (const char* k : {"bf16", "fp16", "zero_optimization", "optimizer", "scheduler", "gradient_accumulation_steps",
                          "train_micro_batch_size_per_gpu"}) {
      if (c.contains(k)) highlights[k] = c[k];
    }
    out["config"] = highlights;
  }
  return out;
}

}  // namespace zo::engine
