// imgtool check [-q] [-f FMT] [--output=human|json] [-r leaks|all]
// [-T CACHE] [-U] FILE: qemu-img 7.2's consistency check of qcow2 images
// (qcow2/check.h), with its stdout report, its per-problem lines on stderr
// and its exit codes: 0 clean, 1 check failed or could not complete,
// 2 corruptions, 3 leaked clusters only, 63 format without checks (raw).
#include "qcow2/check.h"

#include <getopt.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "base/errno_status.h"
#include "base/json_printer.h"
#include "base/status_macros.h"
#include "base/options.h"
#include "block/registry.h"
#include "imgtool/check_result.pb.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "io/engine.h"

namespace imgtool::cli {
namespace {

// The checker starts QEMU's error_report lines with "imgtool: "; run as
// qemu-img (argv[0]) they carry that name, as imgtool's other messages do.
std::string WithProgramPrefix(absl::string_view messages) {
  std::string text = absl::StrCat("\n", messages);
  absl::StrReplaceAll({{"\nimgtool: ", absl::StrCat("\n", ProgramName(), ": ")}},
                      &text);
  return text.substr(1);
}

constexpr char kUsage[] =
    "Usage: imgtool check [-q] [-f FMT] [--output=human|json] [-r leaks|all] "
    "[-T CACHE] [-U] FILE";

constexpr char kHelp[] =
    "Usage: imgtool check [-q] [-f FMT] [--output=human|json] [-r leaks|all] "
    "[-T CACHE] [-U] FILE\n"
    "Checks a qcow2 image for consistency, and repairs it with -r.\n"
    "  -f FMT                image format (qcow2; raw has no checks); probed "
    "if absent\n"
    "  --image-opts          FILE is an option string such as\n"
    "                        driver=qcow2,file.driver=preallocate,"
    "file.file.filename=x\n"
    "  --output=human|json   output format (default human)\n"
    "  -q, --quiet           print nothing on stdout\n"
    "  -r leaks|all          repair leaked clusters, or all errors\n"
    "  -T CACHE              cache mode of the image (default writeback)\n"
    "  -U, --force-share     open read-only without taking the image locks\n"
    "Exit codes: 0 no errors, 1 check failed, 2 corruptions, 3 leaks only,\n"
    "63 the format does not support checks.\n";

enum LongOption { kOutput = 256, kObject, kImageOpts };

const struct option kLongOptions[] = {
    {"help", no_argument, nullptr, 'h'},
    {"format", required_argument, nullptr, 'f'},
    {"repair", required_argument, nullptr, 'r'},
    {"output", required_argument, nullptr, kOutput},
    {"object", required_argument, nullptr, kObject},
    {"image-opts", no_argument, nullptr, kImageOpts},
    {"force-share", no_argument, nullptr, 'U'},
    {"quiet", no_argument, nullptr, 'q'},
    {nullptr, 0, nullptr, 0},
};

constexpr std::array<const char*, 5> kCacheModes = {
    "none", "writeback", "writethrough", "directsync", "unsafe"};

absl::Status CouldNotOpen(const std::string& filename,
                          const absl::Status& cause) {
  std::string message(cause.message());
  // open(2) failing: qemu-img names the file twice.
  const int error_number = StatusErrno(cause);
  if (error_number != 0 &&
      message == absl::StrCat(filename, ": Could not open: ",
                              std::strerror(error_number))) {
    message = absl::StrCat("Could not open '", filename,
                           "': ", std::strerror(error_number));
  }
  return absl::Status(
      cause.code(), absl::StrCat("Could not open '", filename, "': ", message));
}

// The human report (qemu-img's dump_human_image_check).
std::string HumanReport(const qcow2::CheckResult& r) {
  std::string text;
  if (r.corruptions == 0 && r.leaks == 0 && r.check_errors == 0) {
    text += "No errors were found on the image.\n";
  } else {
    if (r.corruptions != 0) {
      absl::StrAppend(&text, "\n", r.corruptions,
                      " errors were found on the image.\n"
                      "Data may be corrupted, or further writes to the image "
                      "may corrupt it.\n");
    }
    if (r.leaks != 0) {
      absl::StrAppend(&text, "\n", r.leaks,
                      " leaked clusters were found on the image.\n"
                      "This means waste of disk space, but no harm to data.\n");
    }
    if (r.check_errors != 0) {
      absl::StrAppend(&text, "\n", r.check_errors,
                      " internal errors have occurred during the check.\n");
    }
  }
  if (r.total_clusters != 0 && r.allocated_clusters != 0) {
    absl::StrAppend(
        &text, absl::StrFormat(
                   "%d/%d = %0.2f%% allocated, %0.2f%% fragmented, %0.2f%% "
                   "compressed clusters\n",
                   r.allocated_clusters, r.total_clusters,
                   r.allocated_clusters * 100.0 / r.total_clusters,
                   r.fragmented_clusters * 100.0 / r.allocated_clusters,
                   r.compressed_clusters * 100.0 / r.allocated_clusters));
  }
  if (r.image_end_offset != 0) {
    absl::StrAppend(&text, "Image end offset: ", r.image_end_offset, "\n");
  }
  return text;
}

ImageCheck JsonReport(const qcow2::CheckResult& r,
                      const std::string& filename) {
  ImageCheck check;
  if (r.image_end_offset) check.set_image_end_offset(r.image_end_offset);
  if (r.compressed_clusters)
    check.set_compressed_clusters(r.compressed_clusters);
  if (r.total_clusters) check.set_total_clusters(r.total_clusters);
  if (r.corruptions) check.set_corruptions(r.corruptions);
  if (r.corruptions_fixed) check.set_corruptions_fixed(r.corruptions_fixed);
  check.set_check_errors(r.check_errors);
  if (r.leaks) check.set_leaks(r.leaks);
  if (r.leaks_fixed) check.set_leaks_fixed(r.leaks_fixed);
  if (r.allocated_clusters) check.set_allocated_clusters(r.allocated_clusters);
  check.set_filename(filename);
  check.set_format("qcow2");
  if (r.fragmented_clusters)
    check.set_fragmented_clusters(r.fragmented_clusters);
  return check;
}

// The format of the image from its first bytes, as qemu-img probes it
// (block::FormatOfHead): "qcow2", "qcow" or "raw".
absl::StatusOr<std::string> ProbeFormat(io::Engine& engine,
                                        io::BlockNode& node) {
  std::array<uint8_t, 8> head{};
  const size_t got = std::min<uint64_t>(head.size(), node.size());
  RETURN_IF_ERROR(
      io::RunSync(engine, node.Read(0, io::IoVec(head.data(), head.size()))));
  return block::FormatOfHead(head.data(), got);
}

}  // namespace

absl::Status RunCheck(const std::vector<std::string>& args, Streams streams) {
  std::string format;
  std::string output = "human";
  std::string cache = "writeback";
  qcow2::RepairMode repair = qcow2::RepairMode::kNone;
  bool quiet = false;
  bool force_share = false;
  bool image_opts = false;
  bool help = false;
  ASSIGN_OR_RETURN(
      std::vector<std::string> operands,
      ParseOptions(args, "hf:r:T:qU", kLongOptions, kUsage,
                   [&](int c, const std::string& arg) -> absl::Status {
                     switch (c) {
                       case 'h':
                         help = true;
                         break;
                       case 'f':
                         format = arg;
                         break;
                       case 'r':
                         if (arg == "leaks") {
                           repair = qcow2::RepairMode::kLeaks;
                         } else if (arg == "all") {
                           repair = qcow2::RepairMode::kAll;
                         } else {
                           return UsageError(
                               absl::StrCat(
                                   "Unknown option value for -r (expecting "
                                   "'leaks' or 'all'): ",
                                   arg),
                               "");
                         }
                         break;
                       case 'T':
                         cache = arg;
                         break;
                       case 'q':
                         quiet = true;
                         break;
                       case 'U':
                         force_share = true;
                         break;
                       case kOutput:
                         output = arg;
                         break;
                       case kImageOpts:
                         image_opts = true;
                         break;
                     }
                     return absl::OkStatus();
                   }));
  if (help) {
    streams.out << kHelp;
    return absl::OkStatus();
  }
  if (operands.size() != 1) {
    return UsageError("Expecting one image file name", "");
  }
  const std::string& filename = operands[0];
  ASSIGN_OR_RETURN(const bool json, ParseOutputFormat(output));
  if (std::find(kCacheModes.begin(), kCacheModes.end(), cache) ==
      kCacheModes.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Invalid source cache option: ", cache));
  }
  if (image_opts && !format.empty()) {
    return absl::InvalidArgumentError(
        "--image-opts and --format are mutually exclusive");
  }
  const bool read_only = repair == qcow2::RepairMode::kNone;
  if (force_share && !read_only) {
    return CouldNotOpen(filename,
                        absl::InvalidArgumentError(
                            "force-share=on can only be used with read-only "
                            "images"));
  }
  // The checker works on the file below the qcow2 node (any chain the
  // options name, e.g. qcow2 over preallocate over file), never on an open
  // qcow2 node: corrupt images must stay checkable.
  const std::string user_format = format;  // -f
  absl::StatusOr<NodeOptions> options =
      block::ImageOptions(filename, format, image_opts);
  if (!options.ok()) return CouldNotOpen(filename, options.status());
  if (auto it = options->values.find("driver"); it != options->values.end()) {
    format = it->second;
  }
  if (!format.empty() && block::FindDriver(format) == nullptr) {
    return CouldNotOpen(filename, CheckFormat(format, /*for_create=*/false));
  }
  NodeOptions file_options;
  if (format == "file") {
    file_options = *options;
  } else {
    auto it = options->children.find("file");
    if (options->values.count("file") != 0 || it == options->children.end()) {
      // The registry words these errors.
      file_options = *options;
    } else {
      file_options = it->second;
      if (file_options.values.count("driver") == 0) {
        // A protocol node: named by its filename, never probed.
        if (file_options.values.count("filename") == 0) {
          return CouldNotOpen(filename,
                              absl::InvalidArgumentError(
                                  "Must specify either driver or file"));
        }
        file_options.values["driver"] = "file";
      }
    }
  }

  ASSIGN_OR_RETURN(std::unique_ptr<io::Engine> engine,
                   io::CreateEngine(io::EngineKind::kAuto, 1, &streams.err));
  // QEMU takes an image's locks once its format driver is attached: the
  // file under a raw format (or a plain file) shares writes, so another
  // process writing it does not keep check from answering "does not
  // support checks"; a qcow2 image keeps writers out. A probed image is
  // opened sharing writes and, if it turns out to be qcow2, opened again
  // with qcow2's locks.
  auto open_file = [&](bool share_write) {
    block::OpenSettings settings;
    settings.engine = engine.get();
    settings.cache = cache;
    settings.read_only = read_only;
    settings.force_share = force_share;
    settings.raw_shares_write = share_write;
    settings.no_backing = true;
    settings.err = &streams.err;
    settings.warn = [&streams](absl::string_view warnings) {
      PrintWarnings(warnings, streams.err);
    };
    return io::RunSync(*engine, block::OpenGraph(file_options, std::move(settings)));
  };
  const bool share_write = format.empty() || format == "raw" || format == "file";
  absl::StatusOr<block::OpenedGraph> graph = open_file(share_write);
  if (!graph.ok()) return CouldNotOpen(filename, graph.status());
  auto close = [&]() { return io::RunSync(*engine, graph->node->Close()); };

  if (format.empty()) {
    absl::StatusOr<std::string> probed = ProbeFormat(*engine, *graph->node);
    if (!probed.ok()) {
      close().IgnoreError();
      return CouldNotOpen(filename, probed.status());
    }
    if (*probed == "qcow") {
      close().IgnoreError();
      return CouldNotOpen(filename, absl::UnimplementedError(
                                        "Format 'qcow' is not supported yet"));
    }
    if (*probed == "raw" && !read_only) {
      // qemu-img warns when a probed raw image is opened for writing.
      streams.err
          << "WARNING: Image format was not specified for '" << filename
          << "' and probing guessed raw.\n"
             "         Automatically detecting the format is dangerous for "
             "raw images, write operations on block 0 will be restricted.\n"
             "         Specify the 'raw' format explicitly to remove the "
             "restrictions.\n";
    }
    format = *probed;
    options->values["driver"] = format;
    if (format == "qcow2") {
      RETURN_IF_ERROR(close());
      graph = open_file(/*share_write=*/false);
      if (!graph.ok()) return CouldNotOpen(filename, graph.status());
    }
  }
  io::BlockNode& node = *graph->node;
  // The image with its whole graph (backing chain, filters), as qemu-img
  // opens it: read-only ones share everything, like the check itself.
  const std::string qcow2_format = image_opts ? "" : "qcow2";
  auto whole_image = [&](const std::string& fmt, bool writable) {
    ImageSpec spec;
    spec.filename = filename;
    spec.format = fmt;
    spec.image_opts = image_opts;
    spec.cache = cache;
    spec.read_only = !writable;
    spec.force_share = !writable;
    spec.queue_depth = 1;
    return spec;
  };
  if (format != "file") {
    if (absl::Status st = block::CheckNodeOptions(*options, read_only,
                                                  /*no_backing=*/false);
        !st.ok()) {
      close().IgnoreError();
      return CouldNotOpen(filename, st);
    }
  }
  if (format != "qcow2") {
    RETURN_IF_ERROR(close());
    if (format != "file" && format != "raw") {
      // A filter or a format over another node (preallocate, ...): its own
      // open errors come before "does not support checks".
      ASSIGN_OR_RETURN(OpenedImage opened,
                       OpenImage(whole_image(user_format, /*writable=*/false),
                                 streams.err));
      RETURN_IF_ERROR(CloseImage(opened));
    }
    return WithExitCode(
        absl::UnimplementedError("This image format does not support checks"),
        63);
  }
  {
    // qemu-img opens the image with its backing chain before checking it:
    // a backing file that cannot be opened fails the check.
    absl::StatusOr<OpenedImage> opened =
        OpenImage(whole_image(qcow2_format, /*writable=*/false), streams.err);
    if (opened.ok()) {
      CloseImage(*opened).IgnoreError();
    } else if (absl::StrContains(opened.status().message(),
                                 "Could not open backing file: ")) {
      close().IgnoreError();
      return opened.status();
    }
  }

  std::ostringstream messages;
  absl::StatusOr<qcow2::CheckResult> result =
      io::RunSync(*engine, qcow2::CheckQcow2(node, repair, messages));
  streams.err << WithProgramPrefix(messages.str());
  absl::Status closed = close();
  if (!result.ok()) {
    // The checker names the file node; qemu-img names the image as given
    // (the --image-opts string or json: filename).
    absl::string_view message = result.status().message();
    if (absl::ConsumePrefix(&message, absl::StrCat("Could not open '",
                                                   node.filename(), "': "))) {
      return CouldNotOpen(filename,
                          absl::Status(result.status().code(), message));
    }
    return result.status();
  }
  if (!closed.ok()) {
    return absl::Status(closed.code(),
                        absl::StrCat("Check failed: ", closed.message()));
  }
  const qcow2::CheckResult& r = *result;
  if (!read_only && r.has_bitmaps) {
    // qemu-img check -r opens the image read-write: the qcow2 driver loads
    // the bitmaps (marking them in use) and at close stores them again in
    // new clusters, freeing the old ones (qcow2_store_persistent_dirty_
    // bitmaps; a free that fails is reported and skipped). The same open
    // and close here, after the repair, leave the same file.
    absl::StatusOr<OpenedImage> opened =
        OpenImage(whole_image(qcow2_format, /*writable=*/true), streams.err);
    absl::Status stored =
        opened.ok() ? CloseImage(*opened) : opened.status();
    if (!stored.ok()) {
      return absl::Status(stored.code(),
                          absl::StrCat("Check failed: ", stored.message()));
    }
  }

  if (!quiet) {
    if (json) {
      streams.out << PrintJson(JsonReport(r, filename)) << "\n";
    } else {
      if (r.corruptions_fixed != 0 || r.leaks_fixed != 0) {
        streams.out << "The following inconsistencies were found and "
                       "repaired:\n\n    "
                    << r.leaks_fixed << " leaked clusters\n    "
                    << r.corruptions_fixed
                    << " corruptions\n\nDouble checking the fixed image "
                       "now...\n";
      }
      streams.out << HumanReport(r);
    }
  }
  if (r.check_errors != 0) return absl::InternalError("Check failed");
  if (r.corruptions != 0) {
    return WithExitCode(absl::Status(absl::StatusCode::kDataLoss, ""), 2);
  }
  if (r.leaks != 0) {
    return WithExitCode(absl::Status(absl::StatusCode::kDataLoss, ""), 3);
  }
  return absl::OkStatus();
}

}  // namespace imgtool::cli
