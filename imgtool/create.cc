// imgtool create [-q] [-f FMT] [-b BACKING [-F FMT]] [-u] [-o OPTIONS] FILE
// [SIZE]: creates a raw image through posix_file::CreateFile, or a qcow2
// image by creating an empty file and writing qcow2::CreateQcow2 onto it,
// printing qemu-img's "Formatting ..." line.
#include <getopt.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "base/errno_status.h"
#include "base/options.h"
#include "base/size.h"
#include "base/status_macros.h"
#include "block/registry.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "imgtool/qcow2_create.h"
#include "posix_file/file_node.h"

namespace imgtool::cli {
namespace {

constexpr char kUsage[] =
    "Usage: imgtool create [-q] [-f FMT] [-b BACKING [-F BACKING_FMT]] [-u] "
    "[-o OPTIONS] FILE [SIZE]";

constexpr char kHelp[] =
    "Usage: imgtool create [-q] [-f FMT] [-b BACKING [-F BACKING_FMT]] [-u] "
    "[-o OPTIONS] FILE [SIZE]\n"
    "Creates the image FILE of SIZE bytes (k, M, G, T, P, E suffixes).\n"
    "  -f FMT        image format: raw (default), file or qcow2\n"
    "  -o OPTIONS    comma-separated format options; '-o help' lists them\n"
    "  -q            quiet: no \"Formatting\" line\n"
    "  -b BACKING    backing file of a qcow2 image (SIZE defaults to its "
    "size)\n"
    "  -F FMT        format of the backing file (required with -b)\n"
    "  -u            do not open the backing file\n";

// The create options of raw over the `file` protocol, in QEMU's list order
// (the order of the "Formatting" line) and as `-o help` prints them.
constexpr char kSizeHelp[] = "  size=<size>            - Virtual disk size\n";
// QEMU's bdrv_create_opts_simple: the options of host_device and
// host_cdrom, and of raw over a device.
constexpr char kSimpleOptionsHelp[] =
    "  preallocation=<str>    - Preallocation mode (allowed values: off)\n"
    "  size=<size>            - Virtual disk size\n";
constexpr char kFileOptionsHelp[] =
    "  extent_size_hint=<size> - Extent size hint for the image file, 0 to "
    "disable\n"
    "  nocow=<bool (on/off)>  - Turn off copy-on-write (valid only on btrfs)\n"
    "  preallocation=<str>    - Preallocation mode (allowed values: off, "
    "falloc, full)\n"
    "  size=<size>            - Virtual disk size\n";
constexpr char kProtocolHint[] =
    "\nThe protocol level may support further options.\n"
    "Specify the target filename to include those options.\n";

enum LongOption { kObject = 256 };

const struct option kLongOptions[] = {
    {"help", no_argument, nullptr, 'h'},
    {"object", required_argument, nullptr, kObject},
    {nullptr, 0, nullptr, 0},
};

// The values of the -o options after parsing, as printed on the
// "Formatting" line (the last value of a key wins, as in qemu-img).
struct CreateOptionValues {
  std::optional<uint64_t> size;
  std::optional<std::string> nocow;  // as the user spelled it
  std::optional<bool> nocow_value;
  std::optional<std::string> preallocation;
  std::optional<uint64_t> extent_size_hint;
};

absl::Status ApplyOptions(const std::string& text, CreateOptionValues* v) {
  ASSIGN_OR_RETURN(OptionList list, ParseOptionItems(text));
  for (const auto& [key, value] : list) {
    if (key == "help") continue;
    if (key == "size") {
      ASSIGN_OR_RETURN(v->size, ParseSizeOption(key, value));
    } else if (key == "nocow") {
      ASSIGN_OR_RETURN(v->nocow_value, ParseBoolOption(key, value));
      v->nocow = value;
    } else if (key == "preallocation") {
      v->preallocation = value;
    } else if (key == "extent_size_hint") {
      ASSIGN_OR_RETURN(v->extent_size_hint, ParseSizeOption(key, value));
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("Invalid parameter '", key, "'"));
    }
  }
  return absl::OkStatus();
}

bool HasHelpOption(const std::vector<std::string>& option_texts) {
  for (const std::string& text : option_texts) {
    absl::StatusOr<OptionList> list = ParseOptionItems(text);
    if (!list.ok()) continue;
    for (const auto& item : *list) {
      if (item.first == "help") return true;
    }
  }
  return false;
}

// Puts "<filename>: " before a message, as qemu-img does for every error of
// the creation itself, unless the message already starts with the name.
absl::Status Named(const std::string& filename, const absl::Status& st) {
  if (absl::StartsWith(st.message(), absl::StrCat(filename, ": "))) return st;
  return WithMessage(st, absl::StrCat(filename, ": ", st.message()));
}

// Opens the backing file of a new image (qemu-img create without -u):
// read-only, sharing everything, with its own backing chain. Returns its
// format and virtual size; errors carry the cause without "Could not open
// '<backing>': " (qemu-img adds "Could not open backing image.").
struct BackingInfo {
  std::string format;
  uint64_t size = 0;
};
absl::StatusOr<BackingInfo> ProbeBacking(const std::string& path,
                                         const std::string& format,
                                         std::ostream& err) {
  ImageSpec spec;
  spec.filename = path;
  spec.format = format;
  spec.read_only = true;
  spec.force_share = true;
  spec.queue_depth = 1;
  absl::StatusOr<OpenedImage> image = OpenImage(spec, err);
  if (!image.ok()) {
    absl::string_view cause = image.status().message();
    absl::ConsumePrefix(&cause, absl::StrCat("Could not open '", path, "': "));
    return absl::Status(image.status().code(), cause);
  }
  BackingInfo info{image->format, VirtualSize(*image)};
  RETURN_IF_ERROR(CloseImage(*image));
  return info;
}

// qemu-img's bdrv_img_create for qcow2: options, backing file checks (and
// the size from the backing file), the "Formatting" line, then the image.
absl::Status CreateQcow2Image(const std::string& filename,
                              const std::vector<std::string>& option_texts,
                              std::optional<uint64_t> size,
                              const std::optional<std::string>& backing_file,
                              const std::optional<std::string>& backing_format,
                              bool open_backing, bool quiet, Streams streams) {
  Qcow2CreateValues values;
  for (const std::string& text : option_texts) {
    if (absl::Status st = values.Apply(text); !st.ok()) {
      return Named(filename, st);
    }
  }
  if (values.Has("size") && size.has_value()) {
    return Named(filename, absl::InvalidArgumentError(
                               "The image size must be specified only once"));
  }
  if (size.has_value()) values.SetNumber("size", *size);
  if (backing_file.has_value()) values.SetString("backing_file", *backing_file);
  if (backing_format.has_value()) {
    values.SetString("backing_fmt", *backing_format);
  }

  const std::optional<std::string> backing = values.Text("backing_file");
  const std::optional<std::string> backing_fmt = values.Text("backing_fmt");
  if (backing.has_value()) {
    if (*backing == filename) {
      return Named(filename,
                   absl::InvalidArgumentError(
                       "Error: Trying to create an image with the same "
                       "filename as the backing file"));
    }
    if (backing->empty()) {
      return Named(filename,
                   absl::InvalidArgumentError(
                       "Expected backing file name, got empty string"));
    }
  }
  if (backing.has_value() && open_backing) {
    // QEMU resolves a relative backing name against the image's directory,
    // which an empty image name does not have.
    if (filename.empty() && IsRelativeFilename(*backing)) {
      return Named(filename, absl::InvalidArgumentError(
                                 "Cannot use relative backing file names "
                                 "for ''"));
    }
    absl::StatusOr<BackingInfo> info =
        ProbeBacking(ResolveBackingFilename(filename, *backing),
                     backing_fmt.value_or(""), streams.err);
    if (!info.ok()) {
      return Named(filename,
                   absl::Status(info.status().code(),
                                absl::StrCat(info.status().message(),
                                             "\nCould not open backing "
                                             "image.")));
    }
    if (!backing_fmt.has_value()) {
      // qemu-img prints this hint without a final newline; the status
      // has no message left for main to print.
      streams.err << ProgramName() << ": " << filename
                  << ": Backing file specified without backing format\n"
                     "Detected format of "
                  << info->format << ".";
      return absl::InvalidArgumentError("");
    }
    if (!values.Has("size")) values.SetNumber("size", info->size);
  } else if (backing.has_value() && !backing_fmt.has_value()) {
    return Named(filename,
                 absl::InvalidArgumentError(
                     "Backing file specified without backing format"));
  }
  if (!values.Has("size")) {
    return Named(filename, absl::InvalidArgumentError(
                               "Image creation needs a size parameter"));
  }

  if (!quiet) {
    streams.out << values.FormattingLine(filename) << "\n";
    streams.out.flush();
  }
  absl::Status st = CreateQcow2File(filename, values, streams.err);
  if (!st.ok()) return Named(filename, st);
  return absl::OkStatus();
}

}  // namespace

