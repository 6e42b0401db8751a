// imgtool create [-q] [-f FMT] [-b BACKING [-F FMT]] [-u] [-o OPTIONS] FILE
// [SIZE]: creates a raw image through posix_file::CreateFile, or a qcow2
// image by creating an empty file and writing qcow2::CreateQcow2 onto it,
// printing qemu-img's "Formatting ..." line.
#include <getopt.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "base/errno_status.h"
#include "base/options.h"
#include "base/size.h"
#include "base/status_macros.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "io/engine.h"
#include "io/task.h"
#include "posix_file/file_node.h"
#include "qcow2/create.h"
#include "qcow2/qcow2_options.pb.h"

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
    "  -b BACKING    backing file of a qcow2 image (SIZE defaults to its size)\n"
    "  -F FMT        format of the backing file (required with -b)\n"
    "  -u            do not open the backing file\n";

// The create options of raw over the `file` protocol, in QEMU's list order
// (the order of the "Formatting" line) and as `-o help` prints them.
constexpr char kSizeHelp[] = "  size=<size>            - Virtual disk size\n";
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

// qemu-img's check on each -o argument before anything else: not empty, no
// leading comma, and an even number of trailing commas (",," is an escaped
// comma).
bool IsValidOptionList(const std::string& text) {
  if (text.empty() || text[0] == ',') return false;
  size_t trailing = 0;
  while (trailing < text.size() && text[text.size() - 1 - trailing] == ',') {
    ++trailing;
  }
  return trailing % 2 == 0;
}

// The values of the -o options after parsing, as printed on the
// "Formatting" line (the last value of a key wins, as in qemu-img).
struct CreateOptionValues {
  std::optional<uint64_t> size;
  std::optional<std::string> nocow;  // as the user spelled it
  std::optional<bool> nocow_value;
  std::optional<std::string> preallocation;
  std::optional<uint64_t> extent_size_hint;
};

absl::StatusOr<bool> ParseBool(const std::string& name,
                               const std::string& value) {
  if (value == "on" || value == "yes" || value == "true" || value == "y") {
    return true;
  }
  if (value == "off" || value == "no" || value == "false" || value == "n") {
    return false;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("Parameter '", name, "' expects 'on' or 'off'"));
}

// Splits an -o argument at its single commas (",," stays, as an escaped
// comma inside a value). Each item is parsed on its own so that a key
// given twice is not an error: as in qemu-img, the last value wins.
std::vector<std::string> SplitOptionItems(const std::string& text) {
  std::vector<std::string> items(1);
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == ',' && i + 1 < text.size() && text[i + 1] == ',') {
      items.back() += ",,";
      ++i;
    } else if (text[i] == ',') {
      items.emplace_back();
    } else {
      items.back() += text[i];
    }
  }
  return items;
}

absl::StatusOr<OptionList> ParseOptionItems(const std::string& text) {
  OptionList list;
  for (const std::string& item : SplitOptionItems(text)) {
    ASSIGN_OR_RETURN(OptionList one, ParseOptionString(item));
    list.insert(list.end(), one.begin(), one.end());
  }
  return list;
}

