#include "engine/ckpt/checkpoint.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cerrno>
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
#include "common/timer.h"
#include "engine/ckpt/state_files.h"
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

// The names a save gives its temporaries — tmp-<step>-<random>, tmp-pruned-<step>-<random>,
// latest.tmp-<random> — and nothing else: a user's "tmp-notes" in the directory is not ours.
bool is_save_tmp_name(std::string_view name) {
  auto random_at = [&](size_t at) {
    if (name.size() != at + 16) return false;
    for (size_t i = at; i < name.size(); ++i)
      if (!std::isxdigit(static_cast<unsigned char>(name[i]))) return false;
    return true;
  };
  if (name.rfind("latest.tmp-", 0) == 0) return random_at(11);
  return name.rfind("tmp-", 0) == 0 && name.size() > 4 + 17 && name[name.size() - 17] == '-' &&
         random_at(name.size() - 16);
}

std::string random_suffix() {
  std::random_device rd;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%08x%08x", rd(), rd());
  return buf;
}

// Writes a small file in one go through the Env (fdatasynced; nothing left on failure) and
// returns its digest.
Result<FileDigest> write_small_file(io::Env* env, const std::string& dir, const std::string& name,
                                    const std::string& text) {
  ZO_RETURN_IF_ERROR(env->write_file(dir + "/" + name, text));
  FileDigest d;
  d.name = name;
  d.size_bytes = text.size();
  for (uint64_t off = 0; off < text.size(); off += d.chunk_bytes) {
    d.chunk_crc32c.push_back(crc32c(text.data() + off, std::min<uint64_t>(d.chunk_bytes, text.size() - off)));
  }
  return d;
}

