// Checkpoints over real files: every tier saves and loads bit-exactly (also into a store with another
// sub-group size and placement), the commit protocol leaves `latest`, pruning and stale tmp
// directories as documented, a flipped byte anywhere is caught by verify and by load, a
// trainer_state.json counter that is not a whole number in its range is refused naming its key, and
// ENOSPC or EIO during a save is a clear error that leaves the previous checkpoint and the store
// untouched.
// Kills mid-save are in crash_test.cpp.
#include "engine/ckpt/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/aligned_buffer.h"
#include "common/crc32c.h"
#include "engine/model/safetensors.h"
#include "io/env.h"
#include "tests/engine/ckpt/ckpt_rig.h"
#include "tests/engine/temp_dir.h"

namespace zo::engine {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testing::Placing;
using testing::Rig;
using testing::rig_value;

constexpr uint64_t kStaging = uint64_t{1} << 20;  // small, so every state streams in several slots

TrainingState state_at(uint64_t step) {
  TrainingState s;
  s.steps_done = step;
  s.optimizer_steps = step - 1;
  s.loss_scaler = {.cur_scale = 2048, .cur_iter = step, .last_overflow_iter = 1, .cur_hysteresis = 2};
  s.data_position = {.epoch = 3, .index = 17};
  s.seed = 42;
  s.model = "rig";
  s.data = "/data/x.bin";
  s.seq_len = 128;
  s.config = {{"bf16", {{"enabled", true}}}};
  return s;
}

SaveOptions save_options(const std::string& dir, uint64_t keep_last = 2) {
  SaveOptions o;
  o.dir = dir;
  o.keep_last = keep_last;
  o.staging_bytes = kStaging;
  o.env = io::Env::posix();
  return o;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x20);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

struct Buffers {
  AlignedBuffer staging = std::move(AlignedBuffer::allocate(kStaging)).value();
};

Status verify(const std::string& path, io::IoEngine& io) {
  Buffers b;
  ZO_ASSIGN_OR_RETURN(std::string dir, resolve_checkpoint(path, io::Env::posix()));
  ZO_ASSIGN_OR_RETURN(CheckpointInfo info, open_checkpoint(dir, io::Env::posix()));
  return verify_checkpoint(info, io, b.staging.bytes(), io::Env::posix());
}

Status load(const std::string& path, Rig& rig) {
  Buffers b;
  ZO_ASSIGN_OR_RETURN(std::string dir, resolve_checkpoint(path, io::Env::posix()));
  ZO_ASSIGN_OR_RETURN(CheckpointInfo info, open_checkpoint(dir, io::Env::posix()));
  return load_checkpoint(info, *rig.store, *rig.io, b.staging.bytes(), io::Env::posix());
}

TEST(Checkpoint, EveryTierRoundTripsBitExactlyAcrossPlacements) {
  const std::vector<Placing> placings = {{.optimizer = "nvme", .param = "nvme"},
                                         {.optimizer = "cpu", .param = "cpu"},
                                         {.optimizer = "none", .param = "none"},
                                         {.optimizer = "nvme", .param = "cpu", .sub_group_size = 20000},
                                         {.optimizer = "cpu", .param = "nvme", .precision = "fp16"},
                                         {.optimizer = "nvme", .param = "nvme", .precision = "fp32"}};
  for (const Placing& from : placings) {
    SCOPED_TRACE(from.optimizer + "/" + from.param + " " + from.precision);
    TempDir dir;
    Rig src;
    ASSERT_TRUE(src.init(from, dir.path + "/swap-a").is_ok());
    ASSERT_TRUE(src.fill(7).is_ok());
    const std::string ckpt = dir.path + "/ckpt";
    auto saved = save_checkpoint(*src.store, state_at(5), "{\"model_type\": \"llama\"}", save_options(ckpt));
    ASSERT_TRUE(saved.is_ok()) << saved.status().to_string();
    EXPECT_EQ(saved->path, ckpt + "/step-5");
    EXPECT_EQ(read_file(ckpt + "/latest"), "step-5\n");
    ASSERT_TRUE(verify(ckpt, *src.io).is_ok());

    // Into a store with a different sub-group size and placement (same precision): the same bytes.
    Placing to = from.optimizer == "nvme" ? Placing{.optimizer = "cpu", .param = "cpu", .sub_group_size = 4096}
                                          : Placing{.optimizer = "nvme", .param = "nvme", .sub_group_size = 12288};
    to.precision = from.precision;
    Rig dst;
    ASSERT_TRUE(dst.init(to, dir.path + "/swap-b").is_ok());
    ASSERT_TRUE(dst.fill(99).is_ok());  // garbage that the load must overwrite
    Status s = load(ckpt, dst);
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq, StateKind::kCompute}) {
      EXPECT_TRUE(src.gather(kind) == dst.gather(kind)) << state_name(kind);
    }
    auto info = open_checkpoint(ckpt + "/step-5", io::Env::posix());
    ASSERT_TRUE(info.is_ok());
    EXPECT_EQ(info->state.to_json(), state_at(5).to_json());
    EXPECT_EQ(info->model_config_json, "{\"model_type\": \"llama\"}");
    EXPECT_EQ(info->manifest.tensors.size(), src.registry.params().size());
  }
}

// Fills a store placed as `from` with generation 7, saves it at step 5 into dir/ckpt, loads that
// into a store placed as `to` (filled with generation 99 first) and expects every state back.
void round_trip(const Placing& from, const Placing& to, const std::string& dir, Rig* src) {
  ASSERT_TRUE(src->init(from, dir + "/swap-a").is_ok());
  ASSERT_TRUE(src->fill(7).is_ok());
  const std::string ckpt = dir + "/ckpt";
  auto saved = save_checkpoint(*src->store, state_at(5), "{}", save_options(ckpt));
  ASSERT_TRUE(saved.is_ok()) << saved.status().to_string();
  ASSERT_TRUE(verify(ckpt, *src->io).is_ok());
  Rig dst;
  ASSERT_TRUE(dst.init(to, dir + "/swap-b").is_ok());
  ASSERT_TRUE(dst.fill(99).is_ok());
  Status s = load(ckpt, dst);
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq, StateKind::kCompute})
    EXPECT_TRUE(src->gather(kind) == dst.gather(kind)) << state_name(kind);
}

