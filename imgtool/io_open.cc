// imgtool io: open, close, reopen and -s (snapshot mode).
#include <getopt.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/types/span.h"
#include "base/errno_status.h"
#include "base/options.h"
#include "base/status_macros.h"
#include "block/registry.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "imgtool/io_output.h"
#include "imgtool/io_session.h"
#include "imgtool/qcow2_create.h"
#include "imgtool/temp_overlay.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::cli::qemu_io {

namespace {

// Sets the dotted `key` ("file.align") of `tree` to `value`, replacing a
// child or value of the same name.
void SetOption(NodeOptions& tree, absl::string_view key,
               const std::string& value) {
  std::vector<std::string> parts = absl::StrSplit(key, '.');
  NodeOptions* node = &tree;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    node->values.erase(parts[i]);
    node = &node->children[parts[i]];
  }
  node->children.erase(parts.back());
  node->values[parts.back()] = value;
}

// The option string ("driver=qcow2,file.filename=x") that rebuilds `tree`;
// commas in values are doubled.
void FlattenOptions(const NodeOptions& tree, const std::string& prefix,
                    std::string* out) {
  for (const auto& [key, value] : tree.values) {
    if (!out->empty()) *out += ',';
    absl::StrAppend(out, prefix, key, "=",
                    absl::StrReplaceAll(value, {{",", ",,"}}));
  }
  for (const auto& [key, child] : tree.children) {
    FlattenOptions(child, absl::StrCat(prefix, key, "."), out);
  }
}

std::string FlattenOptions(const NodeOptions& tree) {
  std::string out;
  FlattenOptions(tree, "", &out);
  return out;
}

// The options of `open -o OPTIONS [PATH]`: without a driver in OPTIONS,
// PATH opened as the command line opens it (probed), with OPTIONS laid over
// it; with one, PATH placed into OPTIONS as QEMU does (block::PlaceFilename:
// a protocol's filename, else down the `file` children).
absl::StatusOr<NodeOptions> OpenCommandOptions(const std::string& path,
                                               const std::string& options) {
  ASSIGN_OR_RETURN(OptionList list, ParseOptionString(options));
  // A key both a value and a group ("overlap-check=all,overlap-check.
  // inactive-l2=on", which QEMU's flat qcow2 options take) fails as in
  // --image-opts rather than the later one replacing the other.
  RETURN_IF_ERROR(BuildNodeOptions(list).status());
  NodeOptions tree;
  const bool has_driver =
      std::any_of(list.begin(), list.end(),
                  [](const auto& item) { return item.first == "driver"; });
  const bool json = absl::StartsWith(path, "json:");
  if (!path.empty() && (!has_driver || json)) {
    ASSIGN_OR_RETURN(tree, block::ImageOptions(path, "", false));
  }
  for (const auto& [key, value] : list) SetOption(tree, key, value);
  if (!path.empty() && has_driver && !json) {
    RETURN_IF_ERROR(block::PlaceFilename(path, &tree));
  }
  return tree;
}

// The driver QEMU would name for the node at `path` (dotted child names,
// "" for the top) of the image: from the options where they name one, else
// what the graph has (a `file` child is the file protocol; a backing file
// qcow2 or raw).
std::string DriverAt(const NodeOptions& tree, absl::string_view path,
                     const OpenedImage& image) {
  const NodeOptions* node = &tree;
  std::string last;
  for (absl::string_view part : absl::StrSplit(path, '.', absl::SkipEmpty())) {
    auto it = node->children.find(std::string(part));
    last = std::string(part);
    if (it == node->children.end()) {
      node = nullptr;
      break;
    }
    node = &it->second;
  }
  if (node != nullptr) {
    auto it = node->values.find("driver");
    if (it != node->values.end()) return it->second;
  }
  if (path.empty()) return image.format;
  if (last == "backing" && image.node->backing() != nullptr) {
    return dynamic_cast<const qcow2::Qcow2Node*>(image.node->backing()) !=
                   nullptr
               ? "qcow2"
               : "raw";
  }
  return "file";
}

