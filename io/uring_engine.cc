#include "io/uring_engine.h"

namespace imgtool::io {

// Placeholder until the io_uring backend lands.
absl::StatusOr<std::unique_ptr<Engine>> UringEngine::Create(int) {
  return absl::UnavailableError("io_uring backend not built yet");
}

}  // namespace imgtool::io