// 8-bit moments (zoffload.moment_dtype): the codes and absmax of every param come back whatever the
// placement and sub-group size of the loading store; the files are what docs/checkpoint_format.md says.
TEST(Checkpoint, EightBitMomentsRoundTripAcrossPlacementsAndSubGroupSizes) {
  const std::vector<std::pair<Placing, Placing>> pairs = {
      {{.optimizer = "nvme", .param = "nvme", .moments = "8bit"},
       {.optimizer = "cpu", .param = "cpu", .sub_group_size = 4096, .moments = "8bit"}},
      {{.optimizer = "cpu", .param = "cpu", .sub_group_size = 20000, .moments = "8bit"},
       {.optimizer = "nvme", .param = "cpu", .sub_group_size = 12288, .moments = "8bit"}}};
  for (const auto& [from, to] : pairs) {
    SCOPED_TRACE(from.optimizer + " " + std::to_string(from.sub_group_size));
    TempDir dir;
    Rig src;
    const std::string ckpt = dir.path + "/ckpt";
    round_trip(from, to, dir.path, &src);
    if (HasFatalFailure()) return;

    // The files: exp_avg.safetensors lists the map, then NAME.absmax (≥ 4096 elements) or NAME;
    // exp_avg.codes is one byte per element of the quantized params, in order.
    auto info = open_checkpoint(ckpt + "/step-5", io::Env::posix());
    ASSERT_TRUE(info.is_ok()) << info.status().to_string();
    EXPECT_EQ(info->manifest.moments, MomentDtype::k8bit);
    auto st = SafetensorsFile::open(ckpt + "/step-5/exp_avg.safetensors", io::Env::posix());
    ASSERT_TRUE(st.is_ok()) << st.status().to_string();
    EXPECT_EQ((*st)->metadata().at("zoffload_moment_dtype"), "8bit");
    EXPECT_EQ((*st)->tensors().front().name, "zoffload.qmap");
    std::vector<float> map(256);
    ASSERT_TRUE((*st)->read_f32((*st)->tensors().front(), 0, map).is_ok());
    EXPECT_EQ(map.front(), -0.99296875f);  // bitsandbytes' signed map, ascending, ends at 1
    EXPECT_EQ(map.back(), 1.0f);
    uint64_t quantized = 0;
    for (const ParamInfo& p : src.registry.params()) {
      const SafetensorsTensor* a = (*st)->find(p.n_elems >= 4096 ? p.name + ".absmax" : p.name);
      ASSERT_NE(a, nullptr) << p.name;
      EXPECT_EQ(a->n_elems, p.n_elems >= 4096 ? (p.n_elems + 255) / 256 : p.n_elems) << p.name;
      if (p.n_elems >= 4096) quantized += p.n_elems;
    }
    EXPECT_EQ(fs::file_size(ckpt + "/step-5/exp_avg.codes"), quantized);
    EXPECT_EQ(fs::file_size(ckpt + "/step-5/exp_avg_sq.codes"), quantized);
  }
}

// bf16 moments: the moments come back whatever the placement and sub-group size, and the files
// list them as BF16 tensors of the parameters' shapes (docs/checkpoint_format.md).
TEST(Checkpoint, Bf16MomentsRoundTripAcrossPlacementsAndSubGroupSizes) {
  TempDir dir;
  Rig src;
  const std::string ckpt = dir.path + "/ckpt";
  round_trip({.optimizer = "nvme", .param = "nvme", .moments = "bf16"},
             {.optimizer = "cpu", .param = "cpu", .sub_group_size = 12288, .moments = "bf16"}, dir.path, &src);
  if (HasFatalFailure()) return;
  auto info = open_checkpoint(ckpt + "/step-5", io::Env::posix());
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  EXPECT_EQ(info->manifest.moments, MomentDtype::kBF16);
  for (const char* file : {"exp_avg.safetensors", "exp_avg_sq.safetensors"}) {
    auto st = SafetensorsFile::open(ckpt + "/step-5/" + file, io::Env::posix());
    ASSERT_TRUE(st.is_ok()) << st.status().to_string();
    EXPECT_EQ((*st)->metadata().at("zoffload_moment_dtype"), "bf16");
    ASSERT_EQ((*st)->tensors().size(), src.registry.params().size());
    for (const ParamInfo& p : src.registry.params()) {
      const SafetensorsTensor* t = (*st)->find(p.name);
      ASSERT_NE(t, nullptr) << p.name;
      EXPECT_EQ(t->dtype, DType::kBF16) << p.name;
      EXPECT_EQ(t->n_elems, p.n_elems) << p.name;
    }
  }
  auto master = SafetensorsFile::open(ckpt + "/step-5/master.safetensors", io::Env::posix());
  ASSERT_TRUE(master.is_ok());
  EXPECT_EQ((*master)->tensors().front().dtype, DType::kF32);
}

// A checkpoint resumes only with the moment dtype it was saved with, and says so.
TEST(Checkpoint, LoadRefusesAnotherMomentDtype) {
  for (const auto& [saved_as, loaded_as] :
       {std::pair{"8bit", "fp32"}, std::pair{"fp32", "8bit"}, std::pair{"bf16", "fp32"}, std::pair{"bf16", "8bit"}}) {
    TempDir dir;
    Rig src;
    ASSERT_TRUE(src.init({.optimizer = "cpu", .moments = saved_as}, dir.path + "/swap-a").is_ok());
    ASSERT_TRUE(src.fill(1).is_ok());
    ASSERT_TRUE(save_checkpoint(*src.store, state_at(2), "{}", save_options(dir.path + "/c")).is_ok());
    Rig dst;
    ASSERT_TRUE(dst.init({.optimizer = "cpu", .moments = loaded_as}, dir.path + "/swap-b").is_ok());
    Status s = load(dir.path + "/c", dst);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr(std::string("moments in ") + saved_as));
    EXPECT_THAT(s.message(), HasSubstr("zoffload.moment_dtype"));
  }
}

TEST(Checkpoint, StateFilesAreSafetensorsWithHfNames) {
  TempDir dir;
  Rig rig;
  ASSERT_TRUE(rig.init({}, dir.path + "/swap").is_ok());
  ASSERT_TRUE(rig.fill(3).is_ok());
  ASSERT_TRUE(save_checkpoint(*rig.store, state_at(1), "{}", save_options(dir.path)).is_ok());
  auto st = SafetensorsFile::open(dir.path + "/step-1/master.safetensors", io::Env::posix());
  ASSERT_TRUE(st.is_ok()) << st.status().to_string();
  EXPECT_EQ((*st)->metadata().at("format"), "pt");
  EXPECT_EQ((*st)->tensors().front().data_offset_bytes % 4096, 0u);
  const ParamInfo& p = rig.registry.params()[1];
  const SafetensorsTensor* t = (*st)->find(p.name);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->shape, p.shape);
  std::vector<float> got(100);
  ASSERT_TRUE((*st)->read_f32(*t, 6000, got).is_ok());
  const uint64_t flat = rig.registry.pieces_of_param(1)[0].group_offset +
                        rig.registry.sub_groups()[rig.registry.pieces_of_param(1)[0].sub_group].first_elem;
  for (uint64_t i = 0; i < got.size(); ++i)
    EXPECT_EQ(got[i], testing::rig_value(3, StateKind::kMaster, flat + 6000 + i));
}