// The value of dotted `key` in `tree`, if set.
std::optional<std::string> OptionAt(const NodeOptions& tree,
                                    absl::string_view key) {
  std::vector<std::string> parts = absl::StrSplit(key, '.');
  const NodeOptions* node = &tree;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    auto it = node->children.find(parts[i]);
    if (it == node->children.end()) return std::nullopt;
    node = &it->second;
  }
  auto it = node->values.find(parts.back());
  if (it == node->values.end()) return std::nullopt;
  return it->second;
}

}  // namespace

bool Session::ParseCacheOption(const char* arg, std::string* mode) {
  std::optional<std::string> m = CacheMode(arg);
  if (!m.has_value()) {
    Error(absl::StrCat("Invalid cache option: ", arg));
    return false;
  }
  *mode = *std::move(m);
  return true;
}

bool Session::AppendOptions(const char* arg, std::string* options) {
  if (absl::Status st = ParseOptionString(arg).status(); !st.ok()) {
    Error(st.message());
    return false;
  }
  absl::StrAppend(options, options->empty() ? "" : ",", arg);
  return true;
}

absl::Status Session::Open(const OpenRequest& request) {
  const ImageSpec& spec = request.spec;
  const auto cant_open = [&](absl::StatusCode code, absl::string_view cause) {
    return absl::Status(code, request.name.empty()
                                  ? absl::StrCat("can't open: ", cause)
                                  : absl::StrCat("can't open device ",
                                                 request.name, ": ", cause));
  };
  if (spec.force_share && !spec.read_only) {
    return cant_open(absl::StatusCode::kInvalidArgument,
                     "force-share=on can only be used with read-only images");
  }
  if (spec.aio == io::EngineKind::kNative && spec.cache != "none" &&
      spec.cache != "directsync") {
    return cant_open(
        absl::StatusCode::kInvalidArgument,
        "aio=native was specified, but it requires cache.direct=on, which "
        "was not specified.");
  }
  if (request.copy_on_read) {
    // QEMU checks this before it opens anything.
    if (spec.read_only) {
      return cant_open(absl::StatusCode::kInvalidArgument,
                       "Can't use copy-on-read on read-only device");
    }
  }
  ImageSpec open_spec = spec;
  open_spec.copy_on_read = request.copy_on_read;
  absl::StatusOr<OpenedImage> image = request.snapshot
                                          ? OpenSnapshot(open_spec)
                                          : OpenImage(open_spec, err());
  if (!image.ok()) {
    // Without the "Could not open 'F': " that qemu-img puts before the cause.
    absl::string_view cause = image.status().message();
    absl::ConsumePrefix(&cause,
                        absl::StrCat("Could not open '", spec.filename, "': "));
    return cant_open(image.status().code(), cause);
  }
  image_ = *std::move(image);
  current_ = request;
  discard_ignored_ = request.discard_ignored;
  return absl::OkStatus();
}

absl::StatusOr<OpenedImage> Session::OpenSnapshot(const ImageSpec& spec) {
  ASSIGN_OR_RETURN(TemporaryOverlay overlay, OpenTemporaryOverlay(spec, err()));
  snapshot_overlay_ = overlay.path;
  snapshot_reopened_ = false;
  return std::move(overlay.image);
}

