// An io::Engine for tests that forwards every request to another engine and
// records the reads or the writes among them, to check the hints a driver
// puts on its requests (io::Op::may_block).
#ifndef IMGTOOL_POSIX_FILE_TESTING_OP_RECORDER_H_
#define IMGTOOL_POSIX_FILE_TESTING_OP_RECORDER_H_

#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "io/engine.h"

namespace imgtool::testing {

class OpRecorder : public io::Engine {
 public:
  // (offset, bytes, may_block) of one request.
  using Seen = std::tuple<uint64_t, uint64_t, bool>;

  // Records requests of `kind` (kRead or kWrite); `inner` must outlive this.
  OpRecorder(io::Engine& inner, io::OpKind kind) : inner_(inner), kind_(kind) {}

  void Submit(io::Op* op) override {
    if (op->kind == kind_) {
      uint64_t bytes = 0;
      for (int i = 0; i < op->iovcnt; ++i) bytes += op->iov[i].iov_len;
      seen_.emplace_back(op->offset, bytes, op->may_block);
    }
    inner_.Submit(op);
  }
  absl::Status Poll(bool wait) override { return inner_.Poll(wait); }
  uint64_t in_flight() const override { return inner_.in_flight(); }
  const char* name() const override { return inner_.name(); }

  // The requests recorded since the last call, in submission order.
  std::vector<Seen> Take() { return std::exchange(seen_, {}); }

 private:
  io::Engine& inner_;
  const io::OpKind kind_;
  std::vector<Seen> seen_;
};

}  // namespace imgtool::testing

#endif  // IMGTOOL_POSIX_FILE_TESTING_OP_RECORDER_H_
