// imgtool dd [-f FMT] [-O OUTPUT_FMT] [-U] [bs=BLOCK_SIZE] [count=BLOCKS]
// [skip=BLOCKS] if=INPUT of=OUTPUT: qemu-img 7.2's dd. Creates OUTPUT
// (format -O, raw by default, with the format's default options) as large
// as what is copied: the input (its virtual size) cut to count * bs bytes
// when that is smaller, minus the skip * bs bytes skipped at its start (0
// when skip reaches past the end: then "<input>: cannot skip to specified
// offset" is printed and the command still succeeds, as in qemu-img). Every
// byte is written, zeroes included (qemu-img writes each block as read), so
// a qcow2 output is fully allocated as qemu-img makes it. The copy runs on
// the copy engine (block/copy.h; in order, two 512 KiB requests in flight)
// when the skipped bytes and the copied length are whole sectors, else
// block by block as qemu-img does.
#include <getopt.h>

#include <climits>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "base/align.h"
#include "base/errno_status.h"
#include "base/size.h"
#include "base/status_macros.h"
#include "block/copy.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "imgtool/qcow2_create.h"
#include "io/aligned_buffer.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/task.h"
#include "posix_file/file_options.pb.h"

namespace imgtool::cli {
namespace {

constexpr char kUsage[] =
    "Usage: imgtool dd [--image-opts] [-U] [-f FMT] [-O OUTPUT_FMT] "
    "[bs=BLOCK_SIZE] [count=BLOCKS] [skip=BLOCKS] if=INPUT of=OUTPUT";

constexpr char kHelp[] =
    "Usage: imgtool dd [--image-opts] [-U] [-f FMT] [-O OUTPUT_FMT] "
    "[bs=BLOCK_SIZE]\n"
    "        [count=BLOCKS] [skip=BLOCKS] if=INPUT of=OUTPUT\n"
    "Copies INPUT into the new image OUTPUT, converting it from FMT to\n"
    "OUTPUT_FMT.\n"
    "  -f FMT           format of INPUT (raw, file, qcow2); probed if absent\n"
    "  --image-opts     INPUT is an option string (driver=qcow2,...)\n"
    "  -O OUTPUT_FMT    format of OUTPUT: raw (default), file or qcow2\n"
    "  -U, --force-share  open INPUT without taking its locks\n"
    "  bs=BLOCK_SIZE    bytes per block (default 512; k, M, G suffixes)\n"
    "  count=BLOCKS     copy at most BLOCKS blocks from the start of INPUT\n"
    "                   (the skipped ones included, as qemu-img counts)\n"
    "  skip=BLOCKS      skip BLOCKS blocks at the start of INPUT\n";

enum LongOption { kObject = 256, kImageOpts };

const struct option kLongOptions[] = {
    {"help", no_argument, nullptr, 'h'},
    {"object", required_argument, nullptr, kObject},
    {"image-opts", no_argument, nullptr, kImageOpts},
    {"force-share", no_argument, nullptr, 'U'},
    {nullptr, 0, nullptr, 0},
};

struct DdArgs {
  std::string format;
  std::string output_format = "raw";
  bool image_opts = false;
  bool force_share = false;
  uint64_t block_size = 512;
  std::optional<uint64_t> count;
  std::optional<uint64_t> skip;
  std::optional<std::string> input;
  std::optional<std::string> output;
};

// qemu-img's cvtnum_full(name, value, min, max) messages.
absl::StatusOr<uint64_t> ParseNumber(const std::string& name,
                                     const std::string& value, uint64_t min,
                                     uint64_t max) {
  absl::StatusOr<uint64_t> v = ParseSize(value);
  const std::string range =
      absl::StrCat("Invalid ", name, " specified. Must be between ", min,
                   " and ", max, ".");
  if (!v.ok()) {
    if (absl::StrContains(v.status().message(), "Must be between")) {
      return absl::InvalidArgumentError(range);
    }
    return PrefixEachLine(absl::InvalidArgumentError(absl::StrReplaceAll(
        v.status().message(),
        {{"Invalid image size", absl::StrCat("Invalid ", name)}})));
  }
  if (*v < min || *v > max) return absl::InvalidArgumentError(range);
  return *v;
}

// One `key=value` operand.
absl::Status ApplyOperand(const std::string& operand, DdArgs& a) {
  const size_t eq = operand.find('=');
  if (eq == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("unrecognized operand ", operand));
  }
  const std::string key = operand.substr(0, eq);
  const std::string value = operand.substr(eq + 1);
  if (key == "bs") {
    ASSIGN_OR_RETURN(a.block_size, ParseNumber("bs", value, 1, INT_MAX));
  } else if (key == "count") {
    ASSIGN_OR_RETURN(a.count, ParseNumber("count", value, 0, INT64_MAX));
  } else if (key == "if") {
    a.input = value;
  } else if (key == "of") {
    a.output = value;
  } else if (key == "skip") {
    ASSIGN_OR_RETURN(a.skip, ParseNumber("skip", value, 0, INT64_MAX));
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unrecognized operand ", key));
  }
  return absl::OkStatus();
}

// Block by block, as qemu-img's loop (any bs and skip).
io::Task<absl::Status> CopyBlocks(io::BlockNode& in, io::BlockNode& out,
                                  uint64_t in_pos, uint64_t size,
                                  uint64_t block_size) {
  io::AlignedBuffer buf(block_size);
  uint64_t out_pos = 0;
  while (in_pos < size) {
    const uint64_t n = std::min(block_size, size - in_pos);
    absl::Status st = co_await in.Read(in_pos, io::IoVec(buf.data(), n));
    if (!st.ok()) {
      co_return WithMessage(
          st, absl::StrCat("error while reading from input image file: ",
                           block::RequestError(st)));
    }
    in_pos += n;
    st = co_await out.Write(out_pos, io::ConstIoVec(buf.data(), n));
    if (!st.ok()) {
      co_return WithMessage(
          st, absl::StrCat("error while writing to output image file: ",
                           block::RequestError(st)));
    }
    out_pos += n;
  }
  co_return absl::OkStatus();
}

// The engine's errors in dd's words.
absl::Status DdError(const absl::Status& st) {
  if (absl::StartsWith(st.message(), "error while writing")) {
    return WithMessage(st,
                       absl::StrCat("error while writing to output image "
                                    "file: ",
                                    block::RequestError(st)));
  }
  return WithMessage(st, absl::StrCat("error while reading from input image "
                                      "file: ",
                                      block::RequestError(st)));
}

absl::Status Dd(const DdArgs& a, std::vector<OpenedImage>& images,
                Streams streams) {
  ImageSpec in_spec;
  in_spec.filename = *a.input;
  in_spec.format = a.format;
  in_spec.image_opts = a.image_opts;
  in_spec.read_only = true;
  in_spec.force_share = a.force_share;
  ASSIGN_OR_RETURN(OpenedImage input, OpenImage(in_spec, streams.err));
  images.push_back(std::move(input));
  OpenedImage& in = images.back();

  if (absl::Status st = CheckFormat(a.output_format, /*for_create=*/true);
      !st.ok()) {
    // qemu-img dd does not name the format.
    if (st.code() == absl::StatusCode::kInvalidArgument) {
      return absl::InvalidArgumentError("Unknown file format");
    }
    return st;
  }
  uint64_t size = VirtualSize(in);
  const uint64_t bs = a.block_size;
  if (a.count.has_value() && *a.count <= INT64_MAX / bs &&
      *a.count * bs < size) {
    size = *a.count * bs;
  }
  // skip past the end: an empty output, and a message (not an error).
  const bool skip_past_end =
      a.skip.has_value() && (*a.skip > INT64_MAX / bs || size < *a.skip * bs);
  const uint64_t skipped = a.skip.has_value() && !skip_past_end ? *a.skip * bs : 0;
  const uint64_t out_size = skip_past_end ? 0 : size - skipped;

  const std::string& output = *a.output;
  absl::Status created;
  if (a.output_format == "qcow2") {
    Qcow2CreateValues values;
    values.SetNumber("size", out_size);
    created = CreateQcow2File(output, values, streams.err);
  } else {
    posix_file::FileCreateOptions options;
    options.set_size(out_size);
    created =
        CreateFileForFormat(a.output_format, output, options, streams.err);
  }
  if (!created.ok()) {
    absl::string_view cause = created.message();
    absl::ConsumePrefix(&cause, absl::StrCat(output, ": "));
    return WithMessage(created,
                       absl::StrCat(output,
                                    ": error while creating output image: ",
                                    cause));
  }
  ImageSpec out_spec;
  out_spec.filename = output;
  out_spec.format = a.output_format;
  out_spec.read_only = false;
  ASSIGN_OR_RETURN(OpenedImage out, OpenImage(out_spec, streams.err, in.engine));
  images.push_back(std::move(out));
  OpenedImage& target = images.back();
  io::BlockNode& in_node = *images.front().node;

  if (skip_past_end) {
    streams.err << ProgramName() << ": " << *a.input
                << ": cannot skip to specified offset\n";
    return absl::OkStatus();
  }
  const uint64_t length = size - skipped;
  if (skipped % block::kSectorSize != 0 || length % block::kSectorSize != 0) {
    return io::RunSync(*target.engine,
                       CopyBlocks(in_node, *target.node, skipped, size, bs));
  }
  block::CopySettings settings;
  settings.min_sparse_sectors = 0;
  settings.zero_ranges_as_data = true;
  settings.target_is_zero = true;
  settings.in_order = true;
  // Two requests of 512 KiB in flight: sequential reads stay fast, and the
  // buffers add 1 MiB (qemu-img's one block of bs bytes is its only one).
  settings.num_workers = 2;
  settings.max_chunk = 512 << 10;
  std::vector<block::CopySource> sources = {
      {&in_node, 0, length, block::SourceView::kWholeChain, nullptr,
       skipped}};
  absl::Status st = io::RunSync(
      *target.engine, block::Copy(std::move(sources), *target.node, settings));
  if (!st.ok()) return DdError(st);
  return absl::OkStatus();
}

}  // namespace

