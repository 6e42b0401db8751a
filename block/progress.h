// qemu-img's progress line for `-p` (convert, compare, commit, the copy
// engine of block/copy.h): records "    (12.34/100%)\r", the last one
// followed by "\n" (End()), printed when the value moved by more than
// `min_skip` points either way (amend's operations each start low), or is
// 0 or 100, computed in single precision as
// qemu-img does so the same lines appear (vdsm, CDI and Proxmox parse them).
// Not thread-safe; used from the command's thread.
#ifndef IMGTOOL_BLOCK_PROGRESS_H_
#define IMGTOOL_BLOCK_PROGRESS_H_

#include <cstdint>
#include <cstdio>
#include <ostream>

namespace imgtool::block {

class Progress {
 public:
  // Prints nothing unless `enabled`; `out` must outlive the object.
  Progress(bool enabled, float min_skip, std::ostream& out)
      : enabled_(enabled), min_skip_(min_skip), out_(out) {}

  // `max` 0: `value` is the absolute percentage; otherwise `value` percent
  // of `max` points are added.
  void Print(float value, int max) {
    float current = max == 0 ? value : current_ + value / 100 * max;
    if (current > 100) current = 100;
    current_ = current;
    if (current > last_print_ + min_skip_ ||
        current < last_print_ - min_skip_ || current == 100 || current == 0) {
      last_print_ = current_;
      if (enabled_) {
        char line[64];
        std::snprintf(line, sizeof(line), "    (%3.2f/100%%)\r",
                      static_cast<double>(current_));
        out_ << line;
        out_.flush();
      }
    }
  }

  // Progress by `bytes` out of `base` bytes.
  void Advance(uint64_t bytes, uint64_t base) {
    Print(static_cast<float>(bytes) / static_cast<float>(base) * 100, 100);
  }

  // Ends the line (only if enabled), without flushing: as qemu-img's, the
  // newline waits in stdout's buffer (imgtool/main.cc KeepStdioBuffering).
  void End() {
    if (enabled_) out_ << "\n";
  }

 private:
  bool enabled_;
  float min_skip_;
  float current_ = 0;
  float last_print_ = 0;
  std::ostream& out_;
};

}  // namespace imgtool::block

#endif  // IMGTOOL_BLOCK_PROGRESS_H_
