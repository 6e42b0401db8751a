// imgtool commit [-f FMT] [-t CACHE] [-b BASE] [-r RATE_LIMIT] [-d] [-p] [-q]
// FILE: writes what FILE (and, with -b, the images between it and BASE)
// allocates into its backing file (or BASE) and empties FILE, as qemu-img
// 7.2 does with its active commit job (QEMU's mirror): the ranges a layer
// above the base allocates are taken in granules of the base's cluster size
// (4 KiB to 64 KiB; 64 KiB for raw), copied as the top reads them (data read
// and written, whole zero granules written as zeroes that may unmap), the
// base grown first when FILE is larger, and flushed. Then, unless -d (or -b,
// which implies -d), FILE is emptied (qcow2::Qcow2Node::MakeEmpty). The top
// keeps its data until the base has it durably: a commit killed at any point
// leaves every image valid and the guest view of FILE unchanged.
#include <getopt.h>
#include <limits.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "base/align.h"
#include "base/errno_status.h"
#include "base/size.h"
#include "base/status_macros.h"
#include "block/copy.h"
#include "block/progress.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/task.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::cli {
namespace {

constexpr char kUsage[] =
    "Usage: imgtool commit [-q] [-f FMT] [-t CACHE] [-b BASE] "
    "[-r RATE_LIMIT] [-d] [-p] FILE";

constexpr char kHelp[] =
    "Usage: imgtool commit [--image-opts] [-q] [-f FMT] [-t CACHE] [-b BASE] "
    "[-r RATE_LIMIT] [-d] [-p]\n"
    "        FILE\n"
    "Commits the changes recorded in FILE into its backing file (or BASE),\n"
    "then empties FILE.\n"
    "  -f FMT          format of FILE (qcow2); probed if absent\n"
    "  --image-opts    FILE is an option string (driver=qcow2,...)\n"
    "  -t CACHE        cache mode (default writeback)\n"
    "  -b BASE         commit into BASE, an image of FILE's backing chain\n"
    "                  (the images in between become invalid); implies -d\n"
    "  -r RATE_LIMIT   write at most this many bytes per second\n"
    "  -d              do not empty FILE afterwards\n"
    "  -p              show progress\n"
    "  -q              quiet\n";

enum LongOption { kObject = 256, kImageOpts };

const struct option kLongOptions[] = {
    {"help", no_argument, nullptr, 'h'},
    {"object", required_argument, nullptr, kObject},
    {"image-opts", no_argument, nullptr, kImageOpts},
    {nullptr, 0, nullptr, 0},
};

// The mirror job's requests in flight (MAX_IN_FLIGHT).
constexpr int kWorkers = 16;

struct CommitArgs {
  std::string format;
  bool image_opts = false;
  std::string cache = "writeback";
  std::optional<std::string> base;
  uint64_t rate_limit = 0;
  bool drop = false;
  bool progress = false;
  bool quiet = false;
};

// The copy into the base (its size first), then the base flushed.
io::Task<absl::Status> CommitData(io::BlockNode& top, io::BlockNode& base,
                                  const CommitArgs& a,
                                  block::Progress* progress) {
  const uint64_t top_size = AlignUp(top.size(), block::kSectorSize);
  if (top_size > AlignUp(base.size(), block::kSectorSize)) {
    // As the mirror job: the base grows to the top's size (a shorter top
    // leaves the base as long as it is).
    CO_RETURN_IF_ERROR(co_await base.Truncate(top_size, io::PreallocMode::kOff));
  }
  block::CopySettings settings;
  settings.min_sparse_sectors = 0;
  settings.progress_counts_zero_ranges = true;
  settings.rate_limit_counts_zeroes = false;
  settings.num_workers = kWorkers;
  // In guest order, so that a qcow2 base is laid out the same every time
  // (the mirror job writes as its reads finish; out of order imgtool's
  // concurrent allocations can also take a cluster more than qemu-img's).
  settings.in_order = true;
  settings.max_chunk = block::kMirrorChunkSize;
  settings.rate_limit = a.rate_limit;
  settings.progress = progress;
  // QEMU's bdrv_get_default_bitmap_granularity of the base: its cluster
  // size within [4 KiB, 64 KiB]; 64 KiB without one (raw).
  settings.granularity = 64 << 10;
  settings.target_cluster_size = 1;
  if (const auto* q = dynamic_cast<const qcow2::Qcow2Node*>(&base)) {
    settings.granularity =
        std::clamp<uint64_t>(q->cluster_size(), 4096, 64 << 10);
    settings.target_cluster_size = q->cluster_size();
  }
  std::vector<block::CopySource> sources = {
      {&top, 0, top_size, block::SourceView::kAboveBase, &base}};
  CO_RETURN_IF_ERROR(
      co_await block::Copy(std::move(sources), base, settings));
  co_return co_await base.Flush();
}

// qemu-img's "Block job failed: <strerror>" for a failed copy.
absl::Status JobFailed(const absl::Status& st) {
  return WithMessage(st, absl::StrCat("Block job failed: ",
                                      block::RequestError(st)));
}

absl::Status Commit(const CommitArgs& a, OpenedImage& image, int depth,
                    const std::string& filename, block::Progress& progress,
                    std::ostream& out) {
  if (depth == 0) {
    return absl::NotFoundError(absl::StrCat("Did not find '", *a.base,
                                            "' in the backing chain of '",
                                            filename, "'"));
  }
  io::BlockNode* base = image.node.get();
  for (int i = 0; i < depth && base != nullptr; ++i) base = base->backing();
  if (base == nullptr) {
    return absl::FailedPreconditionError("Image does not have a backing file");
  }
  if (base->read_only()) {
    return absl::InternalError(
        absl::StrCat(base->filename(), ": base image was opened read-only"));
  }
  absl::Status st = io::RunSync(
      *image.engine,
      CommitData(*image.node, *base, a, a.progress ? &progress : nullptr));
  if (!st.ok()) return JobFailed(st);
  progress.Print(100, 0);
  if (!a.drop && image.qcow2 != nullptr) {
    // Only once the base holds the data durably (flushed above).
    absl::Status emptied =
        io::RunSync(*image.engine, image.qcow2->MakeEmpty());
    if (!emptied.ok()) {
      // QEMU's bdrv_make_empty error.
      return WithMessage(emptied,
                         absl::StrCat("Failed to empty ", image.display_name,
                                      ": ", block::RequestError(emptied)));
    }
  }
  (void)out;
  return absl::OkStatus();
}

}  // namespace