TEST(Checkpoint, LatestPruningAndStaleTmpDirectories) {
  TempDir dir;
  Rig rig;
  ASSERT_TRUE(rig.init({}, dir.path + "/swap").is_ok());
  const std::string ckpt = dir.path + "/ckpt";
  std::vector<SavePhase> phases;
  for (uint64_t step : {2, 4, 6, 8}) {
    ASSERT_TRUE(rig.fill(step).is_ok());
    SaveOptions o = save_options(ckpt, 2);
    o.on_phase = [&](SavePhase p) { phases.push_back(p); };
    auto r = save_checkpoint(*rig.store, state_at(step), "{}", o);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_EQ(read_file(ckpt + "/latest"), "step-" + std::to_string(step) + "\n");
  }
  EXPECT_FALSE(fs::exists(ckpt + "/step-2"));
  EXPECT_FALSE(fs::exists(ckpt + "/step-4"));
  EXPECT_TRUE(fs::exists(ckpt + "/step-6"));
  EXPECT_EQ(resolve_checkpoint(ckpt, io::Env::posix()).value(), ckpt + "/step-8");
  EXPECT_THAT(phases, ::testing::Contains(SavePhase::kPruned));
  EXPECT_EQ(phases.front(), SavePhase::kStarted);
  // The same step again (a resumed run re-saving it) replaces it atomically with the new states.
  ASSERT_TRUE(rig.fill(80).is_ok());
  auto again = save_checkpoint(*rig.store, state_at(8), "{}", save_options(ckpt));
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  {
    Rig back;
    ASSERT_TRUE(back.init({}, dir.path + "/swap-back").is_ok());
    ASSERT_TRUE(load(ckpt, back).is_ok());
    EXPECT_TRUE(back.gather(StateKind::kMaster) == rig.gather(StateKind::kMaster));
  }
  EXPECT_EQ(read_file(ckpt + "/latest"), "step-8\n");
  for (const auto& e : fs::directory_iterator(ckpt)) EXPECT_NE(e.path().filename().string().rfind("tmp-", 0), 0u);
  // keep_last 0 keeps all.
  ASSERT_TRUE(save_checkpoint(*rig.store, state_at(9), "{}", save_options(ckpt, 0)).is_ok());
  EXPECT_TRUE(fs::exists(ckpt + "/step-6") && fs::exists(ckpt + "/step-8"));

  // What a killed save leaves is removed at the next start; checkpoints stay, and so do a user's
  // entries that only start like a save's temporaries (issue 40: nothing this run did not create).
  fs::create_directories(ckpt + "/tmp-10-0123abcd89abcdef");
  std::ofstream(ckpt + "/tmp-10-0123abcd89abcdef/master.safetensors") << "partial";
  std::ofstream(ckpt + "/latest.tmp-feedbeef01234567") << "step-10\n";
  fs::create_directories(ckpt + "/tmp-notes");
  std::ofstream(ckpt + "/tmp-notes/keep.txt") << "mine\n";
  std::ofstream(ckpt + "/latest.tmp-mine") << "mine\n";
  auto removed = clean_stale_checkpoints(ckpt, io::Env::posix());
  ASSERT_TRUE(removed.is_ok());
  EXPECT_EQ(removed->size(), 2u);
  EXPECT_FALSE(fs::exists(ckpt + "/tmp-10-0123abcd89abcdef"));
  EXPECT_FALSE(fs::exists(ckpt + "/latest.tmp-feedbeef01234567"));
  EXPECT_TRUE(fs::exists(ckpt + "/tmp-notes/keep.txt") && fs::exists(ckpt + "/latest.tmp-mine"));
  fs::remove_all(ckpt + "/tmp-notes");
  fs::remove(ckpt + "/latest.tmp-mine");
  EXPECT_TRUE(fs::exists(ckpt + "/step-9/manifest.json"));
  EXPECT_TRUE(clean_stale_checkpoints(dir.path + "/nowhere", io::Env::posix()).is_ok());

  // A run resumed from an older checkpoint saves step-7: the steps beyond it (step-8, step-9, of
  // the run it branched from) are pruned, and keep_last counts the steps before it.
  auto branched = save_checkpoint(*rig.store, state_at(7), "{}", save_options(ckpt, 2));
  ASSERT_TRUE(branched.is_ok()) << branched.status().to_string();
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(ckpt)) names.push_back(e.path().filename().string());
  EXPECT_THAT(names, ::testing::UnorderedElementsAre("latest", "step-6", "step-7"));
  EXPECT_THAT(branched->pruned, ::testing::UnorderedElementsAre("step-8", "step-9"));
}

TEST(Checkpoint, ResolveNamesWhatIsWrong) {
  TempDir dir;
  EXPECT_EQ(resolve_checkpoint(dir.path + "/missing", io::Env::posix()).status().code(), StatusCode::kNotFound);
  EXPECT_THAT(resolve_checkpoint(dir.path, io::Env::posix()).status().message(), HasSubstr("neither manifest.json"));
  std::ofstream(dir.path + "/latest") << "../../etc\n";
  EXPECT_EQ(resolve_checkpoint(dir.path, io::Env::posix()).status().code(), StatusCode::kCorruption);
  std::ofstream(dir.path + "/latest") << "step-3\n";
  fs::create_directories(dir.path + "/step-3");
  EXPECT_THAT(resolve_checkpoint(dir.path, io::Env::posix()).status().message(), HasSubstr("no manifest.json"));
  EXPECT_THAT(resolve_checkpoint(dir.path + "/step-3/", io::Env::posix()).status().message(),
              HasSubstr("incomplete save"));
  // Issue 19, finding 5: a `latest` holding (or linking to) a long file with NUL bytes was echoed
  // whole; the error quotes a bounded, escaped excerpt.
  std::string junk;
  for (int i = 0; i < 24; ++i)
    junk += "line " + std::to_string(i) + std::string(1, '\0') + " of a file that is not ours\n";
  std::ofstream(dir.path + "/latest", std::ios::binary | std::ios::trunc) << junk;
  const std::string message = resolve_checkpoint(dir.path, io::Env::posix()).status().message();
  EXPECT_THAT(message, HasSubstr("names \"line 0\\x00 of a file"));
  EXPECT_THAT(message, HasSubstr("bytes)"));
  EXPECT_EQ(message.find('\0'), std::string::npos);
  EXPECT_LT(message.size(), dir.path.size() + 200);
  // A `latest` of 64 MiB + 1 (sparse: never read, refused by its size) is corruption, not a bad
  // argument: no save writes one.
  fs::resize_file(dir.path + "/latest", (uint64_t{64} << 20) + 1);
  const Status huge = resolve_checkpoint(dir.path, io::Env::posix()).status();
  EXPECT_EQ(huge.code(), StatusCode::kCorruption) << huge.to_string();
  EXPECT_THAT(huge.message(), HasSubstr(dir.path + "/latest is 67108865 bytes, over the 67108864-byte limit"));
}

// Issue 19, finding 8: a manifest naming one file (or tensor) twice was accepted, so the second
// entry's size and checksums were never the ones checked.
TEST(Checkpoint, AManifestNamingAFileOrTensorTwiceIsCorruption) {
  Manifest m;
  m.step = 3;
  m.files.push_back({.name = "master.safetensors", .size_bytes = 8, .chunk_bytes = 8, .chunk_crc32c = {0x12345678u}});
  m.tensors.push_back({.name = "w", .shape = {2}, .n_elems = 2});
  ASSERT_TRUE(Manifest::from_json(m.to_json(), "m.json").is_ok());
  Manifest twice_file = m;
  twice_file.files.push_back(m.files[0]);
  const Status f = Manifest::from_json(twice_file.to_json(), "m.json").status();
  EXPECT_EQ(f.code(), StatusCode::kCorruption);
  EXPECT_THAT(f.message(), HasSubstr("file entry \"master.safetensors\" appears twice"));
  Manifest twice_tensor = m;
  twice_tensor.tensors.push_back(m.tensors[0]);
  const Status t = Manifest::from_json(twice_tensor.to_json(), "m.json").status();
  EXPECT_EQ(t.code(), StatusCode::kCorruption);
  EXPECT_THAT(t.message(), HasSubstr("tensor \"w\" appears twice"));
}

