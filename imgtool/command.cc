#include "imgtool/command.h"

#include <getopt.h>

#include <stdlib.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/options.h"
#include "base/size.h"
#include "base/status_macros.h"
#include "block/objects.h"

namespace imgtool::cli {
namespace {

constexpr char kExitCodePayload[] = "imgtool/exit_code";
constexpr char kPrefixEachLinePayload[] = "imgtool/prefix_each_line";
constexpr char kUsagePayload[] = "imgtool/usage";
constexpr char kCorruptionEventPayload[] = "imgtool/corruption_event";
constexpr char kOutputPayload[] = "imgtool/output";

std::string& MutableProgramName() {
  static std::string* name = new std::string("imgtool");
  return *name;
}

std::string Prefix() { return absl::StrCat(ProgramName(), ": "); }

// Where a qcow2 corruption event (Qcow2Node::SignalCorruption) starts in a
// kDataLoss status's message; it runs to the end. npos if there is none.
size_t CorruptionEventStart(const absl::Status& status) {
  if (!absl::IsDataLoss(status)) return absl::string_view::npos;
  const absl::string_view message = status.message();
  for (absl::string_view start :
       {"qcow2: Image is corrupt: ", "qcow2: Marking image as corrupt: "}) {
    const size_t pos = message.find(start);
    if (pos != absl::string_view::npos) return pos;
  }
  return absl::string_view::npos;
}

}  // namespace

void SetProgramName(absl::string_view name) {
  MutableProgramName() = std::string(name);
}

const std::string& ProgramName() { return MutableProgramName(); }

std::string VersionText() {
  const std::string& name = ProgramName();
  if (name == "imgtool") return absl::StrCat("imgtool version ", kImgtoolVersion, "\n");
  return absl::StrCat(name, " version ", kQemuVersion, " (imgtool ",
                      kImgtoolVersion, ")\nimgtool ", kImgtoolVersion,
                      " works like QEMU ", kQemuVersion, "'s ", name,
                      "; it is not QEMU.\n");
}

absl::Status WithExitCode(absl::Status status, int exit_code) {
  status.SetPayload(kExitCodePayload, absl::Cord(absl::StrCat(exit_code)));
  return status;
}

int ExitCodeOf(const absl::Status& status) {
  if (status.ok()) return 0;
  int code = 1;
  if (auto payload = status.GetPayload(kExitCodePayload);
      payload.has_value() && absl::SimpleAtoi(std::string(*payload), &code)) {
    return code;
  }
  return 1;
}

absl::Status PrefixEachLine(absl::Status status) {
  status.SetPayload(kPrefixEachLinePayload, absl::Cord("1"));
  return status;
}

absl::Status UsageError(absl::string_view message, absl::string_view usage) {
  absl::Status status = absl::InvalidArgumentError(message);
  status.SetPayload(kUsagePayload, absl::Cord(usage));
  return status;
}

absl::Status WithCorruptionEvent(absl::Status status,
                                 const absl::Status& cause) {
  const size_t pos = CorruptionEventStart(cause);
  if (pos == absl::string_view::npos) return status;
  status.SetPayload(kCorruptionEventPayload,
                    absl::Cord(cause.message().substr(pos)));
  return status;
}

std::string FormatError(const absl::Status& status) {
  const bool each_line = status.GetPayload(kPrefixEachLinePayload).has_value();
  std::string text;
  absl::string_view message = status.message();
  std::string replaced;
  if (auto event = status.GetPayload(kCorruptionEventPayload);
      event.has_value()) {
    absl::StrAppend(&text, std::string(*event), "\n");
  } else if (const size_t pos = CorruptionEventStart(status);
             pos != absl::string_view::npos) {
    absl::StrAppend(&text, message.substr(pos), "\n");
    replaced = absl::StrCat(message.substr(0, pos), std::strerror(EIO));
    message = replaced;
  }
  bool first = true;
  for (absl::string_view line : absl::StrSplit(message, '\n')) {
    if (first || each_line) text += Prefix();
    absl::StrAppend(&text, line, "\n");
    first = false;
  }
  if (auto usage = status.GetPayload(kUsagePayload); usage.has_value()) {
    // Under a drop-in name (qemu-img, qemu-io), exactly that tool's text.
    if (!usage->empty() && ProgramName() == "imgtool") {
      absl::StrAppend(&text, std::string(*usage), "\n");
    }
    absl::StrAppend(&text, "Try '", ProgramName(),
                    " --help' for more information\n");
  }
  return text;
}

absl::Status StopWithOutput(std::string text) {
  absl::Status status = WithExitCode(absl::CancelledError(), 0);
  status.SetPayload(kOutputPayload, absl::Cord(std::move(text)));
  return status;
}

std::optional<std::string> OutputOf(const absl::Status& status) {
  if (auto payload = status.GetPayload(kOutputPayload); payload.has_value()) {
    return std::string(*payload);
  }
  return std::nullopt;
}

void PrintWarnings(absl::string_view warnings, std::ostream& err) {
  for (absl::string_view line : absl::StrSplit(warnings, '\n')) {
    if (!line.empty()) err << Prefix() << "warning: " << line << "\n";
  }
}

std::optional<std::string> CacheMode(const std::string& name) {
  if (name == "off") return std::string("none");
  if (name == "none" || name == "writeback" || name == "writethrough" ||
      name == "directsync" || name == "unsafe") {
    return name;
  }
  return std::nullopt;
}

bool IsValidOptionList(const std::string& text) {
  if (text.empty() || text[0] == ',') return false;
  size_t trailing = 0;
  while (trailing < text.size() && text[text.size() - 1 - trailing] == ',') {
    ++trailing;
  }
  return trailing % 2 == 0;
}

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

absl::StatusOr<OptionValue> ParseTypedOption(const std::string& key,
                                             const std::string& value,
                                             OptionType type) {
  OptionValue v;
  v.text = value;
  switch (type) {
    case OptionType::kSize: {
      ASSIGN_OR_RETURN(v.number, ParseSizeOption(key, value));
      break;
    }
    case OptionType::kNumber: {
      ASSIGN_OR_RETURN(v.number, ParseNumberOption(key, value));
      break;
    }
    case OptionType::kBool: {
      ASSIGN_OR_RETURN(v.flag, ParseBoolOption(key, value));
      break;
    }
    case OptionType::kString:
      break;
  }
  return v;
}

std::string OptionHelpLine(const char* name, OptionType type,
                           const char* help) {
  const char* type_name = "<str>";
  switch (type) {
    case OptionType::kSize: type_name = "<size>"; break;
    case OptionType::kNumber: type_name = "<num>"; break;
    case OptionType::kBool: type_name = "<bool (on/off)>"; break;
    case OptionType::kString: type_name = "<str>"; break;
  }
  char line[256];
  std::snprintf(line, sizeof(line), "  %-22s - %s\n",
                absl::StrCat(name, "=", type_name).c_str(), help);
  return line;
}

bool HasProtocol(const std::string& name) {
  const size_t colon = name.find(':');
  if (colon == std::string::npos) return false;
  const size_t slash = name.find('/');
  return slash == std::string::npos || colon < slash;
}

std::optional<std::string> RealPath(const std::string& path) {
  char* resolved = realpath(path.c_str(), nullptr);
  if (resolved == nullptr) return std::nullopt;
  std::string out(resolved);
  free(resolved);
  return out;
}

absl::StatusOr<std::vector<std::string>> ParseOptions(
    const std::vector<std::string>& args, const char* short_options,
    const struct option* long_options, absl::string_view usage,
    const std::function<absl::Status(int option, const std::string& arg)>&
        on_option) {
  // getopt wants a mutable argv whose element 0 is the program name.
  std::vector<std::string> words;
  words.reserve(args.size() + 1);
  words.push_back(ProgramName());
  words.insert(words.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  const int argc = static_cast<int>(words.size());
  const std::string optstring = absl::StrCat(":", short_options);

  optind = 0;  // glibc: full re-initialisation, so Run can be called again.
  opterr = 0;
  for (;;) {
    int long_index = -1;
    int c = getopt_long(argc, argv.data(), optstring.c_str(), long_options,
                        &long_index);
    if (c == -1) break;
    if (c == '?') {
      return UsageError(
          absl::StrCat("unrecognized option '", argv[optind - 1], "'"), usage);
    }
    if (c == ':') {
      return UsageError(
          absl::StrCat("missing argument for option '", argv[optind - 1], "'"),
          usage);
    }
    if (long_index >= 0 &&
        std::strcmp(long_options[long_index].name, "object") == 0) {
      absl::StatusOr<std::optional<std::string>> added =
          block::ObjectRegistry::Default().AddFromCommandLine(
              optarg != nullptr ? optarg : "");
      if (!added.ok()) return added.status();
      if (added->has_value()) return StopWithOutput(**std::move(added));
      continue;
    }
    absl::Status st = on_option(c, optarg != nullptr ? optarg : "");
    if (!st.ok()) return st;
  }
  std::vector<std::string> operands;
  for (int i = optind; i < argc; ++i) operands.push_back(argv[i]);
  optind = 0;
  return operands;
}

absl::StatusOr<bool> ParseOutputFormat(const std::string& value) {
  if (value == "json") return true;
  if (value == "human") return false;
  return absl::InvalidArgumentError(
      "--output must be used with human or json as argument.");
}

}  // namespace imgtool::cli
