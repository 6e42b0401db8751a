// imgtool compare [-f FMT] [-F FMT] [-T CACHE] [-p] [-q] [-s] [-U] A B:
// compares the guest-visible content of two images as qemu-img 7.2 does,
// with its messages and exit codes: 0 identical, 1 different, 2 an image
// cannot be opened, 3 block status failed, 4 a read failed. Block status
// (through the backing chains) lets ranges that are zero in both images go
// unread; only ranges with data are read and compared, 2 MiB at a time.
#include <getopt.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/zero.h"
#include "block/copy.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "imgtool/progress.h"
#include "io/aligned_buffer.h"
#include "io/block_node.h"
#include "io/chain_status.h"
#include "io/engine.h"

namespace imgtool::cli {
namespace {

constexpr char kUsage[] =
    "Usage: imgtool compare [-f FMT] [-F FMT] [-T CACHE] [-p] [-q] [-s] [-U] "
    "FILE1 FILE2";

constexpr char kHelp[] =
    "Usage: imgtool compare [-f FMT] [-F FMT] [-T CACHE] [-p] [-q] [-s] [-U] "
    "FILE1 FILE2\n"
    "Compares the content of two images.\n"
    "  -f FMT             format of FILE1 (raw, file, qcow2); probed if "
    "absent\n"
    "  -F FMT             format of FILE2 (raw, file, qcow2); probed if "
    "absent\n"
    "  --image-opts       FILE1 and FILE2 are option strings (driver=qcow2,...)\n"
    "  -T CACHE           cache mode of both images (default writeback)\n"
    "  -p                 show progress\n"
    "  -q                 quiet: print only errors\n"
    "  -s                 strict: sizes and block status must match too\n"
    "  -U, --force-share  open the images without taking their locks\n"
    "Exit status: 0 identical, 1 different, 2 open error, 3 block status "
    "error,\n"
    "4 read error.\n";

constexpr uint64_t kSectorSize = 512;
constexpr uint64_t kChunkSize = 2 << 20;  // qemu-img's IO_BUF_SIZE

enum ExitCode {
  kDifferent = 1,
  kOpenError = 2,
  kStatusError = 3,
  kReadError = 4
};

enum LongOption { kObject = 256, kImageOpts };

const struct option kLongOptions[] = {
    {"help", no_argument, nullptr, 'h'},
    {"object", required_argument, nullptr, kObject},
    {"image-opts", no_argument, nullptr, kImageOpts},
    {"force-share", no_argument, nullptr, 'U'},
    {nullptr, 0, nullptr, 0},
};

bool IsCacheMode(const std::string& name) {
  return name == "none" || name == "off" || name == "writeback" ||
         name == "writethrough" || name == "directsync" || name == "unsafe";
}

// The state of a range of one image, as qemu-img's strict mode compares it
// (QEMU's block status flags).
struct Extent {
  uint64_t length = 0;
  bool data = false;
  bool zero = false;
  bool offset_valid = false;
  bool allocated = false;  // in some node of the backing chain
  bool eof = false;        // the range reaches the end of the image

  bool SameStatus(const Extent& o) const {
    return data == o.data && zero == o.zero && offset_valid == o.offset_valid &&
           allocated == o.allocated && eof == o.eof;
  }
};

// One image being compared.
class Side {
 public:
  Side(OpenedImage image, std::string filename)
      : image_(std::move(image)),
        filename_(std::move(filename)),
        size_(VirtualSize(image_)),
        buffer_(kChunkSize) {}

  const std::string& filename() const { return filename_; }
  uint64_t size() const { return size_; }  // bytes, a multiple of 512
  uint8_t* buffer() { return buffer_.data(); }