// Rewrites DIR/trainer_state.json as `state` and its manifest entry to match (size and CRC-32C), as
// a hand edit or a tool that knows the format would: only the reader's checks of the values stand
// between the file and a run.
void rewrite_trainer_state(const std::string& dir, const nlohmann::json& state) {
  const std::string text = state.dump(2) + "\n";
  std::ofstream(dir + "/trainer_state.json", std::ios::binary | std::ios::trunc) << text;
  nlohmann::json manifest = nlohmann::json::parse(read_file(dir + "/manifest.json"));
  char crc[9];
  std::snprintf(crc, sizeof crc, "%08x", crc32c(text.data(), text.size()));
  int rewritten = 0;
  for (nlohmann::json& f : manifest["files"]) {
    if (f["name"] != "trainer_state.json") continue;
    f["size_bytes"] = text.size();
    f["crc32c"] = {crc};
    ++rewritten;
  }
  ASSERT_EQ(rewritten, 1);
  std::ofstream(dir + "/manifest.json", std::ios::binary | std::ios::trunc) << manifest.dump(2) << "\n";
}

// Issue 40: trainer_state.json's counters were read with nlohmann's get<uint64_t>(), which takes
// -1 as 2^64 - 1, casts 1e30 out of range and reads true as 1, and world_size 0 was accepted. Each
// is refused at open (what --resume, ckpt verify, ckpt inspect and export use), naming the key.
TEST(Checkpoint, TrainerStateCountersMustBeWholeNumbersInRange) {
  TempDir dir;
  Rig rig;
  ASSERT_TRUE(rig.init({.optimizer = "cpu", .param = "cpu"}, dir.path + "/swap").is_ok());
  ASSERT_TRUE(rig.fill(4).is_ok());
  const std::string step = dir.path + "/ckpt/step-5";
  ASSERT_TRUE(save_checkpoint(*rig.store, state_at(5), "{}", save_options(dir.path + "/ckpt")).is_ok());
  const nlohmann::json saved = nlohmann::json::parse(read_file(step + "/trainer_state.json"));
  ASSERT_EQ(saved.at("steps_done"), 5);

  struct Case {
    std::string pointer;  // the field, as a JSON pointer
    nlohmann::json value;
    std::string message;  // after "STEP/trainer_state.json: "
  };
  const uint64_t max_u64 = UINT64_MAX;
  const std::vector<Case> cases = {
      {"/world_size", 0, "world_size: 0 is not a whole number in [1, 2^64)"},
      {"/steps_done", -1, "steps_done: -1 is not a whole number in [0, 2^64)"},
      {"/steps_done", 1e30, "steps_done: 1e+30 is not a whole number in [0, 2^64)"},
      {"/steps_done", "5", "steps_done: \"5\" is not a whole number in [0, 2^64)"},
      {"/steps_done", 5.0, "steps_done: 5.0 is not a whole number in [0, 2^64)"},
      {"/optimizer_steps", true, "optimizer_steps: true is not a whole number in [0, 2^64)"},
      {"/seed", nullptr, "seed: null is not a whole number in [0, 2^64)"},
      {"/seq_len", -128, "seq_len: -128 is not a whole number in [0, 2^64)"},
      {"/data_position/index", 2.5, "data_position.index: 2.5 is not a whole number in [0, 2^64)"},
      {"/data_position/epoch", -3, "data_position.epoch: -3 is not a whole number in [0, 2^64)"},
      {"/loss_scaler/cur_iter", -5, "loss_scaler.cur_iter: -5 is not a whole number in [0, 2^64)"},
      {"/loss_scaler/last_overflow_iter", -2, "loss_scaler.last_overflow_iter: -2 is not a whole number in [-1, 2^63)"},
      {"/loss_scaler/last_overflow_iter", max_u64,
       "loss_scaler.last_overflow_iter: 18446744073709551615 is not a whole number in [-1, 2^63)"},
      {"/loss_scaler/cur_hysteresis", 0, "loss_scaler.cur_hysteresis: 0 is not a whole number in [1, 2^64)"},
      {"/loss_scaler/cur_scale", 0, "loss_scaler.cur_scale: 0 is not a finite number > 0"},
      {"/loss_scaler/cur_scale", "2048", "loss_scaler.cur_scale: \"2048\" is not a finite number > 0"},
      {"/loss_scaler", 7, "loss_scaler: 7 is not an object"},
      {"/model", 12, "model: 12 is not a string"},
  };
  Rig dst;
  ASSERT_TRUE(dst.init({.optimizer = "nvme", .param = "nvme"}, dir.path + "/swap2").is_ok());
  for (const Case& c : cases) {
    SCOPED_TRACE(c.pointer + " = " + c.value.dump());
    const std::string copy = dir.path + "/bad";
    fs::remove_all(copy);
    fs::copy(step, copy);
    nlohmann::json state = saved;
    state[nlohmann::json::json_pointer(c.pointer)] = c.value;
    rewrite_trainer_state(copy, state);
    const Status open = open_checkpoint(copy, io::Env::posix()).status();
    EXPECT_EQ(open.code(), StatusCode::kCorruption);
    EXPECT_EQ(open.message(), copy + "/trainer_state.json: " + c.message);
    const Status loaded = load(copy, dst);
    EXPECT_EQ(loaded.code(), StatusCode::kCorruption);
    EXPECT_THAT(loaded.message(), HasSubstr("trainer_state.json: " + c.message));
  }

  // The edit itself is sound: values at the edges of their ranges, and no world_size (a checkpoint
  // from before data parallel: 1 rank), load.
  nlohmann::json edge = saved;
  edge["seed"] = max_u64;
  edge["seq_len"] = 0;
  edge["optimizer_steps"] = 0;
  edge["loss_scaler"]["last_overflow_iter"] = -1;
  edge["loss_scaler"]["cur_scale"] = 1;
  edge.erase("world_size");
  const std::string copy = dir.path + "/edge";
  fs::copy(step, copy);
  rewrite_trainer_state(copy, edge);
  auto info = open_checkpoint(copy, io::Env::posix());
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  EXPECT_EQ(info->state.seed, max_u64);
  EXPECT_EQ(info->state.world_size, 1u);
  EXPECT_EQ(info->state.loss_scaler.last_overflow_iter, -1);
  EXPECT_EQ(info->state.loss_scaler.cur_scale, 1.0);
  const Status loaded = load(copy, dst);
  ASSERT_TRUE(loaded.is_ok()) << loaded.to_string();
  EXPECT_TRUE(rig.gather(StateKind::kMaster) == dst.gather(StateKind::kMaster));
}

