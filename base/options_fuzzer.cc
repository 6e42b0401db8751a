// Fuzz target: option strings as imgtool reads them from the command line.
// The first input byte picks the parser, the rest is the text:
//   0: ParseOptionString (--image-opts, implied key "file") + BuildNodeOptions
//   1: ParseOptionString (-o, no implied key) + BuildNodeOptions
//   2: ParseJsonFilename (json:{...})
//   3: ParseSize           4: ParseSizeOption   5: ParseBoolOption
//   6: FormatHumanSize of the first 8 bytes (little-endian)
// No crash, no hang, no read past the text (ASan). Invariants (abort): an
// option list that parses rebuilds from its own re-serialisation ("k=v"
// joined by ',' with ',' doubled) to the same list; a size that parses is
// at most INT64_MAX; FormatHumanSize is never empty.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/string_view.h"
#include "base/options.h"
#include "base/size.h"

namespace imgtool {
namespace {

void Require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "options_fuzzer: %s\n", what);
    std::abort();
  }
}

void FuzzOptionString(absl::string_view text, absl::string_view implied) {
  absl::StatusOr<OptionList> list = ParseOptionString(text, implied);
  if (!list.ok()) return;
  (void)BuildNodeOptions(*list);
  std::string again;
  for (const auto& [key, value] : *list) {
    if (key == "help") return;  // "help" / "?" items do not round-trip
    if (!again.empty()) again += ',';
    again += absl::StrReplaceAll(key, {{",", ",,"}});
    again += '=';
    again += absl::StrReplaceAll(value, {{",", ",,"}});
  }
  absl::StatusOr<OptionList> reparsed = ParseOptionString(again);
  Require(reparsed.ok() && *reparsed == *list,
          "an option list does not survive its re-serialisation");
}

}  // namespace
}  // namespace imgtool

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace imgtool;
  if (size == 0 || size > 64 << 10) return 0;
  const absl::string_view text(reinterpret_cast<const char*>(data) + 1,
                               size - 1);
  switch (data[0] % 7) {
    case 0:
      FuzzOptionString(text, "file");
      break;
    case 1:
      FuzzOptionString(text, "");
      break;
    case 2:
      (void)ParseJsonFilename(text);
      break;
    case 3: {
      absl::StatusOr<uint64_t> bytes = ParseSize(text);
      Require(!bytes.ok() || *bytes <= INT64_MAX, "ParseSize above INT64_MAX");
      break;
    }
    case 4:
      (void)ParseSizeOption("size", text);
      break;
    case 5:
      (void)ParseBoolOption("flag", text);
      break;
    case 6: {
      uint64_t value = 0;
      std::memcpy(&value, text.data(), std::min<size_t>(text.size(), 8));
      Require(!FormatHumanSize(value).empty(), "empty human size");
      break;
    }
  }
  return 0;
}