  // The extent at `offset` (< size()). Past the node's own end (up to the
  // 512-byte rounding) the image reads zeroes. Errors: exit code 3.
  absl::StatusOr<Extent> StatusAt(uint64_t offset) {
    Extent e;
    const uint64_t node_size = image_.node->size();
    if (offset >= node_size) {
      e.length = size_ - offset;
      e.zero = true;
      e.offset_valid = true;
      e.allocated = true;
    } else {
      absl::StatusOr<io::ChainStatus> st =
          io::RunSync(*image_.engine,
                      io::GetChainStatus(*image_.node, offset, size_ - offset));
      if (!st.ok()) {
        return WithExitCode(
            WithCorruptionEvent(
                absl::Status(st.status().code(),
                             absl::StrCat("Sector allocation test failed for ",
                                          filename_)),
                st.status()),
            kStatusError);
      }
      e.length = st->status.length;
      e.data = st->status.data;
      e.zero = st->status.zero;
      e.offset_valid = st->status.offset_valid;
      e.allocated = st->present;
      // A hole reaching the node's end goes on to the 512-byte rounded end
      // (QEMU's trailing hole).
      if (e.zero && !e.data && offset + e.length == node_size) {
        e.length = size_ - offset;
      }
    }
    e.eof = offset + e.length == size_;
    return e;
  }

  // Reads [offset, offset + length) into buffer(). Errors: exit code 4,
  // "Error while reading offset N of <image>: <strerror>" (qemu-img's text:
  // the request's errno, not the file layer's message naming the file).
  absl::Status Read(uint64_t offset, uint64_t length) {
    absl::Status st = io::RunSync(
        *image_.engine,
        image_.node->Read(offset, io::IoVec(buffer_.data(), length)));
    if (st.ok()) return st;
    return WithExitCode(
        absl::Status(st.code(),
                     absl::StrCat("Error while reading offset ", offset, " of ",
                                  filename_, ": ", block::RequestError(st))),
        kReadError);
  }

  absl::Status Close() { return CloseImage(image_); }