TEST(Checkpoint, AFlippedByteInAnyFileIsCaughtByVerifyAndLoad) {
  TempDir dir;
  Rig rig;
  ASSERT_TRUE(rig.init({.optimizer = "nvme", .param = "nvme"}, dir.path + "/swap").is_ok());
  ASSERT_TRUE(rig.fill(5).is_ok());
  const std::string good = dir.path + "/good";
  ASSERT_TRUE(save_checkpoint(*rig.store, state_at(3), "{\"hidden_size\": 8}", save_options(good)).is_ok());
  const std::string step = good + "/step-3";
  auto info = open_checkpoint(step, io::Env::posix());
  ASSERT_TRUE(info.is_ok());
  int checked = 0;
  for (const FileDigest& f : info->manifest.files) {
    // A byte in the header or start, one in the middle, the last byte.
    for (uint64_t off : {uint64_t{9}, f.size_bytes / 2, f.size_bytes - 1}) {
      SCOPED_TRACE(f.name + " @" + std::to_string(off));
      const std::string copy = dir.path + "/copy";
      fs::remove_all(copy);
      fs::copy(step, copy);
      flip_byte(copy + "/" + f.name, off);
      Status v = verify(copy, *rig.io);
      EXPECT_FALSE(v.is_ok());
      Rig dst;
      ASSERT_TRUE(dst.init({.optimizer = "cpu", .param = "cpu"}, dir.path + "/swap2").is_ok());
      Status l = load(copy, dst);
      EXPECT_FALSE(l.is_ok());
      if (!v.is_ok()) { EXPECT_THAT(v.to_string(), HasSubstr(f.name)); }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 15);
  // The manifest itself, flipped: refused at open.
  const std::string copy = dir.path + "/copy-manifest";
  fs::copy(step, copy);
  flip_byte(copy + "/manifest.json", 20);
  EXPECT_FALSE(open_checkpoint(copy, io::Env::posix()).is_ok());
  // No manifest: an incomplete save, never loaded.
  const std::string partial = dir.path + "/partial";
  fs::copy(step, partial);
  fs::remove(partial + "/manifest.json");
  EXPECT_THAT(open_checkpoint(partial, io::Env::posix()).status().message(), HasSubstr("no manifest.json"));
  // A truncated state file is caught by size before anything is read.
  const std::string cut = dir.path + "/cut";
  fs::copy(step, cut);
  fs::resize_file(cut + "/exp_avg.safetensors", fs::file_size(cut + "/exp_avg.safetensors") - 4);
  EXPECT_THAT(open_checkpoint(cut, io::Env::posix()).status().message(), HasSubstr("exp_avg.safetensors"));
  // The original still verifies.
  EXPECT_TRUE(verify(step, *rig.io).is_ok());
}

TEST(Checkpoint, LoadRefusesAnotherModel) {
  TempDir dir;
  Rig a, b;
  ASSERT_TRUE(a.init({}, dir.path + "/swap-a").is_ok());
  ASSERT_TRUE(b.init({}, dir.path + "/swap-b", /*scale=*/2).is_ok());
  ASSERT_TRUE(save_checkpoint(*a.store, state_at(1), "{}", save_options(dir.path + "/c")).is_ok());
  Status s = load(dir.path + "/c", b);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("model.embed_tokens.weight"));
}

// ENOSPC or EIO at several points of a save: a clear error naming the file, no step directory, no
// tmp left, `latest` and the previous checkpoint intact, the store unchanged.
TEST(Checkpoint, FaultsDuringASaveLoseNothing) {
  struct Case {
    io::FaultKind kind;
    std::string file;
    uint64_t offset;
  };
  const std::vector<Case> cases = {{io::FaultKind::kNoSpace, "master.safetensors", 0},
                                   {io::FaultKind::kNoSpace, "exp_avg_sq.safetensors", 65536},
                                   {io::FaultKind::kEio, "exp_avg.safetensors", 4096},
                                   {io::FaultKind::kEio, "optimizer.swp", 0}};  // reading the swap file
  for (const Case& c : cases) {
    SCOPED_TRACE(c.file);
    TempDir dir;
    Rig rig;
    ASSERT_TRUE(rig.init({.optimizer = "nvme", .param = "nvme"}, dir.path + "/swap").is_ok());
    ASSERT_TRUE(rig.fill(1).is_ok());
    const std::string ckpt = dir.path + "/ckpt";
    ASSERT_TRUE(save_checkpoint(*rig.store, state_at(1), "{}", save_options(ckpt)).is_ok());
    ASSERT_TRUE(rig.fill(2).is_ok());
    const auto before_master = rig.gather(StateKind::kMaster);
    const auto before_v = rig.gather(StateKind::kExpAvgSq);

    const uint64_t injected = rig.faults->injected();
    rig.faults->add({.kind = c.kind,
                     .op = c.file == "optimizer.swp" ? io::IoOp::kRead : io::IoOp::kWrite,
                     .path_contains = c.file,
                     .offset_bytes = c.offset,
                     .times = 1});
    auto r = save_checkpoint(*rig.store, state_at(2), "{}", save_options(ckpt));
    ASSERT_FALSE(r.is_ok());
    EXPECT_GT(rig.faults->injected(), injected);
    EXPECT_THAT(r.status().to_string(), HasSubstr(c.file));
    EXPECT_THAT(r.status().to_string(), HasSubstr("step-2"));
    if (c.kind == io::FaultKind::kNoSpace) { EXPECT_EQ(r.status().code(), StatusCode::kNoSpace); }
    rig.faults->clear();

    EXPECT_FALSE(fs::exists(ckpt + "/step-2"));
    for (const auto& e : fs::directory_iterator(ckpt))
      EXPECT_THAT(e.path().filename().string(), ::testing::Not(HasSubstr("tmp")));
    EXPECT_EQ(read_file(ckpt + "/latest"), "step-1\n");
    EXPECT_TRUE(verify(ckpt, *rig.io).is_ok());
    EXPECT_TRUE(rig.gather(StateKind::kMaster) == before_master);
    EXPECT_TRUE(rig.gather(StateKind::kExpAvgSq) == before_v);
    // And the next save works.
    EXPECT_TRUE(save_checkpoint(*rig.store, state_at(2), "{}", save_options(ckpt)).is_ok());
    EXPECT_EQ(read_file(ckpt + "/latest"), "step-2\n");
  }
}

