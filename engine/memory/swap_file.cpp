#include "engine/memory/swap_file.h"

#include <filesystem>
#include <mutex>
#include <unordered_map>

#include "common/bytes.h"
#include "common/log.h"

namespace zo::engine {

std::string swap_dir(const std::string& nvme_path, uint32_t rank) {
  return (std::filesystem::path(nvme_path) / "zoffload-swap" / ("rank" + std::to_string(rank))).string();
}

namespace {

// What a ticket was for, so that wait() can say which region of which file failed: the IoEngine's
// own message names the piece, not the state the caller was moving.
struct TicketContext {
  io::IoOp op = io::IoOp::kRead;
  std::string what;
  uint64_t offset_bytes = 0;
  uint64_t size_bytes = 0;
};

std::string describe(const TicketContext& c, const std::string& path) {
  return c.what + ": " + std::string(io::op_name(c.op)) + " of " + format_bytes(c.size_bytes) + " at offset " +
         std::to_string(c.offset_bytes) + " in " + path;
}

// Keeps the code and errno of the original failure so callers can still tell ENOSPC from EIO.
Status wrap(const Status& original, const TicketContext& c, const std::string& path) {
  return Status(original.code(), describe(c, path) + ": " + original.message(), original.sys_errno());
}

std::string free_space_text(io::Env* env, const std::string& dir) {
  Result<uint64_t> free = env->free_bytes(dir);
  if (!free.is_ok()) return "free space unknown";
  return format_bytes(*free) + " free on that file system";
}

}  // namespace

struct SwapFile::Impl {
  io::Env* env = nullptr;
  io::File file;
  io::IoEngine* engine = nullptr;
  MemoryAccounting* accounting = nullptr;
  std::string path;
  uint64_t capacity = 0;
  uint64_t reserved = 0;

  std::mutex mu;
  std::unordered_map<io::Ticket, TicketContext> tickets;

