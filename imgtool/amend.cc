// imgtool amend [-f FMT] [-t CACHE] [-p] [-q] [--force] -o OPTIONS FILE:
// changes options of an existing qcow2 image as qemu-img 7.2's amend does
// (qcow2::Qcow2Node::Amend): compat=0.10|1.1, lazy_refcounts, size,
// refcount_bits; backing_file/backing_fmt only as they are; options only
// create takes are refused with qemu-img's hint.
#include <getopt.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/numeric/bits.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "base/errno_status.h"
#include "base/options.h"
#include "base/size.h"
#include "base/status_macros.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "imgtool/progress.h"
#include "imgtool/qcow2_create.h"
#include "io/engine.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::cli {
namespace {

constexpr char kUsage[] =
    "Usage: imgtool amend [-f FMT] [-t CACHE] [-p] [-q] [--force] -o OPTIONS "
    "FILE";

constexpr char kHelp[] =
    "Usage: imgtool amend [-f FMT] [-t CACHE] [-p] [-q] [--force] -o OPTIONS "
    "FILE\n"
    "Changes options of an existing qcow2 image.\n"
    "  -o OPTIONS            compat=0.10|1.1, lazy_refcounts=on|off, "
    "size=SIZE,\n"
    "                        refcount_bits=1|2|4|8|16|32|64;\n"
    "                        backing_file/backing_fmt only as they are (use "
    "rebase);\n"
    "                        '-o help' lists the amendable options\n"
    "  -f FMT                image format (qcow2); probed if absent\n"
    "  --image-opts          FILE is an option string such as\n"
    "                        driver=qcow2,file.filename=x\n"
    "  -t CACHE              cache mode (none, writeback, writethrough, "
    "directsync,\n"
    "                        unsafe; default writeback)\n"
    "  -p                    show progress\n"
    "  -q                    quiet (no progress)\n"
    "  --force               accepted for qemu-img's encryption amendments\n";

enum LongOption { kImageOpts = 256, kObject, kForce };

const struct option kLongOptions[] = {
    {"help", no_argument, nullptr, 'h'},
    {"image-opts", no_argument, nullptr, kImageOpts},
    {"object", required_argument, nullptr, kObject},
    {"force", no_argument, nullptr, kForce},
    {nullptr, 0, nullptr, 0},
};

constexpr std::array<const char*, 5> kCacheModes = {
    "none", "writeback", "writethrough", "directsync", "unsafe"};

struct AmendOption {
  const char* name;
  OptionType type;
  const char* help;
};

// QEMU 7.2's qcow2 amend options (qcow2_amend_opts), in its list order.
constexpr AmendOption kAmendOptions[] = {
    {"encrypt.state", OptionType::kString,
     "Select new state of affected keyslots (active/inactive)"},
    {"encrypt.keyslot", OptionType::kNumber,
     "Select a single keyslot to modify explicitly"},
    {"encrypt.old-secret", OptionType::kString,
     "Select all keyslots that match this password"},
    {"encrypt.new-secret", OptionType::kString,
     "New secret to set in the matching keyslots. Empty string to erase"},
    {"encrypt.iter-time", OptionType::kNumber,
     "Time to spend in PBKDF in milliseconds"},
    {"size", OptionType::kSize, "Virtual disk size"},
    {"compat", OptionType::kString,
     "Compatibility level (v2 [0.10] or v3 [1.1])"},
    {"backing_file", OptionType::kString, "File name of a base image"},
    {"backing_fmt", OptionType::kString, "Image format of the base image"},
    {"data_file", OptionType::kString, "File name of an external data file"},
    {"data_file_raw", OptionType::kBool,
     "The external data file must stay valid as a raw image"},
    {"lazy_refcounts", OptionType::kBool, "Postpone refcount updates"},
    {"refcount_bits", OptionType::kNumber,
     "Width of a reference count entry in bits"},
};

const AmendOption* FindAmendOption(const std::string& name) {
  for (const AmendOption& o : kAmendOptions) {
    if (name == o.name) return &o;
  }
  return nullptr;
}

// "Amend options for 'qcow2':" and the options sorted by name.
std::string AmendHelp() {
  std::vector<const AmendOption*> list;
  for (const AmendOption& o : kAmendOptions) list.push_back(&o);
  std::sort(list.begin(), list.end(),
            [](const AmendOption* a, const AmendOption* b) {
              return std::string(a->name) < b->name;
            });
  std::string text = "Amend options for 'qcow2':\n";
  for (const AmendOption* o : list) {
    text += OptionHelpLine(o->name, o->type, o->help);
  }
  return text;
}

bool HasHelpOption(const std::string& text) {
  absl::StatusOr<OptionList> list = ParseOptionItems(text);
  if (!list.ok()) return false;
  for (const auto& item : *list) {
    if (item.first == "help") return true;
  }
  return false;
}

using AmendValues = std::vector<std::pair<const AmendOption*, OptionValue>>;

// Parses the -o text against the amend options (qemu-img's
// qemu_opts_do_parse): unknown keys and values of the wrong type. An
// option only create knows gets qemu-img's hint.
absl::StatusOr<AmendValues> ParseAmendOptions(const std::string& text) {
  ASSIGN_OR_RETURN(OptionList list, ParseOptionItems(text));
  AmendValues values;
  for (const auto& [key, value] : list) {
    const AmendOption* o = FindAmendOption(key);
    if (o == nullptr) {
      std::string message = absl::StrCat("Invalid parameter '", key, "'");
      // qemu-img tries the format's create options (not the protocol's).
      Qcow2CreateValues create;
      const bool protocol_option =
          std::any_of(list.begin(), list.end(), [](const auto& item) {
            return item.first == "nocow" || item.first == "extent_size_hint";
          });
      if (!protocol_option && create.Apply(text).ok()) {
        absl::StrAppend(&message,
                        "\nThis option is only supported for image creation");
      }
      return absl::InvalidArgumentError(message);
    }
    ASSIGN_OR_RETURN(OptionValue v, ParseTypedOption(key, value, o->type));
    // The last value of a key wins.
    auto it = std::find_if(values.begin(), values.end(),
                           [o](const auto& p) { return p.first == o; });
    if (it != values.end()) {
      it->second = v;
    } else {
      values.emplace_back(o, v);
    }
  }
  return values;
}

// qcow2_amend_options' checks of the parsed values, in its list order,
// into `out`.
absl::Status WalkAmendOptions(const AmendValues& values,
                              qcow2::Qcow2Node::AmendOptions* out) {
  for (const AmendOption& o : kAmendOptions) {
    auto it = std::find_if(values.begin(), values.end(),
                           [&o](const auto& p) { return p.first == &o; });
    if (it == values.end()) continue;
    const OptionValue& v = it->second;
    const std::string name = o.name;
    if (name == "compat") {
      if (v.text == "0.10" || v.text == "v2") {
        out->version = 2;
      } else if (v.text == "1.1" || v.text == "v3") {
        out->version = 3;
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("Unknown compatibility level ", v.text));
      }
    } else if (name == "size") {
      out->size = v.number;
    } else if (name == "backing_file") {
      out->backing_file = v.text;
    } else if (name == "backing_fmt") {
      out->backing_format = v.text;
    } else if (name.rfind("encrypt.", 0) == 0) {
      return absl::InvalidArgumentError(
          "Can't amend encryption options - encryption not present");
    } else if (name == "lazy_refcounts") {
      out->lazy_refcounts = v.flag;
    } else if (name == "refcount_bits") {
      if (v.number == 0 || v.number > 64 || !absl::has_single_bit(v.number)) {
        return absl::InvalidArgumentError(
            "Refcount width must be a power of two and may not exceed 64 "
            "bits");
      }
      out->refcount_bits = static_cast<uint32_t>(v.number);
    } else if (name == "data_file") {
      return absl::InvalidArgumentError(
          "data-file can only be set for images that use an external data "
          "file");
    } else if (name == "data_file_raw") {
      if (v.flag) {
        return absl::InvalidArgumentError(
            "data-file-raw cannot be set on existing images");
      }
    }
  }
  return absl::OkStatus();
}