absl::Status RunDd(const std::vector<std::string>& args, Streams streams) {
  DdArgs a;
  bool help = false;
  ASSIGN_OR_RETURN(
      std::vector<std::string> operands,
      ParseOptions(args, "hf:O:U", kLongOptions, kUsage,
                   [&](int c, const std::string& arg) -> absl::Status {
                     switch (c) {
                       case 'h': help = true; break;
                       case 'f': a.format = arg; break;
                       case 'O': a.output_format = arg; break;
                       case 'U': a.force_share = true; break;
                       case kImageOpts: a.image_opts = true; break;
                     }
                     return absl::OkStatus();
                   }));
  if (help) {
    streams.out << kHelp;
    return absl::OkStatus();
  }
  for (const std::string& operand : operands) {
    RETURN_IF_ERROR(ApplyOperand(operand, a));
  }
  if (!a.input.has_value() || !a.output.has_value()) {
    return absl::InvalidArgumentError(
        "Must specify both input and output files");
  }
  std::vector<OpenedImage> images;
  absl::Status status = Dd(a, images, streams);
  for (auto it = images.rbegin(); it != images.rend(); ++it) {
    absl::Status closed = CloseImage(*it);
    if (status.ok()) status = closed;
  }
  return status;
}

}  // namespace imgtool::cli