bool Session::CmdOpen(const CommandDef& def, std::vector<std::string>& words) {
  OpenRequest r;
  r.spec.read_only = false;
  r.spec.cache = "writethrough";  // qemu-io's default
  std::string options;
  std::vector<std::string> operands;
  if (!GetOptions(
          def, words, "snCro:ki:t:d:U",
          [&](int c, const char* arg) {
            switch (c) {
              case 's':
                r.snapshot = true;
                break;
              case 'n':
                r.spec.cache = "none";
                break;
              case 'C':
                r.copy_on_read = true;
                break;
              case 'r':
                r.spec.read_only = true;
                break;
              case 'k':
                r.spec.aio = io::EngineKind::kNative;
                break;
              case 'i': {
                absl::StatusOr<io::EngineKind> aio = io::ParseEngineKind(arg);
                if (!aio.ok()) {
                  Error(aio.status().message());
                  return false;
                }
                r.spec.aio = *aio;
                break;
              }
              case 't':
                return ParseCacheOption(arg, &r.spec.cache);
              case 'd':
                if (std::strcmp(arg, "ignore") == 0 ||
                    std::strcmp(arg, "off") == 0) {
                  r.discard_ignored = true;
                } else if (std::strcmp(arg, "unmap") == 0 ||
                           std::strcmp(arg, "on") == 0) {
                  r.discard_ignored = false;
                } else {
                  Error(absl::StrCat("Invalid discard option: ", arg));
                  return false;
                }
                break;
              case 'o':
                if (image_opts_) {
                  out() << "--image-opts and 'open -o' are mutually "
                           "exclusive\n";
                  return false;
                }
                return AppendOptions(arg, &options);
              case 'U':
                r.spec.force_share = true;
                break;
            }
            return true;
          },
          &operands)) {
    return false;
  }
  if (operands.size() > 1) return Usage(def);
  const std::string path = operands.empty() ? "" : operands[0];
  if (image_.node != nullptr) {
    Error("file open already, try 'help close'");
    return false;
  }
  if (!options.empty()) {
    absl::StatusOr<NodeOptions> tree = OpenCommandOptions(path, options);
    if (!tree.ok()) {
      Error(tree.status().message());
      return false;
    }
    r.spec.filename = FlattenOptions(*tree);
    r.spec.image_opts = true;
    r.name = path;
  } else if (path.empty()) {
    Error("can't open: Must specify either driver or file");
    return false;
  } else {
    r.spec.filename = path;
    r.spec.image_opts = image_opts_;
    if (!image_opts_) r.name = path;
  }
  if (absl::Status st = Open(r); !st.ok()) {
    Error(st.message());
    return false;
  }
  return true;
}

bool Session::CmdClose(const CommandDef&, std::vector<std::string>&) {
  Close();
  return true;
}