// "Format driver 'raw' does not support option amendment" for every
// format but qcow2.
absl::Status NoAmendment(const std::string& format) {
  return absl::InvalidArgumentError(absl::StrCat(
      "Format driver '", format, "' does not support option amendment"));
}

}  // namespace

absl::Status RunAmend(const std::vector<std::string>& args, Streams streams) {
  ImageSpec spec;
  spec.read_only = false;
  spec.queue_depth = 16;
  bool help = false;
  bool progress_on = false;
  bool quiet = false;
  std::optional<std::string> options;
  ASSIGN_OR_RETURN(
      std::vector<std::string> operands,
      ParseOptions(args, "ho:f:t:pq", kLongOptions, kUsage,
                   [&](int c, const std::string& arg) -> absl::Status {
                     switch (c) {
                       case 'h': help = true; break;
                       case 'o':
                         if (!IsValidOptionList(arg)) {
                           return absl::InvalidArgumentError(
                               absl::StrCat("Invalid option list: ", arg));
                         }
                         options = options.has_value()
                                       ? absl::StrCat(*options, ",", arg)
                                       : arg;
                         break;
                       case 'f': spec.format = arg; break;
                       case 't': spec.cache = arg; break;
                       case 'p': progress_on = true; break;
                       case 'q': quiet = true; break;
                       case kObject:
                         return absl::UnimplementedError(
                             "--object is not supported yet");
                       case kImageOpts: spec.image_opts = true; break;
                       case kForce: break;
                     }
                     return absl::OkStatus();
                   }));
  if (help) {
    streams.out << kHelp;
    return absl::OkStatus();
  }
  if (!options.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Must specify options (-o)\nTry '", ProgramName(),
                     " --help' for more information"));
  }
  if (quiet) progress_on = false;
  // qemu-img ends the progress line on every way out once it started.
  Progress progress(progress_on, 1.0, streams.out);
  auto done = [&](absl::Status st) {
    progress.End();
    return st;
  };

  if (!spec.format.empty() && HasHelpOption(*options)) {
    if (spec.format != "qcow2") {
      absl::Status known = CheckFormat(spec.format, /*for_create=*/true);
      if (!known.ok() && absl::IsInvalidArgument(known)) return done(known);
      return done(NoAmendment(spec.format));
    }
    streams.out << AmendHelp();
    return done(absl::OkStatus());
  }
  if (operands.size() != 1) {
    return done(absl::InvalidArgumentError("Expecting one image file name"));
  }
  if (std::find(kCacheModes.begin(), kCacheModes.end(), spec.cache) ==
      kCacheModes.end()) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("Invalid cache option: ", spec.cache)));
  }
  spec.filename = operands[0];
  absl::StatusOr<OpenedImage> opened = OpenImage(spec, streams.err);
  if (!opened.ok()) return done(opened.status());
  OpenedImage& image = *opened;
  auto fail = [&](absl::Status st) {
    CloseImage(image).IgnoreError();
    return done(st);
  };
  if (HasHelpOption(*options)) {
    if (image.qcow2 == nullptr) return fail(NoAmendment(image.format));
    streams.out << AmendHelp();
    absl::Status closed = CloseImage(image);
    return done(closed);
  }
  if (image.qcow2 == nullptr || image.qcow2 != image.node.get()) {
    return fail(NoAmendment(image.format));
  }
  absl::StatusOr<AmendValues> values = ParseAmendOptions(*options);
  if (!values.ok()) return fail(values.status());
  qcow2::Qcow2Node::AmendOptions amend;
  amend.progress = [&progress](int64_t done_units, int64_t total) {
    if (total > 0) {
      progress.Print(100.f * static_cast<float>(done_units) /
                         static_cast<float>(total),
                     0);
    }
  };
  progress.Print(0.f, 0);
  absl::Status st = WalkAmendOptions(*values, &amend);
  if (st.ok()) st = io::RunSync(*image.engine, image.qcow2->Amend(amend));
  progress.Print(100.f, 0);
  for (const auto& d : image.qcow2->TakeDiagnostics()) {
    if (d.with_program) streams.err << ProgramName() << ": ";
    streams.err << d.text << "\n";
  }
  absl::Status closed = CloseImage(image);
  if (!st.ok()) {
    // The library's hint names the tool as imgtool.
    return done(WithMessage(
        st, absl::StrReplaceAll(st.message(),
                                {{"'imgtool rebase'",
                                  absl::StrCat("'", ProgramName(),
                                               " rebase'")}})));
  }
  return done(closed);
}

}  // namespace imgtool::cli