  Result<io::Ticket> submit(io::IoOp op, SwapRegion region, uint64_t offset_bytes, std::byte* buffer,
                            uint64_t size_bytes, std::string_view what);
};

Result<std::unique_ptr<SwapFile>> SwapFile::create(const std::string& dir, const std::string& name,
                                                   uint64_t capacity_bytes, io::IoEngine& engine,
                                                   MemoryAccounting* accounting, io::Env* env,
                                                   const std::function<void(const std::string&)>& claimed) {
  ZO_RETURN_IF_ERROR(env->make_dirs(dir).with_context("creating swap directory " + dir));
  auto impl = std::make_unique<Impl>();
  impl->env = env;
  impl->path = (std::filesystem::path(dir) / name).string();
  impl->engine = &engine;
  impl->accounting = accounting;
  impl->capacity = align_up(capacity_bytes, kSwapAlignment);
  ZO_ASSIGN_OR_RETURN(const io::PathKind before, env->path_kind(impl->path));
  ZO_ASSIGN_OR_RETURN(impl->file, env->open_file(impl->path, io::OpenMode::kCreate, engine.options().direct));
  // Two runs writing one swap file would silently train on each other's states.
  if (Status st = impl->file.lock_exclusive(); !st.is_ok()) {
    if (st.code() != StatusCode::kFailedPrecondition) return st.with_context("locking swap file " + impl->path);
    return Status(StatusCode::kFailedPrecondition,
                  "swap file " + impl->path +
                      " is in use by another process (another zoffload run with the same nvme_path?): give each run "
                      "its own nvme_path, or wait for that run to end");
  }
  if (claimed) claimed(impl->path);
  // From here the file is this process's: one it created and could not size is removed again, so
  // a failed start leaves no empty swap file behind. Only the file: the directories above it may
  // hold other ranks' and runs' swap files by now.
  auto fail = [&](Status st) {
    if (before == io::PathKind::kMissing) {
      (void)impl->file.close();
      if (Status rm = env->remove_all(impl->path); !rm.is_ok()) ZO_LOG(kWarn) << rm.to_string();
    }
    return st;
  };
  // A file left by a previous, larger run would keep its extra blocks forever: trim it first.
  Result<uint64_t> existing = impl->file.size_bytes();
  if (!existing.is_ok()) return fail(existing.status());
  if (*existing > impl->capacity) {
    if (Status st = impl->file.truncate(impl->capacity); !st.is_ok())
      return fail(st.with_context("trimming swap file"));
  }
  Status s = impl->file.preallocate(impl->capacity);
  if (!s.is_ok()) {
    if (s.code() == StatusCode::kNoSpace) {
      return fail(Status(StatusCode::kNoSpace,
                         "swap file " + impl->path + " needs " + format_bytes(impl->capacity) + " but there is only " +
                             free_space_text(env, dir) +
                             "; point nvme_path at a larger drive or offload less to NVMe (" + s.message() + ")",
                         s.sys_errno()));
    }
    return fail(s.with_context("preallocating swap file " + impl->path));
  }
  return std::unique_ptr<SwapFile>(new SwapFile(std::move(impl)));
}

SwapFile::SwapFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

SwapFile::~SwapFile() {
  if (impl_->accounting != nullptr && impl_->reserved > 0) {
    impl_->accounting->remove_resident(Tier::kNvme, impl_->reserved);
  }
}

Result<SwapRegion> SwapFile::reserve(uint64_t size_bytes) {
  const uint64_t size = align_up(size_bytes, kSwapAlignment);
  std::lock_guard lock(impl_->mu);
  if (size > impl_->capacity - impl_->reserved) {
    return Status(StatusCode::kNoSpace, "swap file " + impl_->path + ": cannot reserve " + format_bytes(size) + ", " +
                                            format_bytes(impl_->reserved) + " of " + format_bytes(impl_->capacity) +
                                            " already reserved (the memory plan sized this file too small)");
  }
  SwapRegion region{impl_->reserved, size};
  impl_->reserved += size;
  if (impl_->accounting != nullptr) impl_->accounting->add_resident(Tier::kNvme, size);
  return region;
}

Result<io::Ticket> SwapFile::Impl::submit(io::IoOp op, SwapRegion region, uint64_t offset_bytes, std::byte* buffer,
                                          uint64_t size_bytes, std::string_view what) {
  TicketContext ctx{op, std::string(what), region.offset_bytes + offset_bytes, size_bytes};
  if (offset_bytes > region.size_bytes || size_bytes > region.size_bytes - offset_bytes ||
      region.offset_bytes + region.size_bytes > capacity) {
    return invalid_argument(describe(ctx, path) + ": outside its region [" + std::to_string(region.offset_bytes) +
                            ", +" + std::to_string(region.size_bytes) + ") of a " + std::to_string(capacity) +
                            "-byte file");
  }
  io::IoRequest req{op, &file, ctx.offset_bytes, buffer, size_bytes};
  auto ticket = engine->submit(req);
  if (!ticket.is_ok()) return wrap(ticket.status(), ctx, path);
  std::lock_guard lock(mu);
  tickets.emplace(*ticket, std::move(ctx));
  return *ticket;
}

Result<io::Ticket> SwapFile::read_async(SwapRegion region, uint64_t offset_bytes, std::span<std::byte> buffer,
                                        std::string_view what) {
  return impl_->submit(io::IoOp::kRead, region, offset_bytes, buffer.data(), buffer.size(), what);
}

Result<io::Ticket> SwapFile::write_async(SwapRegion region, uint64_t offset_bytes, std::span<const std::byte> buffer,
                                         std::string_view what) {
  return impl_->submit(io::IoOp::kWrite, region, offset_bytes, const_cast<std::byte*>(buffer.data()), buffer.size(),
                       what);
}

Status SwapFile::wait(io::Ticket ticket) {
  Status s = impl_->engine->wait(ticket);
  TicketContext ctx;
  bool known = false;
  {
    std::lock_guard lock(impl_->mu);
    auto it = impl_->tickets.find(ticket);
    if (it != impl_->tickets.end()) {
      ctx = std::move(it->second);
      impl_->tickets.erase(it);
      known = true;
    }
  }
  if (!known) {
    if (s.is_ok())
      return internal_error("swap file " + impl_->path + ": ticket " + std::to_string(ticket) + " is not ours");
    return s.with_context("swap file " + impl_->path);
  }
  if (!s.is_ok()) return wrap(s, ctx, impl_->path);
  if (impl_->accounting != nullptr) {
    impl_->accounting->add_moved(ctx.op == io::IoOp::kRead ? Move::kNvmeRead : Move::kNvmeWrite, ctx.size_bytes);
  }
  return Status::ok();
}

Status SwapFile::read(SwapRegion region, uint64_t offset_bytes, std::span<std::byte> buffer, std::string_view what) {
  ZO_ASSIGN_OR_RETURN(io::Ticket t, read_async(region, offset_bytes, buffer, what));
  return wait(t);
}

Status SwapFile::write(SwapRegion region, uint64_t offset_bytes, std::span<const std::byte> buffer,
                       std::string_view what) {
  ZO_ASSIGN_OR_RETURN(io::Ticket t, write_async(region, offset_bytes, buffer, what));
  return wait(t);
}

const std::string& SwapFile::path() const { return impl_->path; }
uint64_t SwapFile::capacity_bytes() const { return impl_->capacity; }

uint64_t SwapFile::reserved_bytes() const {
  std::lock_guard lock(impl_->mu);
  return impl_->reserved;
}

bool SwapFile::direct() const { return impl_->file.direct(); }

Status SwapFile::remove_file() {
  if (impl_->file.is_open()) ZO_RETURN_IF_ERROR(impl_->file.close());
  return impl_->env->remove_all(impl_->path).with_context("removing swap file");
}

}  // namespace zo::engine