// The manifest of a save of `store` at `step`, before its files: the tensors of the trainable
// params and of the frozen ones (Note [Frozen sub-groups]), the states' dtypes.
Manifest manifest_of(const StateStore& store, uint64_t step) {
  Manifest m;
  m.step = step;
  for (const ParamInfo& p : store.registry().params())
    (p.trainable ? m.tensors : m.frozen).push_back(checkpoint_tensor(p));
  const Placement& pl = store.plan().placement;
  m.moments = pl.moments;
  m.master_dtype = pl.master_dtype;
  m.optimizer_type = pl.optimizer_type;
  m.frozen_dtype = pl.compute_dtype;
  return m;
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
Status prune_one(io::Env* env, const std::string& dir, const std::string& victim) {
  const std::string doomed = dir + "/tmp-pruned-" + victim + "-" + random_suffix();
  ZO_RETURN_IF_ERROR(env->rename(dir + "/" + victim, doomed).with_context("moving " + victim + " away to prune it"));
  ZO_RETURN_IF_ERROR(env->sync_dir(dir));
  return env->remove_all(doomed);
}

// Note [Replacing a step directory]: DIR/step-<N> can exist already — left by a save killed after
// its rename but before `latest` was updated, or by a run that went further before this one resumed
// from an older checkpoint. publish_directory (Note [Publishing a directory]) swaps the new one in
// with one atomic renameat2(RENAME_EXCHANGE) and removes the old one from the tmp name, so
// `latest`, whichever it names, never points at a missing or partial directory. File systems
// without RENAME_EXCHANGE get kAlreadyExists.

// step-<N> directories of DIR, oldest first.
Result<std::vector<std::pair<uint64_t, std::string>>> step_dirs(io::Env* env, const std::string& dir) {
  std::vector<std::pair<uint64_t, std::string>> out;
  ZO_ASSIGN_OR_RETURN(const std::vector<std::string> names, env->list_dir(dir));
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

// Appends the part `file` carries of sub-groups [begin, end) (`layout`'s parts) to `writer` (a
// StreamWriter or a RangeWriter).
template <class Writer>
Status stream_groups(Writer& writer, StateStore& store, const StateFile& file, const StateFileLayout& layout,
                     uint32_t begin, uint32_t end, const std::function<void(uint64_t)>& on_bytes) {
  const StateKind kind = file.kind;
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
  uint32_t gi = begin;
  uint64_t off = gi < end ? layout.part(gi).first : 0;
  Status s;
  while (s.is_ok()) {
    while (s.is_ok() && gi < end && inflight.size() < kWriteSlots - 1) {
      const uint64_t bytes = layout.part(gi).second;
      if (off == bytes) {
        ++gi;
        if (gi < end) off = layout.part(gi).first;
        continue;
      }
      auto span = writer.reserve(bytes - off);
      if (!span.is_ok()) {
        s = span.status();
        break;
      }
      auto pending = store.read_state_range_async(gi, kind, off, *span);
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
    if (s.is_ok()) s = writer.commit_reserved();
    if (s.is_ok() && on_bytes) on_bytes(n);
  }
  if (!s.is_ok()) drain();
  return s;
}

Status write_state_file(io::Env* env, StateStore& store, const StateFile& file, const std::string& path,
                        std::span<std::byte> staging, const std::vector<CheckpointTensor>& tensors, FileDigest* digest,
                        const std::function<void(uint64_t)>& on_bytes) {
  const std::string header = state_file_prefix(file, tensors, store.plan().placement);
  ZO_ASSIGN_OR_RETURN(auto writer, StreamWriter::create(store.io(), path, staging, env, kWriteSlots));
  if (!header.empty()) ZO_RETURN_IF_ERROR(writer->append(std::as_bytes(std::span(header.data(), header.size()))));
  const StateFileLayout layout(store.registry(), store.plan().placement, file, header.size());
  ZO_RETURN_IF_ERROR(stream_groups(*writer, store, file, layout, 0, store.plan().n_sub_groups, on_bytes));
  ZO_ASSIGN_OR_RETURN(*digest, writer->finish());
  return Status::ok();
}

// Writes trainer_state.json, config.json and, last, the manifest (whose files list the state files
// already) into tmp, fsyncs it and publishes it as final_dir. *bytes += the manifest's size.
Status publish_save(io::Env* env, const std::string& tmp, const std::string& final_dir, const TrainingState& state,
                    const std::string& model_config_json, Manifest& manifest, uint64_t* bytes,
                    const std::function<void(SavePhase)>& phase) {
  ZO_ASSIGN_OR_RETURN(FileDigest st, write_small_file(env, tmp, kTrainerStateFile, state.to_json().dump(2) + "\n"));
  manifest.files.push_back(std::move(st));
  ZO_ASSIGN_OR_RETURN(FileDigest cfg, write_small_file(env, tmp, kModelConfigFile, model_config_json));
  manifest.files.push_back(std::move(cfg));
  ZO_ASSIGN_OR_RETURN(FileDigest mf, write_small_file(env, tmp, kManifestFile, manifest.to_json().dump(1) + "\n"));
  *bytes += mf.size_bytes;
  ZO_RETURN_IF_ERROR(env->sync_dir(tmp));
  phase(SavePhase::kManifestWritten);
  // Note [A save that fails after its rename]: once published, step-<N> is complete, but
  // `latest` still names the previous checkpoint, which stays intact and is what a resume
  // loads. An error from then on (DIR's fsync, updating `latest`) is reported all the same; the
  // directory is left for the next save of the same step to replace, or for keep_last to prune.
  bool replaced = false;
  ZO_RETURN_IF_ERROR(publish_directory(env, tmp, final_dir, &replaced));
  if (replaced) ZO_LOG(kInfo) << "replaced the existing " << final_dir << " with the new checkpoint of the same step";
  return Status::ok();
}

// Before the rename tmp is this save; after an exchange whose fsync failed, the replaced
// checkpoint. Either is removable (a missing tmp is fine).
void remove_failed_save(io::Env* env, const std::string& tmp, const std::string& context) {
  Status rm = env->remove_all(tmp);
  if (!rm.is_ok()) ZO_LOG(kWarn) << context << ": could not remove " << tmp << ": " << rm.to_string();
}

Status point_latest_and_prune(io::Env* env, const SaveOptions& options, const std::string& name, uint64_t steps_done,
                              const std::string& run_id, const std::string& context, SaveResult* result,
                              const std::function<void(SavePhase)>& phase);

// The checks of a save, its directory, and its tmp directory (returned).
Result<std::string> begin_save(io::Env* env, StateStore& store, const TrainingState& state, const SaveOptions& options,
                               const std::string& context) {
  if (options.dir.empty()) return invalid_argument(context + ": no checkpoint directory (zoffload.checkpoint.dir)");
  ZO_RETURN_IF_ERROR(check_staging_bytes(options.staging_bytes, context));
  if (!store.torn_reason().empty()) {
    return failed_precondition(context + ": the states are torn by a failed optimizer step (" + store.torn_reason() +
                               "): nothing consistent to save");
  }
  std::string created;
  ZO_RETURN_IF_ERROR(env->make_dirs(options.dir, &created).with_context(context));
  if (!created.empty()) {
    // The new directories' own entries must survive a power cut too.
    const fs::path parent = fs::absolute(created).lexically_normal().parent_path();
    ZO_RETURN_IF_ERROR(env->sync_dir(parent.string()).with_context(context));
  }
  const std::string tmp = options.dir + "/tmp-" + std::to_string(state.steps_done) + "-" + random_suffix();
  ZO_RETURN_IF_ERROR(env->make_dir(tmp).with_context(context));
  return tmp;
}

// Note [Collaborative save]
// With partitioned optimizer states (data parallel at ZeRO stage ≥ 1) no rank holds every state,
// and each rank's partition is one contiguous run of every state file (Note [Partitions]). So the
// format stays the one a single process writes, and the ranks write it together:
//   1. rank 0 makes the tmp directory and creates the three state files at their final size, and
//      broadcasts the tmp path (or its error);
//   2. every rank writes its run of each file with a RangeWriter (O_DIRECT inside, buffered at the
//      4 KiB blocks it shares with its neighbours; rank 0's run begins with the header), which
//      fdatasyncs it and returns the CRC-32C of each piece of a 16 MiB chunk it wrote; each rank in
//      turn broadcasts its digests or its error;
//   3. if every rank succeeded, rank 0 combines the pieces into each chunk's CRC
//      (combine_range_digests), writes trainer_state.json, config.json and the manifest, and
//      commits exactly as Note [Checkpoint commit protocol] says; else it removes the tmp
//      directory. It broadcasts the outcome.
// Every rank reaches every broadcast whatever failed, so a failure is an error on every rank, not
// a hang; a rank that dies fails the broadcasts (the process group names it). The tmp directory,
// files and rename are rank 0's, so a kill at any moment leaves what a single-process save leaves.
// The ranks must see one file system at the checkpoint directory (one node, or a shared one).
Result<SaveResult> save_collaborative(StateStore& store, const TrainingState& state,
                                      const std::string& model_config_json, const SaveOptions& options, io::Env* env,
                                      const std::function<void(SavePhase)>& phase) {
  const Stopwatch watch;
  const SaveOptions::Collective& c = *options.collective;
  const std::string name = "step-" + std::to_string(state.steps_done);
  const std::string context = "saving checkpoint " + options.dir + "/" + name;
  const std::string final_dir = options.dir + "/" + name;
  const ParamRegistry& reg = store.registry();
  const MemoryPlan& plan = store.plan();
  if (reg.n_partitions() != c.world_size || !plan.partitioned())
    return internal_error(context + ": a collaborative save needs a store partitioned over the " +
                          std::to_string(c.world_size) + " ranks");
  Manifest manifest = manifest_of(store, state.steps_done);
  const std::vector<StateFile> files =
      state_files(manifest.moments, manifest.master_dtype, manifest.frozen_file_dtype());
  // root's text on every rank.
  auto share = [&](uint32_t root, std::string text, const std::string& what) -> Result<std::string> {
    uint64_t n = text.size();
    ZO_RETURN_IF_ERROR(c.broadcast(&n, sizeof n, root, what));
    text.resize(n);
    ZO_RETURN_IF_ERROR(c.broadcast(text.data(), n, root, what));
    return text;
  };
  auto ok_or_error = [](const Status& st, const std::string& payload) {
    return st.is_ok() ? "ok" + payload : "error" + st.to_string();
  };
  auto failed_text = [](const std::string& text) { return text.rfind("ok", 0) != 0; };

  // 1. The tmp directory and the files, at their size.
  std::string tmp;
  Status started;
  if (c.rank == 0) {
    Result<std::string> t = begin_save(env, store, state, options, context);
    started = t.status();
    if (t.is_ok()) tmp = *t;
    for (const StateFile& file : files) {
      if (!started.is_ok()) break;
      const std::vector<CheckpointTensor>& tensors = file_tensors(manifest, file);
      const uint64_t size =
          state_file_prefix(file, tensors, store.plan().placement).size() + state_file_data_bytes(file, tensors);
      started = create_sized_file(tmp + "/" + file.name, size, env).with_context(context);
    }
    if (started.is_ok()) phase(SavePhase::kStarted);
    if (!started.is_ok() && !tmp.empty()) remove_failed_save(env, tmp, context);
  }
  ZO_ASSIGN_OR_RETURN(const std::string begun, share(0, ok_or_error(started, tmp), "starting " + context));
  if (failed_text(begun)) {
    if (c.rank == 0) return started;
    return Status(StatusCode::kAborted, context + ": rank 0 could not start it: " + begun.substr(5));
  }
  tmp = begun.substr(2);

  // 2. This rank's run of each state file.
  uint64_t own_bytes = 0;
  for (const StateFile& file : files) {
    const StateFileLayout layout(reg, plan.placement, file, 0);
    own_bytes += layout.offset(plan.owned_end) - layout.offset(plan.owned_begin);
  }
  std::vector<RangeDigest> mine;
  Status written = [&]() -> Status {
    if (!store.torn_reason().empty())
      return failed_precondition("the states are torn by a failed optimizer step (" + store.torn_reason() + ")");
    ZO_ASSIGN_OR_RETURN(AlignedBuffer staging, AlignedBuffer::allocate(staging_bytes_for(
                                                   options.staging_bytes, own_bytes / 3 + (uint64_t{1} << 20))));
    uint64_t done = 0;
    auto on_bytes = [&](uint64_t n) {
      done += n;
      if (options.progress) options.progress(done, own_bytes);
    };
    for (const StateFile& file : files) {
      const std::vector<CheckpointTensor>& tensors = file_tensors(manifest, file);
      const std::string header = state_file_prefix(file, tensors, store.plan().placement);
      // Each partition's run starts at its first sub-group's part (rank 0's at 0, with the prefix;
      // Note [State file layout]).
      const StateFileLayout layout(reg, store.plan().placement, file, header.size());
      auto file_offset = [&](uint32_t partition) {
        if (partition == 0) return uint64_t{0};
        if (partition == c.world_size) return layout.file_bytes();
        return layout.offset(reg.partition_groups(partition).first);
      };
      const std::string path = tmp + "/" + file.name;
      ZO_ASSIGN_OR_RETURN(auto writer, RangeWriter::create(store.io(), path, file_offset(c.rank),
                                                           file_offset(c.rank + 1), staging.bytes(), env, kWriteSlots));
      if (c.rank == 0 && !header.empty())
        ZO_RETURN_IF_ERROR(writer->append(std::as_bytes(std::span(header.data(), header.size()))));
      ZO_RETURN_IF_ERROR(stream_groups(*writer, store, file, layout, plan.owned_begin, plan.owned_end, on_bytes));
      ZO_ASSIGN_OR_RETURN(RangeDigest d, writer->finish());
      mine.push_back(std::move(d));
      if (c.rank == 0) phase(SavePhase::kStateFileDone);
    }
    return Status::ok();
  }();
  std::string payload;
  for (const RangeDigest& d : mine) {
    const uint64_t head[3] = {d.begin_bytes, d.end_bytes, d.piece_crc32c.size()};
    payload.append(reinterpret_cast<const char*>(head), sizeof head);
    payload.append(reinterpret_cast<const char*>(d.piece_crc32c.data()), d.piece_crc32c.size() * sizeof(uint32_t));
  }
  // Every rank's digests, per state file in `files` order; the first failure.
  std::vector<std::vector<RangeDigest>> ranges(files.size());
  Status failure;
  for (uint32_t r = 0; r < c.world_size; ++r) {
    ZO_ASSIGN_OR_RETURN(const std::string text, share(r, r == c.rank ? ok_or_error(written, payload) : std::string(),
                                                      "collecting the parts of " + context));
    if (failed_text(text)) {
      if (failure.is_ok())
        failure = r == c.rank ? Status(written).with_context(context)
                              : Status(StatusCode::kAborted, context + ": rank " + std::to_string(r) + " of " +
                                                                 std::to_string(c.world_size) +
                                                                 " could not write its part: " + text.substr(5));
      continue;
    }
    size_t at = 2;
    for (auto& per_file : ranges) {
      uint64_t head[3];
      ZO_CHECK_LE(at + sizeof head, text.size()) << "short digest message from rank " << r;
      std::memcpy(head, text.data() + at, sizeof head);
      at += sizeof head;
      RangeDigest d{head[0], head[1], std::vector<uint32_t>(head[2])};
      std::memcpy(d.piece_crc32c.data(), text.data() + at, head[2] * sizeof(uint32_t));
      at += head[2] * sizeof(uint32_t);
      per_file.push_back(std::move(d));
    }
  }

  // 3. Rank 0 commits; everyone learns how it went.
  SaveResult result;
  Status committed = failure;
  if (c.rank == 0) {
    if (committed.is_ok()) {
      committed = [&]() -> Status {
        for (size_t k = 0; k < files.size(); ++k) {
          const std::vector<CheckpointTensor>& tensors = file_tensors(manifest, files[k]);
          const uint64_t size = state_file_prefix(files[k], tensors, store.plan().placement).size() +
                                state_file_data_bytes(files[k], tensors);
          ZO_ASSIGN_OR_RETURN(FileDigest d, combine_range_digests(files[k].name, size, ranges[k]));
          manifest.files.push_back(std::move(d));
        }
        return publish_save(env, tmp, final_dir, state, model_config_json, manifest, &result.bytes, phase);
      }();
      if (committed.is_ok()) {
        for (const FileDigest& f : manifest.files) result.bytes += f.size_bytes;
        phase(SavePhase::kRenamed);
      } else {
        committed = committed.with_context(context);
      }
    }
    if (!committed.is_ok()) remove_failed_save(env, tmp, context);
    if (committed.is_ok())
      committed = point_latest_and_prune(env, options, name, state.steps_done, state.run_id, context, &result, phase);
  }
  ZO_ASSIGN_OR_RETURN(const std::string outcome, share(0, ok_or_error(committed, ""), "committing " + context));
  if (c.rank == 0) {
    if (!committed.is_ok()) return committed;
    result.path = final_dir;
  } else {
    if (!failure.is_ok()) return failure;
    if (failed_text(outcome))
      return Status(StatusCode::kAborted, context + ": rank 0 could not commit it: " + outcome.substr(5));
    result.bytes = own_bytes;
  }
  result.seconds = watch.elapsed_s();
  return result;
}

}  // namespace

Result<SaveResult> save_checkpoint(StateStore& store, const TrainingState& state, const std::string& model_config_json,
                                   const SaveOptions& options) {
  const Stopwatch watch;
  const std::string name = "step-" + std::to_string(state.steps_done);
  const std::string context = "saving checkpoint " + options.dir + "/" + name;
  ZO_RETURN_IF_ERROR(io::require_env(options.env, "SaveOptions::env").with_context(context));
  io::Env* env = options.env;
  auto phase = [&](SavePhase p) {
    if (options.on_phase) options.on_phase(p);
  };
  if (options.collective && options.collective->world_size > 1)
    return save_collaborative(store, state, model_config_json, options, env, phase);
  const std::string final_dir = options.dir + "/" + name;
  ZO_ASSIGN_OR_RETURN(const std::string tmp, begin_save(env, store, state, options, context));
  phase(SavePhase::kStarted);

  SaveResult result;
  Manifest manifest = manifest_of(store, state.steps_done);
  const std::vector<StateFile> files =
      state_files(manifest.moments, manifest.master_dtype, manifest.frozen_file_dtype());
  // Everything up to the rename happens in tmp: on failure, remove it and report.
  auto write_all = [&]() -> Status {
    uint64_t total = 0, done = 0;
    for (const StateFile& file : files) total += state_file_data_bytes(file, file_tensors(manifest, file));
    // No more staging than one state file (and 1 MiB for its header) needs.
    ZO_ASSIGN_OR_RETURN(AlignedBuffer staging, AlignedBuffer::allocate(staging_bytes_for(
                                                   options.staging_bytes, total / 3 + (uint64_t{1} << 20))));
    auto on_bytes = [&](uint64_t n) {
      done += n;
      if (options.progress) options.progress(done, total);
    };
    for (const StateFile& file : files) {
      FileDigest digest;
      ZO_RETURN_IF_ERROR(write_state_file(env, store, file, tmp + "/" + file.name, staging.bytes(),
                                          file_tensors(manifest, file), &digest, on_bytes));
      manifest.files.push_back(std::move(digest));
      phase(SavePhase::kStateFileDone);
    }
    return publish_save(env, tmp, final_dir, state, model_config_json, manifest, &result.bytes, phase);
  };
  Status s = write_all();
  if (!s.is_ok()) {
    remove_failed_save(env, tmp, context);
    return s.with_context(context);
  }
  for (const FileDigest& f : manifest.files) result.bytes += f.size_bytes;
  phase(SavePhase::kRenamed);
  ZO_RETURN_IF_ERROR(point_latest_and_prune(env, options, name, state.steps_done, state.run_id, context, &result, phase));
  result.path = final_dir;
  result.seconds = watch.elapsed_s();
  return result;
}

namespace {

// Whether the checkpoint `step_dir` names a run id other than `run_id` (one it cannot read, or one
// from before run ids, is this run's: pruned as it always was).
bool written_by_other_run(io::Env* env, const std::string& step_dir, const std::string& run_id) {
  Result<std::string> text = env->read_file(step_dir + "/" + kTrainerStateFile, "checkpoint file", kMaxSmallFileBytes);
  if (!text.is_ok()) return false;
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("run_id") || !j["run_id"].is_string()) return false;
  const std::string other = j["run_id"].get<std::string>();
  return !other.empty() && other != run_id;
}

Status point_latest_and_prune(io::Env* env, const SaveOptions& options, const std::string& name, uint64_t steps_done,
                              const std::string& run_id, const std::string& context, SaveResult* result,
                              const std::function<void(SavePhase)>& phase) {
  // Point `latest` at it: a new file renamed over the old one.
  const std::string latest_tmp = "latest.tmp-" + random_suffix();
  if (auto written = write_small_file(env, options.dir, latest_tmp, name + "\n"); !written.is_ok()) {
    Status st = written.status();
    return st.with_context(context + " (updating latest)");
  }
  Status replaced = env->rename(options.dir + "/" + latest_tmp, options.dir + "/" + kLatestFile);
  if (!replaced.is_ok()) {
    (void)env->remove_all(options.dir + "/" + latest_tmp);
    return replaced.with_context(context + " (updating latest)");
  }
  ZO_RETURN_IF_ERROR(env->sync_dir(options.dir).with_context(context + " (updating latest)"));
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
    // it gets there): they do not count as the newest and are pruned. Another run's checkpoints
    // (Note [Run ids] in engine/train/run_outputs.cpp) are neither counted nor pruned: keep_last is
    // this run's.
    std::reverse(dirs.begin(), dirs.end());
    uint64_t kept = 0;
    for (const auto& [step, dir_name] : dirs) {
      if (dir_name != name && !run_id.empty() && written_by_other_run(env, options.dir + "/" + dir_name, run_id))
        continue;
      if (dir_name == name || (step < steps_done && kept < options.keep_last - 1)) {
        if (dir_name != name) ++kept;
        continue;
      }
      Status p = prune_one(env, options.dir, dir_name);
      if (!p.is_ok()) {
        ZO_LOG(kWarn) << context << ": pruning " << dir_name
                      << " failed (the new checkpoint is complete): " << p.to_string();
        continue;
      }
      result->pruned.push_back(dir_name);
    }
  }
  phase(SavePhase::kPruned);
  return Status::ok();
}

}  // namespace

Result<std::vector<std::string>> clean_stale_checkpoints(const std::string& dir, io::Env* env) {
  std::vector<std::string> removed;
  ZO_ASSIGN_OR_RETURN(const io::PathKind kind, env->path_kind(dir));
  if (kind != io::PathKind::kDirectory) return removed;
  ZO_ASSIGN_OR_RETURN(const std::vector<std::string> names, env->list_dir(dir));
  for (const std::string& name : names) {
    if (!is_save_tmp_name(name)) continue;
    ZO_RETURN_IF_ERROR(env->remove_all(dir + "/" + name).with_context("removing a stale save"));
    removed.push_back(name);
  }
  if (!removed.empty()) ZO_RETURN_IF_ERROR(env->sync_dir(dir));
  return removed;
}

}  // namespace zo::engine