 private:
  OpenedImage image_;
  std::string filename_;
  uint64_t size_;
  io::AlignedBuffer buffer_;
};

// "Content mismatch at offset N!" on stdout, then exit code 1 without
// another message.
absl::Status Mismatch(uint64_t offset, bool quiet, std::ostream& out) {
  if (!quiet) out << "Content mismatch at offset " << offset << "!\n";
  return WithExitCode(absl::AbortedError(""), kDifferent);
}

// Offset of the first 512-byte sector of `buf` holding a non-zero byte, or
// nullopt.
std::optional<uint64_t> FirstNonZeroSector(const uint8_t* buf,
                                           uint64_t length) {
  for (uint64_t i = 0; i < length; i += kSectorSize) {
    if (!IsZero(buf + i, std::min(kSectorSize, length - i))) return i;
  }
  return std::nullopt;
}

// The range of `side` must read as zeroes.
absl::Status CheckZero(Side& side, uint64_t offset, uint64_t length, bool quiet,
                       std::ostream& out) {
  RETURN_IF_ERROR(side.Read(offset, length));
  if (std::optional<uint64_t> at = FirstNonZeroSector(side.buffer(), length)) {
    return Mismatch(offset + *at, quiet, out);
  }
  return absl::OkStatus();
}

// Compares equal-length ranges read into both buffers by 512-byte sectors;
// a difference is reported at the start of its sector.
absl::Status CheckEqual(Side& a, Side& b, uint64_t offset, uint64_t length,
                        bool quiet, std::ostream& out) {
  RETURN_IF_ERROR(a.Read(offset, length));
  RETURN_IF_ERROR(b.Read(offset, length));
  for (uint64_t i = 0; i < length; i += kSectorSize) {
    const uint64_t n = std::min(kSectorSize, length - i);
    if (std::memcmp(a.buffer() + i, b.buffer() + i, n) != 0) {
      return Mismatch(offset + i, quiet, out);
    }
  }
  return absl::OkStatus();
}

struct CompareArgs {
  std::string format1;
  std::string format2;
  std::string cache = "writeback";
  bool progress = false;
  bool quiet = false;
  bool strict = false;
  bool force_share = false;
  bool image_opts = false;
};

absl::Status Compare(const CompareArgs& args, Side& a, Side& b,
                     Progress& progress, std::ostream& out) {
  const uint64_t common = std::min(a.size(), b.size());
  const uint64_t base = std::max(a.size(), b.size());
  progress.Print(0, 100);
  if (args.strict && a.size() != b.size()) {
    if (!args.quiet) out << "Strict mode: Image size mismatch!\n";
    return WithExitCode(absl::AbortedError(""), kDifferent);
  }

  uint64_t offset = 0;
  while (offset < common) {
    ASSIGN_OR_RETURN(const Extent ea, a.StatusAt(offset));
    ASSIGN_OR_RETURN(const Extent eb, b.StatusAt(offset));
    uint64_t chunk = std::min(ea.length, eb.length);
    if (args.strict && !ea.SameStatus(eb)) {
      if (!args.quiet) {
        out << "Strict mode: Offset " << offset << " block status mismatch!\n";
      }
      return WithExitCode(absl::AbortedError(""), kDifferent);
    }
    if (ea.zero && eb.zero) {
      // Both read as zeroes: nothing to read.
    } else if (ea.allocated == eb.allocated) {
      if (ea.allocated) {
        chunk = std::min(chunk, kChunkSize);
        RETURN_IF_ERROR(CheckEqual(a, b, offset, chunk, args.quiet, out));
      }
    } else {
      chunk = std::min(chunk, kChunkSize);
      RETURN_IF_ERROR(
          CheckZero(ea.allocated ? a : b, offset, chunk, args.quiet, out));
    }
    offset += chunk;
    progress.Advance(chunk, base);
  }

  if (a.size() != b.size()) {
    if (!args.quiet) out << "Warning: Image size mismatch!\n";
    Side& longer = a.size() > b.size() ? a : b;
    while (offset < base) {
      ASSIGN_OR_RETURN(const Extent e, longer.StatusAt(offset));
      uint64_t chunk = e.length;
      if (e.allocated && !e.zero) {
        chunk = std::min(chunk, kChunkSize);
        RETURN_IF_ERROR(CheckZero(longer, offset, chunk, args.quiet, out));
      }
      offset += chunk;
      progress.Advance(chunk, base);
    }
  }
  if (!args.quiet) out << "Images are identical.\n";
  return absl::OkStatus();
}

}  // namespace

absl::Status RunCompare(const std::vector<std::string>& args, Streams streams) {
  CompareArgs a;
  bool help = false;
  ASSIGN_OR_RETURN(
      std::vector<std::string> operands,
      ParseOptions(args, "hf:F:T:pqsU", kLongOptions, kUsage,
                   [&](int c, const std::string& arg) -> absl::Status {
                     switch (c) {
                       case 'h':
                         help = true;
                         break;
                       case 'f':
                         a.format1 = arg;
                         break;
                       case 'F':
                         a.format2 = arg;
                         break;
                       case 'T':
                         a.cache = arg;
                         break;
                       case 'p':
                         a.progress = true;
                         break;
                       case 'q':
                         a.quiet = true;
                         break;
                       case 's':
                         a.strict = true;
                         break;
                       case 'U':
                         a.force_share = true;
                         break;
                       case kImageOpts:
                         a.image_opts = true;
                         break;
                     }
                     return absl::OkStatus();
                   }));
  if (help) {
    streams.out << kHelp;
    return absl::OkStatus();
  }
  if (operands.size() != 2) {
    return UsageError("Expecting two image file names", kUsage);
  }

  Progress progress(a.progress && !a.quiet, 2.0f, streams.out);
  absl::Status status = [&]() -> absl::Status {
    if (!IsCacheMode(a.cache)) {
      return WithExitCode(absl::InvalidArgumentError(absl::StrCat(
                              "Invalid source cache option: ", a.cache)),
                          kOpenError);
    }
    std::vector<Side> sides;
    sides.reserve(2);
    std::shared_ptr<io::Engine> engine;  // both images on one engine
    for (int i = 0; i < 2; ++i) {
      ImageSpec spec;
      spec.filename = operands[i];
      spec.format = i == 0 ? a.format1 : a.format2;
      spec.image_opts = a.image_opts;
      spec.cache = a.cache == "off" ? "none" : a.cache;
      spec.read_only = true;
      spec.force_share = a.force_share;
      spec.queue_depth = 1;
      absl::StatusOr<OpenedImage> image =
          OpenImage(spec, streams.err, engine);
      if (!image.ok()) {
        for (Side& side : sides) side.Close().IgnoreError();
        return WithExitCode(image.status(), kOpenError);
      }
      engine = image->engine;
      sides.emplace_back(*std::move(image), operands[i]);
    }
    absl::Status compared =
        Compare(a, sides[0], sides[1], progress, streams.out);
    // Read-only images: closing cannot lose data; the comparison decides.
    sides[1].Close().IgnoreError();
    sides[0].Close().IgnoreError();
    return compared;
  }();
  progress.End();
  return status;
}

}  // namespace imgtool::cli
