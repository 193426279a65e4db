#include "engine/ckpt/checkpoint.h"

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

constexpr uint32_t kWriteSlots = 4;  // of the staging buffer a state file is written through

std::string random_suffix() {
  std::random_device rd;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%08x%08x", rd(), rd());
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

// The tensors of a store, as a checkpoint lists them.
std::vector<CheckpointTensor> tensors_of(const ParamRegistry& registry) {
  std::vector<CheckpointTensor> out;
  for (const ParamInfo& p : registry.params()) out.push_back({p.name, p.shape, p.n_elems});
  return out;
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
Result<std::vector<std::pair<uint64_t, std::string>>> step_dirs(io::Env& env, const std::string& dir) {
  std::vector<std::pair<uint64_t, std::string>> out;
  ZO_ASSIGN_OR_RETURN(const std::vector<std::string> names, env.list_dir(dir));
  for (const std::string& name : names) {
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

Status write_state_file(io::Env& env, StateStore& store, StateKind kind, const std::string& path,
                        std::span<std::byte> staging, const std::vector<CheckpointTensor>& tensors, FileDigest* digest,
                        const std::function<void(uint64_t)>& on_bytes) {
  std::vector<SafetensorsEntry> entries;
  for (const CheckpointTensor& t : tensors) entries.push_back({t.name, DType::kF32, t.shape});
  const std::string header = safetensors_header(entries, {{"format", "pt"}, {"zoffload_state", std::string(state_name(kind))}});
  ZO_ASSIGN_OR_RETURN(auto writer, StreamWriter::create(store.io(), path, staging, kWriteSlots, env));
  ZO_RETURN_IF_ERROR(writer->append(std::as_bytes(std::span(header.data(), header.size()))));
  // Note [Save pipeline]: up to kWriteSlots - 1 reads from the swap file are in flight into reserved
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
    while (s.is_ok() && gi < groups.size() && inflight.size() < kWriteSlots - 1) {
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
  std::string created;
  ZO_RETURN_IF_ERROR(env.make_dirs(options.dir, &created).with_context(context));
  if (!created.empty()) {
    // The new directories' own entries must survive a power cut too.
    const fs::path parent = fs::absolute(created).lexically_normal().parent_path();
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
    for (StateKind kind : kSavedStates) {
      for (const SubGroup& g : store.registry().sub_groups()) total += store.state_bytes(g.index, kind);
    }
    // No more staging than one state file (and 1 MiB for its header) needs.
    ZO_ASSIGN_OR_RETURN(AlignedBuffer staging, AlignedBuffer::allocate(staging_bytes_for(
                                                   options.staging_bytes, total / 3 + (uint64_t{1} << 20))));
    auto on_bytes = [&](uint64_t n) {
      done += n;
      if (options.progress) options.progress(done, total);
    };
    for (StateKind kind : kSavedStates) {
      FileDigest digest;
      ZO_RETURN_IF_ERROR(write_state_file(env, store, kind, tmp + "/" + state_file_name(kind), staging.bytes(),
                                          manifest.tensors, &digest, on_bytes));
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
    std::vector<std::pair<uint64_t, std::string>> dirs;
    if (auto listed = step_dirs(env, options.dir); listed.is_ok()) {
      dirs = std::move(*listed);
    } else {
      ZO_LOG(kWarn) << context << ": listing old checkpoints to prune failed (the new checkpoint is complete): "
                    << listed.status().to_string();
    }
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
  ZO_ASSIGN_OR_RETURN(const io::PathKind kind, env.path_kind(dir));
  if (kind != io::PathKind::kDirectory) return removed;
  ZO_ASSIGN_OR_RETURN(const std::vector<std::string> names, env.list_dir(dir));
  for (const std::string& name : names) {
    if (name.rfind("tmp-", 0) != 0 && name.rfind("latest.tmp-", 0) != 0) continue;
    ZO_RETURN_IF_ERROR(env.remove_all(dir + "/" + name).with_context("removing a stale save"));
    removed.push_back(name);
  }
  if (!removed.empty()) ZO_RETURN_IF_ERROR(env.sync_dir(dir));
  return removed;
}

}  // namespace zo::engine
