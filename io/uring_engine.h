// io_uring backend of io::Engine, through liburing.
#ifndef IMGTOOL_IO_URING_ENGINE_H_
#define IMGTOOL_IO_URING_ENGINE_H_

#include <memory>

#include "absl/status/statusor.h"
#include "io/engine.h"

namespace imgtool::io {

class UringEngine : public Engine {
 public:
  // Sets up a ring with room for `queue_depth` requests (rounded up to a
  // power of two, at least 8). kUnavailable (with the cause) if the kernel
  // refuses io_uring.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(int queue_depth);
};

}  // namespace imgtool::io

#endif  // IMGTOOL_IO_URING_ENGINE_H_
