// imgtool map [-f FMT] [--output=human|json] [--start-offset=OFF]
// [--max-length=LEN] [-U] FILE: the image's extents from block status,
// merged and printed exactly as qemu-img 7.2 prints them.
#include <getopt.h>

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "base/size.h"
#include "base/status_macros.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "posix_file/file_node.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::cli {
namespace {

constexpr char kUsage[] =
    "Usage: imgtool map [-f FMT] [--output=human|json] [--start-offset=OFF] "
    "[--max-length=LEN] [-U] FILE";

constexpr char kHelp[] =
    "Usage: imgtool map [-f FMT] [--output=human|json] [--start-offset=OFF] "
    "[--max-length=LEN] [-U] FILE\n"
    "Lists the extents of an image and where their data is.\n"
    "  -f FMT                image format (raw, file, qcow2); probed if "
    "absent\n"
    "  --image-opts          FILE is an option string such as\n"
    "                        driver=qcow2,file.driver=preallocate,"
    "file.file.filename=x\n"
    "  --output=human|json   human: data extents only; json: every extent\n"
    "  --start-offset=OFF    first byte to map (default 0)\n"
    "  --max-length=LEN      bytes to map from OFF (default: to the end)\n"
    "  -U, --force-share     open read-only without taking the image locks\n";

enum LongOption { kOutput = 256, kObject, kImageOpts, kStartOffset,
                  kMaxLength };

const struct option kLongOptions[] = {
    {"help", no_argument, nullptr, 'h'},
    {"format", required_argument, nullptr, 'f'},
    {"output", required_argument, nullptr, kOutput},
    {"object", required_argument, nullptr, kObject},
    {"image-opts", no_argument, nullptr, kImageOpts},
    {"start-offset", required_argument, nullptr, kStartOffset},
    {"max-length", required_argument, nullptr, kMaxLength},
    {"force-share", no_argument, nullptr, 'U'},
    {nullptr, 0, nullptr, 0},
};

// One line of the map (qemu-img's MapEntry). Offsets and lengths in bytes.
struct MapEntry {
  uint64_t start = 0;
  uint64_t length = 0;
  int depth = 0;
  bool present = false;
  bool zero = false;
  bool data = false;
  bool has_offset = false;
  uint64_t offset = 0;
  const io::BlockNode* file = nullptr;  // node holding the data, if known
};

// qemu-img's rule: same flags, same file, and contiguous host offsets.
bool Mergeable(const OpenedImage& image, const MapEntry& curr,
               const MapEntry& next) {
  if (curr.length == 0) return false;
  if (curr.zero != next.zero || curr.data != next.data ||
      curr.depth != next.depth || curr.present != next.present ||
      (curr.file == nullptr) != (next.file == nullptr) ||
      curr.has_offset != next.has_offset) {
    return false;
  }
  if (curr.file != nullptr &&
      NodeName(image, curr.file) != NodeName(image, next.file)) {
    return false;
  }
  if (curr.has_offset && curr.offset + curr.length != next.offset) {
    return false;
  }
  return true;
}

// The length of a node in whole sectors as QEMU sees it: a raw file rounded
// up to 512 bytes (the rest reads as zeroes), a qcow2 image rounded down.
uint64_t SectorLength(const io::BlockNode& node) {
  if (dynamic_cast<const qcow2::Qcow2Node*>(&node) != nullptr) {
    return node.size() / 512 * 512;
  }
  return (node.size() + 511) / 512 * 512;
}

// The O_DIRECT request alignment of the file holding a raw node's data (1
// for buffered files and nodes that are not files).
uint64_t RequestAlignment(const io::BlockNode* file) {
  const auto* f = dynamic_cast<const posix_file::FileNode*>(file);
  return f != nullptr ? f->request_alignment() : 1;
}

// The state of [offset, offset + bytes) from its start, through the backing
// chain as qemu-img map walks it: the first node that has the range
// allocated (data or zero) answers at its depth; a node without a backing
// file, or whose backing file ends before `offset`, answers "zero, not
// present" at its own depth; a raw file always answers (present). Filters
// (blkdebug, copy-on-read, compress, preallocate) are looked through at
// every depth, the top included, as qemu-img's bdrv_skip_filters: the node
// they filter answers, with its backing file below it.
absl::StatusOr<MapEntry> GetEntry(OpenedImage& image, uint64_t offset,
                                  uint64_t bytes) {
  MapEntry e;
  e.start = offset;
  io::BlockNode* node = image.node.get();
  for (int depth = 0;; ++depth) {
    while (node->filtered_child() != nullptr) node = node->filtered_child();
    e.depth = depth;
    const uint64_t node_size = node->size();
    if (offset >= node_size) {
      // A raw file's tail up to the 512-byte rounded length: zeroes.
      e.length = bytes;
      e.present = true;
      e.zero = true;
      e.has_offset = true;
      e.offset = offset;
      e.file = node;
      return e;
    }
    ASSIGN_OR_RETURN(
        io::BlockStatus status,
        io::RunSync(*image.engine,
                    node->GetBlockStatus(
                        offset, std::min(bytes, node_size - offset))));
    const bool is_format = dynamic_cast<qcow2::Qcow2Node*>(node) != nullptr;
    if (!is_format && status.data && offset + status.length == node_size) {
      // A data extent that ends at an end of file off the O_DIRECT
      // request alignment reaches the next aligned offset, within the
      // sectors asked for (QEMU's file-posix block status may not return
      // a partial block there), so the tail is not split into data and
      // zeroes.
      const uint64_t align = RequestAlignment(status.file);
      if (node_size % align != 0) {
        const uint64_t aligned_end = node_size / align * align + align;
        status.length = std::min(
            {aligned_end, SectorLength(*node), offset + bytes}) - offset;
      }
    }
    bytes = status.length;
    e.length = status.length;
    if (!status.data && !status.zero && !is_format &&
        node->backing() == nullptr) {
      // Neither data nor zeroes from a node without a backing file and
      // without QEMU's supports_backing (null-co without read-zeroes):
      // qemu-img map reports it as nothing at all.
      e.present = false;
      e.file = nullptr;
      return e;
    }
    if (status.data || status.zero || !is_format) {
      e.data = status.data;
      e.zero = status.zero;
      e.present = true;
      e.has_offset = status.offset_valid;
      e.offset = status.host_offset;
      e.file = status.file != nullptr ? status.file : node;
      if (!e.has_offset) e.file = nullptr;
      return e;
    }
    io::BlockNode* backing = node->backing();
    if (backing == nullptr || offset >= SectorLength(*backing)) {
      // Reads as zeroes; a host cluster reserved for the range (extended
      // L2) still has its offset.
      e.zero = true;
      e.present = false;
      e.has_offset = status.offset_valid;
      e.offset = status.host_offset;
      e.file = status.offset_valid ? status.file : nullptr;
      return e;
    }
    node = backing;
  }
}

std::string Hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%#-16" PRIx64, v);
  return buf;
}

