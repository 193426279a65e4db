// The one place that knows which backends were built (ZO_HAVE_URING / ZO_HAVE_AIO) and how kAuto
// falls back between them.
#include "common/log.h"
#include "io/detail/queue.h"
#include "zo_build_config.h"

namespace zo::io::detail {
namespace {

// A backend is usable if one small queue can be created: io_uring_queue_init fails with EPERM
// (seccomp, io_uring_disabled sysctl) or ENOSYS in many containers; io_setup with EAGAIN when
// fs.aio-max-nr is exhausted.
Status probe(Backend backend) {
  QueueOptions small;
  small.queue_depth = 4;
  auto q = make_queue(backend, small);
  return q.is_ok() ? Status::ok() : q.status();
}

}  // namespace

Result<std::unique_ptr<Queue>> make_queue(Backend backend, const QueueOptions& options) {
  switch (backend) {
    case Backend::kUring:
#if ZO_HAVE_URING
      return make_uring_queue(options);
#else
      return unavailable("io_uring backend not built (liburing was not found at build time)");
#endif
    case Backend::kAio:
#if ZO_HAVE_AIO
      return make_aio_queue(options);
#else
      return unavailable("libaio backend not built (libaio-dev was not found at build time)");
#endif
    case Backend::kPsync: return make_psync_queue(options);
    case Backend::kAuto: break;
  }
  return internal_error("make_queue called with Backend::kAuto");
}

Result<Backend> resolve_backend(Backend requested, std::string* fallback_reason) {
  fallback_reason->clear();
  if (requested != Backend::kAuto) {
    Status s = probe(requested);
    if (!s.is_ok()) {
      return Status(StatusCode::kUnavailable,
                    std::string(backend_name(requested)) + " backend unavailable: " + s.message(), s.sys_errno());
    }
    return requested;
  }
  for (Backend candidate : {Backend::kUring, Backend::kAio}) {
    Status s = probe(candidate);
    if (s.is_ok()) return candidate;
    const std::string why = std::string(backend_name(candidate)) + ": " + s.message();
    if (!fallback_reason->empty()) *fallback_reason += "; ";
    *fallback_reason += why;
    ZO_LOG(kWarn) << "I/O backend " << backend_name(candidate) << " not usable (" << s.message() << "), falling back";
  }
  return Backend::kPsync;
}

}  // namespace zo::io::detail