// The file operations around the commit (issue 19), failed through io::FaultyEnv: ENOSPC writing
// each small file, a failed open of a state file (EIO, ENOSPC: creating it), a failed fsync of the
// tmp directory and a failed rename into place lose nothing
// (as above); a failed fsync of the checkpoint directory after the rename, and a failed update of
// `latest`, report the save as failed while `latest` still names the previous checkpoint, which
// verifies; the next save of the same step then replaces the renamed directory and succeeds.
TEST(Checkpoint, FileOperationFaultsAroundTheCommitLoseNothing) {
  struct Case {
    const char* name;
    io::FaultRule rule;  // path_contains is relative to the checkpoint directory
    bool after_rename;   // step-2 is in place, `latest` is not updated
    StatusCode code;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"manifest ENOSPC",
       {.kind = io::FaultKind::kNoSpace, .op = io::IoOp::kWrite, .path_contains = "/manifest.json"},
       false,
       StatusCode::kNoSpace,
       "manifest.json"},
      {"trainer_state ENOSPC",
       {.kind = io::FaultKind::kNoSpace, .op = io::IoOp::kWrite, .path_contains = "/trainer_state.json"},
       false,
       StatusCode::kNoSpace,
       "trainer_state.json"},
      {"config ENOSPC",
       {.kind = io::FaultKind::kNoSpace, .op = io::IoOp::kWrite, .path_contains = "/config.json"},
       false,
       StatusCode::kNoSpace,
       "config.json"},
      {"state file open",
       {.kind = io::FaultKind::kEio, .op = io::IoOp::kOpen, .path_contains = "/exp_avg.safetensors"},
       false,
       StatusCode::kIoError,
       "exp_avg.safetensors (injected)"},
      {"state file open ENOSPC",
       {.kind = io::FaultKind::kNoSpace, .op = io::IoOp::kOpen, .path_contains = "/master.safetensors"},
       false,
       StatusCode::kNoSpace,
       "master.safetensors (injected)"},
      {"manifest fdatasync",
       {.kind = io::FaultKind::kEio, .op = io::IoOp::kSync, .path_contains = "/manifest.json"},
       false,
       StatusCode::kIoError,
       "fdatasync of"},
      // After the three small files' fdatasyncs (passed), the tmp directory's fsync.
      {"tmp directory fsync",
       {.kind = io::FaultKind::kEio, .op = io::IoOp::kSync, .path_contains = "/tmp-2-", .skip = 3},
       false,
       StatusCode::kIoError,
       "fsync of directory"},
      {"rename into place",
       {.kind = io::FaultKind::kEio, .op = io::IoOp::kRename, .path_contains = "-> CKPT/step-2"},
       false,
       StatusCode::kIoError,
       "renaming"},
      // Syncs under CKPT, in order: trainer_state.json, config.json, manifest.json, the tmp
      // directory (all passed), then the checkpoint directory after the rename (failed).
      {"directory fsync after the rename",
       {.kind = io::FaultKind::kEio, .op = io::IoOp::kSync, .path_contains = "CKPT", .skip = 4},
       true,
       StatusCode::kIoError,
       "fsync of directory CKPT"},
      {"latest.tmp ENOSPC",
       {.kind = io::FaultKind::kNoSpace, .op = io::IoOp::kWrite, .path_contains = "/latest.tmp-"},
       true,
       StatusCode::kNoSpace,
       "updating latest"},
      {"latest rename",
       {.kind = io::FaultKind::kEio, .op = io::IoOp::kRename, .path_contains = "-> CKPT/latest"},
       true,
       StatusCode::kIoError,
       "updating latest"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TempDir dir;
    Rig rig;
    ASSERT_TRUE(rig.init({.optimizer = "cpu"}, dir.path + "/swap").is_ok());
    ASSERT_TRUE(rig.fill(1).is_ok());
    const std::string ckpt = dir.path + "/ckpt";
    io::FaultyEnv env(io::Env::posix(), rig.faults);
    SaveOptions o = save_options(ckpt);
    o.env = &env;
    ASSERT_TRUE(save_checkpoint(*rig.store, state_at(1), "{}", o).is_ok());
    ASSERT_TRUE(rig.fill(2).is_ok());
    const auto before = rig.gather(StateKind::kMaster);

    io::FaultRule rule = c.rule;
    if (const size_t at = rule.path_contains.find("CKPT"); at != std::string::npos)
      rule.path_contains.replace(at, 4, ckpt);
    rig.faults->add(rule);
    auto r = save_checkpoint(*rig.store, state_at(2), "{}", o);
    ASSERT_FALSE(r.is_ok());
    EXPECT_EQ(rig.faults->injected(), 1u);
    EXPECT_EQ(r.status().code(), c.code) << r.status().to_string();
    std::string says = c.says;
    if (const size_t at = says.find("CKPT"); at != std::string::npos) says.replace(at, 4, ckpt);
    EXPECT_THAT(r.status().to_string(), HasSubstr(says));
    EXPECT_THAT(r.status().to_string(), HasSubstr("step-2"));
    rig.faults->clear();

    EXPECT_EQ(fs::exists(ckpt + "/step-2"), c.after_rename);
    for (const auto& e : fs::directory_iterator(ckpt))
      EXPECT_THAT(e.path().filename().string(), ::testing::Not(HasSubstr("tmp")));
    EXPECT_EQ(read_file(ckpt + "/latest"), "step-1\n");
    EXPECT_TRUE(verify(ckpt, *rig.io).is_ok()) << "the previous checkpoint, which `latest` names, is whole";
    EXPECT_TRUE(rig.gather(StateKind::kMaster) == before);
    // The next save of the same step replaces whatever the failed one left.
    ASSERT_TRUE(save_checkpoint(*rig.store, state_at(2), "{}", o).is_ok());
    EXPECT_EQ(read_file(ckpt + "/latest"), "step-2\n");
    EXPECT_TRUE(verify(ckpt, *rig.io).is_ok());
  }
}

// Reads fail too (issue 19): opening, verifying and loading read through the Env (the small files,
// the safetensors headers, the tail of each state file) and the I/O engine (the state files' 4 KiB
// blocks), both faulted by the same rules. EIO on the small files fails the open naming the file;
// EIO on the last byte of each state file fails verify and load naming that file, never silently.
TEST(Checkpoint, ReadFaultsNameTheFileAndNeverLoadSilently) {
  TempDir dir;
  Rig rig;
  ASSERT_TRUE(rig.init({.optimizer = "cpu"}, dir.path + "/swap").is_ok());
  ASSERT_TRUE(rig.fill(1).is_ok());
  const std::string ckpt = dir.path + "/ckpt";
  ASSERT_TRUE(save_checkpoint(*rig.store, state_at(1), "{\"hidden_size\": 8}", save_options(ckpt)).is_ok());
  const std::string step = ckpt + "/step-1";
  io::FaultyEnv env(io::Env::posix(), rig.faults);
  for (const char* name : {"latest"}) {
    rig.faults->add({.kind = io::FaultKind::kEio, .op = io::IoOp::kRead, .path_contains = std::string("/") + name});
    Status s = resolve_checkpoint(ckpt, &env).status();
    EXPECT_EQ(s.code(), StatusCode::kIoError) << s.to_string();
    EXPECT_THAT(s.message(), HasSubstr("reading " + ckpt + "/" + name + " at offset 0"));
    rig.faults->clear();
  }
  for (const char* name : {"manifest.json", "trainer_state.json", "config.json", "exp_avg.safetensors"}) {
    SCOPED_TRACE(name);
    const uint64_t before = rig.faults->injected();
    rig.faults->add({.kind = io::FaultKind::kEio, .op = io::IoOp::kRead, .path_contains = std::string("/") + name});
    Status s = open_checkpoint(step, &env).status();
    EXPECT_EQ(s.code(), StatusCode::kIoError) << s.to_string();
    EXPECT_THAT(s.message(), HasSubstr(step + "/" + name));
    EXPECT_EQ(rig.faults->injected() - before, 1u);
    rig.faults->clear();
  }
  auto info = open_checkpoint(step, &env);
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  const uint64_t injected_before = rig.faults->injected();
  for (StateKind kind : kSavedStates) {
    const std::string name = state_file_name(kind);
    SCOPED_TRACE(name);
    const FileDigest* f = info->manifest.find(name);
    ASSERT_NE(f, nullptr);
    Buffers b;
    rig.faults->add({.kind = io::FaultKind::kEio,
                     .op = io::IoOp::kRead,
                     .path_contains = "/" + name,
                     .offset_bytes = f->size_bytes - 1});
    Status v = verify_checkpoint(*info, *rig.io, b.staging.bytes(), &env);
    EXPECT_EQ(v.code(), StatusCode::kIoError) << v.to_string();
    EXPECT_THAT(v.message(), HasSubstr(step + "/" + name));
    rig.faults->add({.kind = io::FaultKind::kEio,
                     .op = io::IoOp::kRead,
                     .path_contains = "/" + name,
                     .offset_bytes = f->size_bytes - 1});
    Rig dst;
    ASSERT_TRUE(dst.init({.optimizer = "cpu"}, dir.path + "/swap-" + name).is_ok());
    Status l = load_checkpoint(*info, *dst.store, *rig.io, b.staging.bytes(), &env);
    EXPECT_EQ(l.code(), StatusCode::kIoError) << l.to_string();
    EXPECT_THAT(l.message(), HasSubstr(step + "/" + name));
    rig.faults->clear();
  }
  EXPECT_EQ(rig.faults->injected() - injected_before, 6u) << "each read fault was met once";
  EXPECT_TRUE(verify(ckpt, *rig.io).is_ok()) << "the checkpoint itself is whole";
}

