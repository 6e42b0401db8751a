#include "io/engine.h"

#include "absl/strings/str_cat.h"
#include "io/aio_engine.h"
#include "io/thread_pool_engine.h"
#include "io/uring_engine.h"

namespace imgtool::io {

absl::StatusOr<EngineKind> ParseEngineKind(const std::string& name) {
  if (name == "io_uring") return EngineKind::kIoUring;
  if (name == "native") return EngineKind::kNative;
  if (name == "threads") return EngineKind::kThreads;
  return absl::InvalidArgumentError(absl::StrCat("Invalid aio option: ", name));
}

absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(EngineKind kind,
                                                     int queue_depth,
                                                     std::ostream* notice) {
  if (kind == EngineKind::kThreads) {
    return std::make_unique<ThreadPoolEngine>(std::min(queue_depth, 64));
  }
  if (kind == EngineKind::kNative) {
    absl::StatusOr<std::unique_ptr<Engine>> aio = AioEngine::Create(queue_depth);
    if (!aio.ok()) {
      return absl::Status(aio.status().code(),
                          absl::StrCat("Unable to use native AIO: ",
                                       aio.status().message()));
    }
    return aio;
  }
  absl::StatusOr<std::unique_ptr<Engine>> uring =
      UringEngine::Create(queue_depth);
  if (uring.ok() || kind == EngineKind::kIoUring) return uring;
  if (notice != nullptr) {
    *notice << "imgtool: io_uring unavailable (" << uring.status().message()
            << "), using threads\n";
  }
  return std::make_unique<ThreadPoolEngine>(std::min(queue_depth, 64));
}

}  // namespace imgtool::io