// Prints one entry; `last` says whether another follows (JSON separator).
absl::Status DumpEntry(const OpenedImage& image, const MapEntry& e, bool json,
                       bool last, std::ostream& out) {
  if (json) {
    out << "{ \"start\": " << e.start << ", \"length\": " << e.length
        << ", \"depth\": " << e.depth
        << ", \"present\": " << (e.present ? "true" : "false")
        << ", \"zero\": " << (e.zero ? "true" : "false")
        << ", \"data\": " << (e.data ? "true" : "false");
    if (e.has_offset) out << ", \"offset\": " << e.offset;
    out << "}";
    if (!last) out << ",\n";
    return absl::OkStatus();
  }
  if (e.data && !e.has_offset) {
    return absl::DataLossError(
        "File contains external, encrypted or compressed clusters.");
  }
  if (e.data && !e.zero) {
    out << Hex(e.start) << Hex(e.length) << Hex(e.has_offset ? e.offset : 0)
        << (e.file != nullptr ? NodeName(image, e.file) : "") << "\n";
  }
  return absl::OkStatus();
}

// cvtnum() of qemu-img with `what` naming the value in its messages.
absl::StatusOr<uint64_t> ParseNumber(const std::string& what,
                                     const std::string& text) {
  absl::StatusOr<uint64_t> v = ParseSize(text);
  if (v.ok()) return v;
  return PrefixEachLine(absl::InvalidArgumentError(absl::StrReplaceAll(
      v.status().message(), {{"Invalid image size", "Invalid " + what}})));
}

}  // namespace

absl::Status RunMap(const std::vector<std::string>& args, Streams streams) {
  ImageSpec spec;
  std::string output = "human";
  uint64_t start_offset = 0;
  std::optional<uint64_t> max_length;
  bool help = false;
  ASSIGN_OR_RETURN(
      std::vector<std::string> operands,
      ParseOptions(
          args, "f:hU", kLongOptions, kUsage,
          [&](int c, const std::string& arg) -> absl::Status {
            switch (c) {
              case 'f': spec.format = arg; break;
              case 'h': help = true; break;
              case 'U': spec.force_share = true; break;
              case kOutput: output = arg; break;
              case kImageOpts: spec.image_opts = true; break;
              case kStartOffset: {
                ASSIGN_OR_RETURN(start_offset,
                                 ParseNumber("start offset", arg));
                break;
              }
              case kMaxLength: {
                ASSIGN_OR_RETURN(max_length, ParseNumber("max length", arg));
                break;
              }
            }
            return absl::OkStatus();
          }));
  if (help) {
    streams.out << kHelp;
    return absl::OkStatus();
  }
  if (operands.size() != 1) {
    return UsageError("Expecting one image file name", kUsage);
  }
  ASSIGN_OR_RETURN(const bool json, ParseOutputFormat(output));
  if (spec.image_opts && !spec.format.empty()) {
    return absl::InvalidArgumentError(
        "--image-opts and --format are mutually exclusive");
  }
  spec.filename = operands[0];
  spec.read_only = true;
  spec.queue_depth = 1;

  ASSIGN_OR_RETURN(OpenedImage image, OpenImage(spec, streams.err));
  uint64_t length = VirtualSize(image);
  if (max_length.has_value()) {
    // Both values are at most INT64_MAX: no overflow.
    length = std::min(start_offset + *max_length, length);
  }

  if (json) {
    streams.out << "[";
  } else {
    streams.out << "Offset          Length          Mapped to       File\n";
  }
  absl::Status status;
  MapEntry curr;
  curr.start = start_offset;
  while (curr.start + curr.length < length) {
    const uint64_t offset = curr.start + curr.length;
    absl::StatusOr<MapEntry> next = GetEntry(image, offset, length - offset);
    if (!next.ok()) {
      status = absl::Status(
          next.status().code(),
          absl::StrCat("Could not read file metadata: ",
                       next.status().message()));
      break;
    }
    if (Mergeable(image, curr, *next)) {
      curr.length += next->length;
      continue;
    }
    if (curr.length > 0) {
      status = DumpEntry(image, curr, json, /*last=*/false, streams.out);
      if (!status.ok()) break;
    }
    curr = *next;
  }
  if (status.ok()) {
    status = DumpEntry(image, curr, json, /*last=*/true, streams.out);
    if (json) streams.out << "]\n";
  }
  streams.out.flush();
  absl::Status close = CloseImage(image);
  RETURN_IF_ERROR(status);
  return close;
}

}  // namespace imgtool::cli