absl::Status RunCommit(const std::vector<std::string>& args, Streams streams) {
  CommitArgs a;
  bool help = false;
  ASSIGN_OR_RETURN(
      std::vector<std::string> operands,
      ParseOptions(
          args, "f:ht:b:dpqr:", kLongOptions, kUsage,
          [&](int c, const std::string& arg) -> absl::Status {
            switch (c) {
              case 'h': help = true; break;
              case 'f': a.format = arg; break;
              case 't': a.cache = arg; break;
              case 'b':
                a.base = arg;
                a.drop = true;  // -b implies -d
                break;
              case 'd': a.drop = true; break;
              case 'p': a.progress = true; break;
              case 'q': a.quiet = true; break;
              case 'r': {
                absl::StatusOr<uint64_t> v = ParseSize(arg);
                if (!v.ok()) {
                  return PrefixEachLine(absl::InvalidArgumentError(
                      absl::StrReplaceAll(v.status().message(),
                                          {{"Invalid image size",
                                            "Invalid rate limit"}})));
                }
                a.rate_limit = *v;
                break;
              }
              case kObject:
                return absl::UnimplementedError(
                    "--object is not supported yet");
              case kImageOpts: a.image_opts = true; break;
            }
            return absl::OkStatus();
          }));
  if (help) {
    streams.out << kHelp;
    return absl::OkStatus();
  }
  if (a.quiet) a.progress = false;
  if (operands.size() != 1) {
    return UsageError("Expecting one image file name", kUsage);
  }
  const std::string& filename = operands[0];
  const std::optional<std::string> cache = CacheMode(a.cache);
  if (!cache.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Invalid cache option: ", a.cache));
  }
  ImageSpec spec;
  spec.filename = filename;
  spec.format = a.format;
  spec.image_opts = a.image_opts;
  spec.cache = *cache;
  spec.read_only = false;
  spec.queue_depth = kWorkers;
  int depth = 1;
  if (a.base.has_value()) {
    // The chain's names first (read-only), to know which backing file to
    // open read-write.
    ImageSpec lookup = spec;
    lookup.read_only = true;
    lookup.force_share = true;
    ASSIGN_OR_RETURN(OpenedImage chain, OpenImage(lookup, streams.err));
    depth = 0;  // not found
    FindBackingImage(*chain.node, *a.base, &depth);
    RETURN_IF_ERROR(CloseImage(chain));
  }
  spec.writable_backing_depth = depth;
  ASSIGN_OR_RETURN(OpenedImage image, OpenImage(spec, streams.err));
  block::Progress progress(a.progress, 1.0f, streams.out);
  progress.Print(0, 100);
  absl::Status status =
      Commit(a, image, depth, filename, progress, streams.out);
  // As qemu-img's blk_unref: a failed close (the qcow2 caches not written
  // back) is reported, one line per cache, before the commit's own error,
  // and changes neither the outcome nor the exit status.
  absl::Status closed = CloseImage(image);
  if (!closed.ok()) {
    for (absl::string_view line : absl::StrSplit(closed.message(), '\n')) {
      streams.err << ProgramName() << ": " << line << "\n";
    }
  }
  progress.End();
  RETURN_IF_ERROR(status);
  if (!a.quiet) streams.out << "Image committed.\n";
  return absl::OkStatus();
}

}  // namespace imgtool::cli