// Opening a state file to verify or load it goes through the Env too: a fault there fails both,
// naming the file.
TEST(Checkpoint, AFaultOpeningAStateFileFailsVerifyAndLoadNamingIt) {
  TempDir dir;
  Rig rig;
  ASSERT_TRUE(rig.init({.optimizer = "cpu"}, dir.path + "/swap").is_ok());
  ASSERT_TRUE(rig.fill(1).is_ok());
  const std::string ckpt = dir.path + "/ckpt";
  ASSERT_TRUE(save_checkpoint(*rig.store, state_at(1), "{}", save_options(ckpt)).is_ok());
  const std::string step = ckpt + "/step-1";
  io::FaultyEnv env(io::Env::posix(), rig.faults);
  auto info = open_checkpoint(step, &env);
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  const std::string victim = step + "/" + state_file_name(StateKind::kExpAvgSq);
  Buffers b;
  rig.faults->add({.kind = io::FaultKind::kEio, .op = io::IoOp::kOpen, .path_contains = victim});
  Status v = verify_checkpoint(*info, *rig.io, b.staging.bytes(), &env);
  EXPECT_EQ(v.code(), StatusCode::kIoError) << v.to_string();
  EXPECT_THAT(v.message(), HasSubstr("open " + victim + " (injected)"));
  rig.faults->add({.kind = io::FaultKind::kEio, .op = io::IoOp::kOpen, .path_contains = victim});
  Rig dst;
  ASSERT_TRUE(dst.init({.optimizer = "cpu"}, dir.path + "/swap-dst").is_ok());
  Status l = load_checkpoint(*info, *dst.store, *rig.io, b.staging.bytes(), &env);
  EXPECT_EQ(l.code(), StatusCode::kIoError) << l.to_string();
  EXPECT_THAT(l.message(), HasSubstr("open " + victim + " (injected)"));
  EXPECT_EQ(rig.faults->injected(), 2u);
  EXPECT_TRUE(verify_checkpoint(*info, *rig.io, b.staging.bytes(), &env).is_ok()) << "the rules are used up";
}

TEST(Checkpoint, RefusesBadOptionsAndATornStore) {
  TempDir dir;
  Rig rig;
  ASSERT_TRUE(rig.init({}, dir.path + "/swap").is_ok());
  SaveOptions o = save_options(dir.path + "/c");
  o.staging_bytes = 4096;
  EXPECT_EQ(save_checkpoint(*rig.store, state_at(1), "{}", o).status().code(), StatusCode::kInvalidArgument);
  o.staging_bytes = kStaging;
  o.dir = "";
  EXPECT_EQ(save_checkpoint(*rig.store, state_at(1), "{}", o).status().code(), StatusCode::kInvalidArgument);
  rig.store->mark_torn("step 3 failed");
  auto r = save_checkpoint(*rig.store, state_at(1), "{}", save_options(dir.path + "/c"));
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_FALSE(fs::exists(dir.path + "/c/step-1"));
}

// ---------------------------------------------------------------------------------------------
// Collaborative saves (Note [Collaborative save]): data-parallel ranks with partitioned optimizer
// states, here threads joined by an in-process broadcast in place of the process group.

// World-size ranks as threads: broadcast copies root's bytes to every rank, each call a collective.
struct LocalBus {
  explicit LocalBus(uint32_t n) : world(n), sync(n) {}
  uint32_t world;
  std::barrier<> sync;
  std::vector<std::byte> buf;
  SaveOptions::Collective collective(uint32_t rank) {
    return {.rank = rank,
            .world_size = world,
            .broadcast = [this, rank](void* data, uint64_t n, uint32_t root, const std::string&) {
              if (rank == root) buf.assign(static_cast<std::byte*>(data), static_cast<std::byte*>(data) + n);
              sync.arrive_and_wait();
              if (rank != root) std::memcpy(data, buf.data(), n);
              sync.arrive_and_wait();
              return Status::ok();
            }};
  }
};