absl::Status ApplyOptions(const std::string& text, CreateOptionValues* v) {
  ASSIGN_OR_RETURN(OptionList list, ParseOptionItems(text));
  for (const auto& [key, value] : list) {
    if (key == "help") continue;
    if (key == "size") {
      ASSIGN_OR_RETURN(v->size, ParseSizeOption(key, value));
    } else if (key == "nocow") {
      ASSIGN_OR_RETURN(v->nocow_value, ParseBool(key, value));
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

// posix_file says "<file>: Could not create: <strerror>" when open(2)
// fails; qemu-img names the file once more.
absl::Status RewordCreateError(const std::string& filename,
                               const absl::Status& st) {
  const int error_number = StatusErrno(st);
  if (error_number == 0 ||
      st.message() != absl::StrCat(filename, ": Could not create: ",
                                   std::strerror(error_number))) {
    return st;
  }
  return absl::Status(st.code(),
                      absl::StrCat("Could not create '", filename,
                                   "': ", std::strerror(error_number)));
}

// Puts "<filename>: " before a message, as qemu-img does for every error of
// the creation itself, unless the message already starts with the name.
absl::Status Named(const std::string& filename, const absl::Status& st) {
  if (absl::StartsWith(st.message(), absl::StrCat(filename, ": "))) return st;
  absl::Status named(st.code(), absl::StrCat(filename, ": ", st.message()));
  st.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) {
    named.SetPayload(url, payload);
  });
  return named;
}

// --- qcow2 ---------------------------------------------------------------

enum class OptionType { kSize, kNumber, kBool, kString };

struct OptionDesc {
  const char* name;
  OptionType type;
  const char* help;
  const char* default_value;  // printed on the "Formatting" line, or null
};

// qemu-img 7.2's create options of qcow2 followed by those of the `file`
// protocol it does not have (nocow, extent_size_hint), in QEMU's list order:
// the order of the "Formatting" line.
constexpr OptionDesc kQcow2Options[] = {
    {"encryption", OptionType::kBool,
     "Encrypt the image with format 'aes'. (Deprecated in favor of "
     "encrypt.format=aes)",
     nullptr},
    {"encrypt.format", OptionType::kString,
     "Encrypt the image, format choices: 'aes', 'luks'", nullptr},
    {"encrypt.key-secret", OptionType::kString,
     "ID of secret providing qcow AES key or LUKS passphrase", nullptr},
    {"encrypt.cipher-alg", OptionType::kString,
     "Name of encryption cipher algorithm", nullptr},
    {"encrypt.cipher-mode", OptionType::kString,
     "Name of encryption cipher mode", nullptr},
    {"encrypt.ivgen-alg", OptionType::kString, "Name of IV generator algorithm",
     nullptr},
    {"encrypt.ivgen-hash-alg", OptionType::kString,
     "Name of IV generator hash algorithm", nullptr},
    {"encrypt.hash-alg", OptionType::kString,
     "Name of encryption hash algorithm", nullptr},
    {"encrypt.iter-time", OptionType::kNumber,
     "Time to spend in PBKDF in milliseconds", nullptr},
    {"cluster_size", OptionType::kSize, "qcow2 cluster size", "65536"},
    {"extended_l2", OptionType::kBool, "Extended L2 tables", "off"},
    {"preallocation", OptionType::kString,
     "Preallocation mode (allowed values: off, metadata, falloc, full)",
     nullptr},
    {"compression_type", OptionType::kString,
     "Compression method used for image cluster compression", "zlib"},
    {"size", OptionType::kSize, "Virtual disk size", nullptr},
    {"compat", OptionType::kString,
     "Compatibility level (v2 [0.10] or v3 [1.1])", nullptr},
    {"backing_file", OptionType::kString, "File name of a base image", nullptr},
    {"backing_fmt", OptionType::kString, "Image format of the base image",
     nullptr},
    {"data_file", OptionType::kString, "File name of an external data file",
     nullptr},
    {"data_file_raw", OptionType::kBool,
     "The external data file must stay valid as a raw image", nullptr},
    {"lazy_refcounts", OptionType::kBool, "Postpone refcount updates", "off"},
    {"refcount_bits", OptionType::kNumber,
     "Width of a reference count entry in bits", "16"},
    // The file protocol's own.
    {"nocow", OptionType::kBool,
     "Turn off copy-on-write (valid only on btrfs)", nullptr},
    {"extent_size_hint", OptionType::kSize,
     "Extent size hint for the image file, 0 to disable", nullptr},
};
constexpr size_t kNumQcow2Only = 21;  // the entries before nocow

const OptionDesc* FindQcow2Option(const std::string& name) {
  for (const OptionDesc& d : kQcow2Options) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

// `-o help` for qcow2: the options sorted by name; with a file name also
// the file protocol's.
std::string Qcow2Help(bool with_protocol) {
  std::vector<const OptionDesc*> list;
  const size_t n = with_protocol ? std::size(kQcow2Options) : kNumQcow2Only;
  for (size_t i = 0; i < n; ++i) list.push_back(&kQcow2Options[i]);
  std::sort(list.begin(), list.end(),
            [](const OptionDesc* a, const OptionDesc* b) {
              return std::strcmp(a->name, b->name) < 0;
            });
  std::string text;
  for (const OptionDesc* d : list) {
    const char* type = "";
    switch (d->type) {
      case OptionType::kSize: type = "<size>"; break;
      case OptionType::kNumber: type = "<num>"; break;
      case OptionType::kBool: type = "<bool (on/off)>"; break;
      case OptionType::kString: type = "<str>"; break;
    }
    char line[256];
    std::snprintf(line, sizeof(line), "  %-22s - %s\n",
                  absl::StrCat(d->name, "=", type).c_str(), d->help);
    text += line;
  }
  return text;
}

// One option value as given (the last one wins) and, for sizes and
// numbers, parsed.
struct OptionValue {
  std::string text;
  uint64_t number = 0;
  bool flag = false;
};
using Qcow2Values = std::map<std::string, OptionValue>;

// QEMU's number options: strtoull with base 0 ("-1" wraps), nothing after.
absl::StatusOr<uint64_t> ParseNumberOption(const std::string& name,
                                           const std::string& value) {
  errno = 0;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(value.c_str(), &end, 0);
  if (value.empty() || *end != '\0' || errno != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Parameter '", name, "' expects a number"));
  }
  return static_cast<uint64_t>(n);
}

absl::Status SetQcow2Option(const std::string& key, const std::string& value,
                            Qcow2Values* values) {
  const OptionDesc* d = FindQcow2Option(key);
  if (d == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("Invalid parameter '", key, "'"));
  }
  OptionValue v;
  v.text = value;
  switch (d->type) {
    case OptionType::kSize: {
      ASSIGN_OR_RETURN(v.number, ParseSizeOption(key, value));
      break;
    }
    case OptionType::kNumber: {
      ASSIGN_OR_RETURN(v.number, ParseNumberOption(key, value));
      break;
    }
    case OptionType::kBool: {
      ASSIGN_OR_RETURN(v.flag, ParseBool(key, value));
      break;
    }
    case OptionType::kString:
      break;
  }
  (*values)[key] = v;
  return absl::OkStatus();
}

absl::Status ApplyQcow2Options(const std::string& text, Qcow2Values* values) {
  ASSIGN_OR_RETURN(OptionList list, ParseOptionItems(text));
  for (const auto& [key, value] : list) {
    if (key == "help") continue;
    RETURN_IF_ERROR(SetQcow2Option(key, value, values));
  }
  return absl::OkStatus();
}

// qemu_opts_print: each option in list order that is set or has a default;
// sizes and numbers as signed 64-bit numbers, strings with commas doubled.
std::string FormattingLine(const std::string& filename,
                           const Qcow2Values& values) {
  std::string line = absl::StrCat("Formatting '", filename, "', fmt=qcow2");
  for (const OptionDesc& d : kQcow2Options) {
    auto it = values.find(d.name);
    if (it == values.end()) {
      if (d.default_value != nullptr) {
        absl::StrAppend(&line, " ", d.name, "=", d.default_value);
      }
      continue;
    }
    switch (d.type) {
      case OptionType::kSize:
      case OptionType::kNumber:
        absl::StrAppend(&line, " ", d.name, "=",
                        static_cast<int64_t>(it->second.number));
        break;
      case OptionType::kBool:
        absl::StrAppend(&line, " ", d.name, "=", it->second.text);
        break;
      case OptionType::kString:
        absl::StrAppend(&line, " ", d.name, "=",
                        absl::StrReplaceAll(it->second.text, {{",", ",,"}}));
        break;
    }
  }
  return line;
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

// Writes the qcow2 image onto the empty file `filename`.
absl::Status WriteQcow2(const std::string& filename,
                        const qcow2::Qcow2CreateOptions& options,
                        std::ostream& err) {
  ASSIGN_OR_RETURN(std::unique_ptr<io::Engine> engine,
                   io::CreateEngine(io::EngineKind::kAuto, 16, &err));
  posix_file::FileOpenOptions open;
  open.set_filename(filename);
  open.set_read_only(false);
  std::ostringstream warnings;
  absl::StatusOr<std::unique_ptr<posix_file::FileNode>> file =
      posix_file::FileNode::Open(*engine, open, &warnings);
  PrintWarnings(warnings.str(), err);
  if (!file.ok()) return file.status();
  absl::Status st = io::RunSync(*engine, qcow2::CreateQcow2(**file, options));
  absl::Status closed = io::RunSync(*engine, (*file)->Close());
  RETURN_IF_ERROR(st);
  return closed;
}

absl::Status CreateQcow2Image(const std::string& filename,
                              const std::vector<std::string>& option_texts,
                              std::optional<uint64_t> size,
                              const std::optional<std::string>& backing_file,
                              const std::optional<std::string>& backing_format,
                              bool open_backing, bool quiet, Streams streams) {
  Qcow2Values values;
  for (const std::string& text : option_texts) {
    if (absl::Status st = ApplyQcow2Options(text, &values); !st.ok()) {
      return Named(filename, st);
    }
  }
  if (values.count("size") != 0 && size.has_value()) {
    return Named(filename, absl::InvalidArgumentError(
                               "The image size must be specified only once"));
  }
  if (size.has_value()) {
    values["size"] = OptionValue{absl::StrCat(*size), *size, false};
  }
  if (backing_file.has_value()) {
    values["backing_file"] = OptionValue{*backing_file, 0, false};
  }
  if (backing_format.has_value()) {
    values["backing_fmt"] = OptionValue{*backing_format, 0, false};
  }

  auto text_of = [&values](const char* key) -> std::optional<std::string> {
    auto it = values.find(key);
    if (it == values.end()) return std::nullopt;
    return it->second.text;
  };
  const std::optional<std::string> backing = text_of("backing_file");
  const std::optional<std::string> backing_fmt = text_of("backing_fmt");
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
      return Named(filename,
                   absl::InvalidArgumentError(absl::StrCat(
                       "Backing file specified without backing format\n"
                       "Detected format of ",
                       info->format, ".")));
    }
    if (values.count("size") == 0) {
      values["size"] = OptionValue{absl::StrCat(info->size), info->size, false};
    }
  } else if (backing.has_value() && !backing_fmt.has_value()) {
    return Named(filename,
                 absl::InvalidArgumentError(
                     "Backing file specified without backing format"));
  }
  if (values.count("size") == 0) {
    return Named(filename, absl::InvalidArgumentError(
                               "Image creation needs a size parameter"));
  }

  if (!quiet) {
    streams.out << FormattingLine(filename, values) << "\n";
    streams.out.flush();
  }

  // The file protocol's options, checked before the file is touched.
  posix_file::FileCreateOptions file_options;
  file_options.set_size(0);
  if (auto it = values.find("extent_size_hint"); it != values.end()) {
    if (it->second.number > UINT32_MAX) {
      return Named(filename, absl::InvalidArgumentError(
                                 "Extent size hint is too large"));
    }
    file_options.set_extent_size_hint(it->second.number);
  }
  if (auto it = values.find("nocow"); it != values.end()) {
    file_options.set_nocow(it->second.flag);
  }

  // What imgtool's qcow2 driver cannot create.
  for (const char* key :
       {"encryption", "encrypt.format", "encrypt.key-secret",
        "encrypt.cipher-alg", "encrypt.cipher-mode", "encrypt.ivgen-alg",
        "encrypt.ivgen-hash-alg", "encrypt.hash-alg", "encrypt.iter-time",
        "data_file", "data_file_raw"}) {
    if (values.count(key) != 0) {
      return Named(filename,
                   absl::UnimplementedError(absl::StrCat(
                       "The qcow2 option '", key, "' is not supported yet")));
    }
  }

  qcow2::Qcow2CreateOptions options;
  options.set_size(values["size"].number);
  if (auto it = values.find("cluster_size"); it != values.end()) {
    options.set_cluster_size(it->second.number);
  }
  options.set_compat(text_of("compat").value_or(""));
  options.set_preallocation(text_of("preallocation").value_or(""));
  options.set_backing_file(backing.value_or(""));
  options.set_backing_fmt(backing_fmt.value_or(""));
  options.set_lazy_refcounts(values["lazy_refcounts"].flag);
  options.set_extended_l2(values["extended_l2"].flag);
  std::optional<std::string> compression = text_of("compression_type");
  std::optional<absl::Status> late_error;
  if (compression.has_value() && *compression != "zlib") {
    late_error =
        *compression == "zstd"
            ? absl::UnimplementedError(
                  "compression_type=zstd is not supported yet")
            : absl::InvalidArgumentError(absl::StrCat(
                  "Parameter 'compression-type' does not accept value '",
                  *compression, "'"));
  }
  if (auto it = values.find("refcount_bits"); it != values.end()) {
    if (it->second.number > 64) {
      late_error = absl::InvalidArgumentError(
          "Refcount width must be a power of two and may not exceed 64 bits");
    } else {
      options.set_refcount_bits(static_cast<uint32_t>(it->second.number));
    }
  }

  // As qemu-img: the file is created (emptied) first, then the image is
  // checked and written; on any failure the file is deleted, so nothing
  // that looks like an image is left behind.
  std::ostringstream warnings;
  absl::Status st = posix_file::CreateFile(filename, file_options, &warnings);
  PrintWarnings(warnings.str(), streams.err);
  if (!st.ok()) return Named(filename, RewordCreateError(filename, st));
  if (!late_error.has_value()) {
    absl::StatusOr<qcow2::CheckedCreateOptions> checked =
        qcow2::CheckCreateOptions(options);
    if (!checked.ok()) late_error = checked.status();
  }
  if (!late_error.has_value()) {
    absl::Status written = WriteQcow2(filename, options, streams.err);
    if (!written.ok()) late_error = written;
  }
  if (late_error.has_value()) {
    unlink(filename.c_str());
    return Named(filename, *late_error);
  }
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
              case kObject:
                return absl::UnimplementedError(
                    "--object is not supported yet");
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
        streams.out << "Supported options:\n" << Qcow2Help(true);
      } else {
        streams.out << "Supported qcow2 options:\n"
                    << Qcow2Help(false) << kProtocolHint;
      }
    } else if (!operands.empty()) {
      streams.out << "Supported options:\n" << kFileOptionsHelp;
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
  std::ostringstream warnings;
  absl::Status st = posix_file::CreateFile(filename, options, &warnings);
  PrintWarnings(warnings.str(), streams.err);
  if (!st.ok()) return Named(filename, RewordCreateError(filename, st));
  return absl::OkStatus();
}

}  // namespace imgtool::cli