absl::Status RunCreate(const std::vector<std::string>& args, Streams streams) {
  std::string format = "raw";
  std::optional<std::string> backing_file;
  std::optional<std::string> backing_format;
  std::vector<std::string> option_texts;
  bool quiet = false;
  bool help = false;
  bool open_backing = true;
  ASSIGN_OR_RETURN(
      std::vector<std::string> operands,
      ParseOptions(
          args, "F:b:f:ho:qu", kLongOptions, kUsage,
          [&](int c, const std::string& arg) -> absl::Status {
            switch (c) {
              case 'F': backing_format = arg; break;
              case 'b': backing_file = arg; break;
              case 'f': format = arg; break;
              case 'h': help = true; break;
              case 'o':
                if (!IsValidOptionList(arg)) {
                  return absl::InvalidArgumentError(
                      absl::StrCat("Invalid option list: ", arg));
                }
                option_texts.push_back(arg);
                break;
              case 'q': quiet = true; break;
              case 'u': open_backing = false; break;
            }
            return absl::OkStatus();
          }));
  if (help) {
    streams.out << kHelp;
    return absl::OkStatus();
  }

  if (HasHelpOption(option_texts)) {
    RETURN_IF_ERROR(CheckFormat(format, /*for_create=*/true));
    if (format == "qcow2") {
      if (!operands.empty()) {
        streams.out << "Supported options:\n" << Qcow2OptionHelp(true);
      } else {
        streams.out << "Supported qcow2 options:\n"
                    << Qcow2OptionHelp(false) << kProtocolHint;
      }
    } else if (!operands.empty()) {
      // The protocol's options merged with the format's (QEMU's
      // qemu_opts_append; the format's line wins a name both have).
      const bool device = !block::HostDeviceDriverFor(operands[0]).empty();
      const bool simple = block::IsDeviceDriver(format);
      streams.out << "Supported options:\n";
      if (simple && !device) {
        // host_device's options over a file: file's extras, then
        // host_device's preallocation (off only) and size.
        const absl::string_view file_help = kFileOptionsHelp;
        streams.out << file_help.substr(0, file_help.find("  preallocation"))
                    << kSimpleOptionsHelp;
      } else {
        streams.out << (device && format != "file" ? kSimpleOptionsHelp
                                                   : kFileOptionsHelp);
      }
    } else if (block::IsDeviceDriver(format)) {
      streams.out << "Supported " << format << " options:\n"
                  << kSimpleOptionsHelp << kProtocolHint;
    } else if (format == "file") {
      streams.out << "Supported file options:\n"
                  << kFileOptionsHelp << kProtocolHint;
    } else {
      streams.out << "Supported raw options:\n" << kSizeHelp << kProtocolHint;
    }
    return absl::OkStatus();
  }
  if (operands.empty()) return UsageError("Expecting image file name", kUsage);
  const std::string& filename = operands[0];
  std::optional<uint64_t> size;
  if (operands.size() >= 2) {
    absl::StatusOr<uint64_t> parsed = ParseSize(operands[1]);
    if (!parsed.ok()) return PrefixEachLine(parsed.status());
    size = *parsed;
  }
  if (operands.size() > 2) {
    return UsageError(absl::StrCat("Unexpected argument: ", operands[2]),
                      kUsage);
  }

  // From here on qemu-img names the file in every error.
  if (absl::Status st = CheckFormat(format, /*for_create=*/true); !st.ok()) {
    return Named(filename, st);
  }
  // The protocol (prefix) is checked before anything is printed, as
  // bdrv_img_create does.
  if (absl::StatusOr<std::string> path = block::CreatePath(filename);
      !path.ok() && !IsNbdName(filename)) {
    return Named(filename, path.status());
  }
  if (format == "qcow2") {
    return CreateQcow2Image(filename, option_texts, size, backing_file,
                            backing_format, open_backing, quiet, streams);
  }
  CreateOptionValues values;
  for (const std::string& text : option_texts) {
    if (absl::Status st = ApplyOptions(text, &values); !st.ok()) {
      return Named(filename, st);
    }
  }
  if (values.size.has_value() && size.has_value()) {
    return Named(filename, absl::InvalidArgumentError(
                               "The image size must be specified only once"));
  }
  if (!values.size.has_value()) values.size = size;
  const bool simple = block::IsDeviceDriver(format);
  if (simple && values.nocow.has_value()) {
    return Named(filename, absl::InvalidArgumentError("Invalid parameter 'nocow'"));
  }
  if (simple && values.extent_size_hint.has_value()) {
    return Named(filename, absl::InvalidArgumentError(
                               "Invalid parameter 'extent_size_hint'"));
  }
  if (backing_file.has_value()) {
    return Named(filename,
                 absl::InvalidArgumentError(absl::StrCat(
                     "Backing file not supported for file format '", format,
                     "'")));
  }
  if (backing_format.has_value()) {
    return Named(filename,
                 absl::InvalidArgumentError(absl::StrCat(
                     "Backing file format not supported for file format '",
                     format, "'")));
  }
  if (!values.size.has_value()) {
    return Named(filename, absl::InvalidArgumentError(
                               "Image creation needs a size parameter"));
  }

  if (!quiet) {
    // qemu-img prints sizes as signed 64-bit numbers and doubles commas in
    // string values.
    std::string line = absl::StrCat("Formatting '", filename, "', fmt=",
                                    format, " size=",
                                    static_cast<int64_t>(*values.size));
    if (values.nocow.has_value()) {
      absl::StrAppend(&line, " nocow=", *values.nocow);
    }
    if (values.preallocation.has_value()) {
      absl::StrAppend(&line, " preallocation=",
                      absl::StrReplaceAll(*values.preallocation, {{",", ",,"}}));
    }
    if (values.extent_size_hint.has_value()) {
      absl::StrAppend(&line, " extent_size_hint=",
                      static_cast<int64_t>(*values.extent_size_hint));
    }
    streams.out << line << "\n";
    streams.out.flush();
  }

  posix_file::FileCreateOptions options;
  options.set_size(*values.size);
  if (simple) {
    if (values.preallocation.has_value()) {
      options.set_preallocation(*values.preallocation);
    }
    return Named(filename,
                 CreateFileForFormat(format, filename, options, streams.err));
  }
  if (values.preallocation.has_value()) {
    const std::string& mode = *values.preallocation;
    if (mode == "metadata") {
      return Named(filename, absl::InvalidArgumentError(
                                 "Unsupported preallocation mode: metadata"));
    }
    if (mode != "off" && mode != "falloc" && mode != "full") {
      return Named(filename, absl::InvalidArgumentError(absl::StrCat(
                                 "invalid parameter value: ", mode)));
    }
    options.set_preallocation(mode);
  }
  if (values.extent_size_hint.has_value()) {
    if (*values.extent_size_hint > UINT32_MAX) {
      return Named(filename, absl::InvalidArgumentError(
                                 "Extent size hint is too large"));
    }
    options.set_extent_size_hint(*values.extent_size_hint);
  }
  options.set_nocow(values.nocow_value.value_or(false));
  absl::Status st = CreateImageFile(filename, options, streams.err);
  if (!st.ok()) return Named(filename, st);
  return absl::OkStatus();
}

}  // namespace imgtool::cli