bool Session::CmdReopen(const CommandDef& def,
                        std::vector<std::string>& words) {
  std::optional<bool> read_only;  // -r / -w
  std::optional<std::string> cache;
  std::string options;
  std::vector<std::string> operands;
  if (!GetOptions(
          def, words, "c:o:rw",
          [&](int c, const char* arg) {
            switch (c) {
              case 'c':
                return ParseCacheOption(arg, &cache.emplace());
              case 'o':
                return AppendOptions(arg, &options);
              case 'r':
              case 'w':
                if (read_only.has_value()) {
                  Error("Only one -r/-w option may be given");
                  return false;
                }
                read_only = c == 'r';
                break;
            }
            return true;
          },
          &operands)) {
    return false;
  }
  if (!operands.empty()) return Usage(def);
  absl::StatusOr<OptionList> list = ParseOptionString(options);
  if (!list.ok()) {
    Error(list.status().message());
    return false;
  }
  bool has_read_only = false, has_cache = false;
  for (const auto& [key, value] : *list) {
    if (key == "read-only") has_read_only = true;
    if (key == "cache.direct" || key == "cache.no-flush") has_cache = true;
  }
  if (has_read_only && read_only.has_value()) {
    Error("Cannot set both -r/-w and 'read-only'");
    return false;
  }
  if (has_cache && cache.has_value()) {
    Error("Cannot set both -c and the cache options");
    return false;
  }
  if (current_.snapshot) return ReopenSnapshot(read_only, cache, *list);
  absl::StatusOr<NodeOptions> tree = block::ImageOptions(
      current_.spec.filename, current_.spec.format, current_.spec.image_opts);
  if (!tree.ok()) {
    Error(tree.status().message());
    return false;
  }
  tree->values.emplace("driver", image_.format);
  OpenRequest r = current_;
  r.name.clear();
  r.spec.read_only = read_only.value_or(current_.spec.read_only);
  if (cache.has_value()) r.spec.cache = *cache;
  // QEMU's bdrv_reopen_prepare: the generic options take new values; the
  // rest must keep theirs unless the driver can change them.
  for (const auto& [key, value] : *list) {
    const size_t dot = key.rfind('.');
    const std::string node = dot == std::string::npos ? "" : key.substr(0, dot);
    const std::string name =
        dot == std::string::npos ? key : key.substr(dot + 1);
    if (name == "read-only" || name == "auto-read-only" ||
        name == "force-share" || key == "cache.direct" ||
        key == "cache.no-flush") {
      absl::StatusOr<bool> on = ParseBoolOption(key, value);
      if (!on.ok()) {
        Error(on.status().message());
        return false;
      }
      if (key == "read-only") {
        r.spec.read_only = *on;
      } else if (absl::StartsWith(key, "cache.")) {
        SetOption(*tree, key, value);
      }
      continue;
    }
    const std::string driver = DriverAt(*tree, node, image_);
    const std::optional<std::string> now = OptionAt(*tree, key);
    if ((name == "driver" && value == driver) ||
        (now.has_value() && *now == value)) {
      continue;  // unchanged
    }
    const block::Driver* d = block::FindDriver(driver);
    const bool changeable =
        name != "driver" && name != "node-name" && d != nullptr &&
        std::find(d->keys.begin(), d->keys.end(), name) != d->keys.end();
    if (!changeable) {
      Error(absl::StrCat("Cannot change the option '", name, "'"));
      return false;
    }
    SetOption(*tree, key, value);
  }
  if (current_.copy_on_read && r.spec.read_only) {
    // QEMU's bdrv_reopen_prepare, naming the node by its generated name.
    Error(absl::StrFormat(
        "Can't set node '#block%03d' to r/o with copy-on-read enabled",
        ++generated_node_names_));
    return false;
  }
  r.spec.filename = FlattenOptions(*tree);
  r.spec.format.clear();
  r.spec.image_opts = true;
  const OpenRequest old = current_;
  Close();
  absl::Status st = Open(r);
  if (st.ok()) return true;
  absl::string_view cause = st.message();
  absl::ConsumePrefix(&cause, "can't open: ");
  Error(cause);
  if (absl::Status again = Open(old); !again.ok()) Error(again.message());
  return false;
}

bool Session::ReopenSnapshot(std::optional<bool> read_only,
                             const std::optional<std::string>& cache,
                             const OptionList& options) {
  // QEMU reopens the -s overlay's file by its name, which was unlinked once
  // open: a reopen that has to open it again fails (read-only changes, or
  // O_DIRECT before or after), and so does every reopen after the first
  // (QEMU 7.2's file-posix then always opens again). The image stays as it
  // was.
  bool ro = read_only.value_or(current_.spec.read_only);
  const auto direct = [](absl::string_view mode) {
    return mode == "none" || mode == "directsync";
  };
  const std::string& mode = cache.value_or(current_.spec.cache);
  bool odirect = direct(mode);
  for (const auto& [key, value] : options) {
    if (key != "read-only" && key != "cache.direct") {
      Error("reopen -o of an image opened with -s is not supported yet");
      return false;
    }
    absl::StatusOr<bool> on = ParseBoolOption(key, value);
    if (!on.ok()) {
      Error(on.status().message());
      return false;
    }
    (key == "read-only" ? ro : odirect) = *on;
  }
  if (snapshot_reopened_ || ro != current_.spec.read_only || odirect ||
      direct(current_.spec.cache)) {
    Error(absl::StrCat("Could not open '", snapshot_overlay_,
                       "': ", std::strerror(ENOENT)));
    return false;
  }
  if ((mode == "unsafe") != (current_.spec.cache == "unsafe")) {
    Error("reopen -c unsafe of an image opened with -s is not supported yet");
    return false;
  }
  snapshot_reopened_ = true;
  current_.spec.cache = mode;  // writethrough or not (WriteThrough())
  return true;
}

}  // namespace imgtool::cli::qemu_io