// Runs a collaborative save of generation-`gen` rigs on `world` threads; returns each rank's result.
std::vector<Result<SaveResult>> save_together(std::vector<Rig>& rigs, const std::string& ckpt, uint64_t step) {
  LocalBus bus(static_cast<uint32_t>(rigs.size()));
  std::vector<Result<SaveResult>> out(rigs.size(), Result<SaveResult>(internal_error("not run")));
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < rigs.size(); ++r) {
    threads.emplace_back([&, r] {
      SaveOptions o = save_options(ckpt);
      o.collective = bus.collective(r);
      out[r] = save_checkpoint(*rigs[r].store, state_at(step), "{}", o);
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

TEST(CollaborativeSave, RanksWriteTheFilesOneProcessWouldAndAnyWorldLoadsThem) {
  for (const std::string optimizer : {"nvme", "cpu"}) {
    SCOPED_TRACE(optimizer);
    TempDir dir;
    Rig one;
    ASSERT_TRUE(one.init({.optimizer = optimizer}, dir.path + "/swap-one").is_ok());
    ASSERT_TRUE(one.fill(5).is_ok());
    ASSERT_TRUE(save_checkpoint(*one.store, state_at(3), "{}", save_options(dir.path + "/one")).is_ok());
    for (uint32_t world : {2u, 3u}) {
      SCOPED_TRACE(world);
      std::vector<Rig> rigs(world);
      for (uint32_t r = 0; r < world; ++r) {
        ASSERT_TRUE(rigs[r].init({.optimizer = optimizer}, dir.path + "/swap", 1, world, r).is_ok());
        ASSERT_TRUE(rigs[r].plan.partitioned());
        ASSERT_TRUE(rigs[r].fill(5).is_ok());
      }
      const std::string ckpt = dir.path + "/w" + std::to_string(world);
      auto results = save_together(rigs, ckpt, 3);
      for (uint32_t r = 0; r < world; ++r)
        ASSERT_TRUE(results[r].is_ok()) << r << ": " << results[r].status().to_string();
      EXPECT_EQ(results[0]->path, ckpt + "/step-3");
      EXPECT_TRUE(results[1]->path.empty());
      // The same bytes, and so the same manifest (every chunk's CRC), as one process's save.
      for (const char* f : {"master.safetensors", "exp_avg.safetensors", "exp_avg_sq.safetensors", "manifest.json",
                            "trainer_state.json"}) {
        EXPECT_EQ(read_file(ckpt + "/step-3/" + f), read_file(dir.path + "/one/step-3/" + f)) << f;
      }
      ASSERT_TRUE(verify(ckpt, *one.io).is_ok());
      // Loaded by a world of another size, each rank gets its partition and every compute copy
      // (stage 3: its own compute copies only).
      const uint32_t other = world == 2 ? 3 : 2;
      for (uint32_t r = 0; r < other * 2; ++r) {
        const uint32_t stage = r < other ? 2 : 3;
        SCOPED_TRACE("loaded at stage " + std::to_string(stage));
        Rig back;
        ASSERT_TRUE(back.init({.optimizer = optimizer, .param = stage == 3 ? "cpu" : "none", .stage = stage},
                              dir.path + "/swap-back", 1, other, r % other)
                        .is_ok());
        EXPECT_EQ(back.plan.partition_params, stage == 3);
        ASSERT_TRUE(load(ckpt, back).is_ok());
        for (const SubGroup& g : back.registry.sub_groups()) {
          for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
            std::vector<float> v(g.n_elems);
            Status st = back.store->read_state(g.index, kind, std::as_writable_bytes(std::span(v)));
            if (!back.plan.owns(g.index)) {
              EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
              continue;
            }
            ASSERT_TRUE(st.is_ok()) << st.to_string();
            for (uint64_t i = 0; i < g.n_elems; ++i) ASSERT_EQ(v[i], rig_value(5, kind, g.first_elem + i)) << g.index;
          }
          std::vector<uint16_t> c(g.n_elems);
          Status cs = back.store->read_state(g.index, StateKind::kCompute, std::as_writable_bytes(std::span(c)));
          if (!back.plan.holds(g.index, StateKind::kCompute)) {  // stage 3: another rank's compute copy
            EXPECT_EQ(cs.code(), StatusCode::kFailedPrecondition);
            continue;
          }
          ASSERT_TRUE(cs.is_ok()) << cs.to_string();
          for (uint64_t i = 0; i < g.n_elems; ++i)
            ASSERT_EQ(c[i], float_to_bf16(rig_value(5, StateKind::kMaster, g.first_elem + i))) << g.index;
        }
      }
    }
  }
}

// With 8-bit moments each rank writes its run of the two parts of each moment (absmax file and codes
// file): the files are one process's, and they load back into one process whole.
TEST(CollaborativeSave, EightBitMomentsGiveOneProcesssFiles) {
  for (const std::string optimizer : {"nvme", "cpu"}) {
    SCOPED_TRACE(optimizer);
    TempDir dir;
    const Placing placing{.optimizer = optimizer, .moments = "8bit"};
    Rig one;
    ASSERT_TRUE(one.init(placing, dir.path + "/swap-one").is_ok());
    ASSERT_TRUE(one.fill(5).is_ok());
    ASSERT_TRUE(save_checkpoint(*one.store, state_at(3), "{}", save_options(dir.path + "/one")).is_ok());
    for (uint32_t world : {2u, 3u}) {
      SCOPED_TRACE(world);
      std::vector<Rig> rigs(world);
      for (uint32_t r = 0; r < world; ++r) {
        ASSERT_TRUE(rigs[r].init(placing, dir.path + "/swap", 1, world, r).is_ok());
        ASSERT_TRUE(rigs[r].fill(5).is_ok());
      }
      const std::string ckpt = dir.path + "/w" + std::to_string(world);
      auto results = save_together(rigs, ckpt, 3);
      for (uint32_t r = 0; r < world; ++r)
        ASSERT_TRUE(results[r].is_ok()) << r << ": " << results[r].status().to_string();
      for (const char* f : {"master.safetensors", "exp_avg.safetensors", "exp_avg_sq.safetensors", "exp_avg.codes",
                            "exp_avg_sq.codes", "manifest.json"}) {
        EXPECT_EQ(read_file(ckpt + "/step-3/" + f), read_file(dir.path + "/one/step-3/" + f)) << f;
      }
      Rig back;
      ASSERT_TRUE(
          back.init({.optimizer = "cpu", .sub_group_size = 4096, .moments = "8bit"}, dir.path + "/swap-back").is_ok());
      ASSERT_TRUE(load(ckpt, back).is_ok());
      for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq})
        EXPECT_TRUE(back.gather(kind) == one.gather(kind)) << state_name(kind);
    }
  }
}

TEST(CollaborativeSave, AFailedRankFailsEveryRankAndLeavesThePreviousCheckpoint) {
  TempDir dir;
  std::vector<Rig> rigs(2);
  for (uint32_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(rigs[r].init({.optimizer = "nvme"}, dir.path + "/swap", 1, 2, r).is_ok());
    ASSERT_TRUE(rigs[r].fill(1).is_ok());
  }
  const std::string ckpt = dir.path + "/ckpt";
  for (auto& r : save_together(rigs, ckpt, 1)) ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  // Rank 1 cannot write its run of exp_avg: both ranks fail, rank 0 naming rank 1.
  // (The file's last byte is in the last rank's run.)
  const uint64_t last_byte = fs::file_size(ckpt + "/step-1/exp_avg.safetensors") - 1;
  rigs[1].faults->add({.kind = io::FaultKind::kEio,
                       .op = io::IoOp::kWrite,
                       .path_contains = "exp_avg.safetensors",
                       .offset_bytes = last_byte,
                       .times = -1});
  auto failed = save_together(rigs, ckpt, 2);
  ASSERT_FALSE(failed[0].is_ok());
  ASSERT_FALSE(failed[1].is_ok());
  EXPECT_GT(rigs[1].faults->injected(), 0u);
  EXPECT_THAT(failed[0].status().to_string(), HasSubstr("rank 1 of 2 could not write its part"));
  EXPECT_THAT(failed[1].status().to_string(), HasSubstr("exp_avg.safetensors"));
  EXPECT_FALSE(fs::exists(ckpt + "/step-2"));
  for (const auto& e : fs::directory_iterator(ckpt))
    EXPECT_THAT(e.path().filename().string(), ::testing::Not(HasSubstr("tmp")));
  EXPECT_EQ(read_file(ckpt + "/latest"), "step-1\n");
  EXPECT_TRUE(verify(ckpt, *rigs[0].io).is_ok());
  // Rank 0 cannot create the files: every rank says so, nothing is left.
  rigs[1].faults->clear();
  fs::create_directories(ckpt);
  rigs[0].faults->clear();
  SaveOptions bad = save_options(ckpt);
  bad.staging_bytes = 1000;  // refused by rank 0's checks before anything is written
  LocalBus bus(2);
  std::vector<Result<SaveResult>> out(2, Result<SaveResult>(internal_error("not run")));
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      SaveOptions o = bad;
      o.collective = bus.collective(r);
      out[r] = save_checkpoint(*rigs[r].store, state_at(2), "{}", o);
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_FALSE(out[0].is_ok());
  ASSERT_FALSE(out[1].is_ok());
  EXPECT_THAT(out[1].status().to_string(), HasSubstr("rank 0 could not start it"));
  EXPECT_FALSE(fs::exists(ckpt + "/step-2"));
}

}  // namespace
}  // namespace zo::engine
