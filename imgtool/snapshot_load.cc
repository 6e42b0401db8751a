#include "imgtool/snapshot_load.h"

#include <cerrno>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/errno_status.h"
#include "imgtool/command.h"
#include "io/engine.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::cli {
namespace {

constexpr char kPrefix[] = "snapshot.";

struct SnapshotKey {
  std::optional<std::string> id;
  std::optional<std::string> name;
};

// QemuOpts parsing of internal_snapshot_opts (keys snapshot.id and
// snapshot.name; ",," is a literal comma).
absl::StatusOr<SnapshotKey> ParseKey(const std::string& arg,
                                     std::ostream& err) {
  SnapshotKey key;
  std::vector<std::string> items;
  std::string cur;
  for (size_t i = 0; i < arg.size(); ++i) {
    if (arg[i] == ',') {
      if (i + 1 < arg.size() && arg[i + 1] == ',') {
        cur += ',';
        ++i;
        continue;
      }
      items.push_back(std::move(cur));
      cur.clear();
      continue;
    }
    cur += arg[i];
  }
  items.push_back(std::move(cur));
  for (const std::string& item : items) {
    const size_t eq = item.find('=');
    const std::string k = item.substr(0, eq);
    const std::string v = eq == std::string::npos ? "on" : item.substr(eq + 1);
    if (k == "snapshot.id") {
      key.id = v;
    } else if (k == "snapshot.name") {
      key.name = v;
    } else {
      err << ProgramName() << ": Invalid parameter '" << k << "'\n";
      return absl::InvalidArgumentError(
          absl::StrCat("Failed in parsing snapshot param '", arg, "'"));
    }
  }
  return key;
}

}  // namespace

absl::Status CheckSnapshotOption(const std::string& arg, std::ostream& err) {
  if (!absl::StartsWith(arg, kPrefix)) return absl::OkStatus();
  return ParseKey(arg, err).status();
}

absl::Status LoadSnapshot(OpenedImage& image, const std::string& arg,
                          std::ostream& err) {
  auto failed = [](const absl::Status& st) {
    return WithMessage(st, absl::StrCat("Failed to load snapshot: ", st.message()));
  };
  qcow2::Qcow2Node* q = image.qcow2;
  if (q == nullptr) {
    return absl::UnimplementedError(absl::StrCat(
        "Failed to load snapshot: Block format '", image.format,
        "' used by device '' does not support temporarily loading internal "
        "snapshots"));
  }
  if (absl::StartsWith(arg, kPrefix)) {
    absl::StatusOr<SnapshotKey> key = ParseKey(arg, err);
    if (!key.ok()) return key.status();
    absl::Status st = io::RunSync(*image.engine,
                                  q->LoadSnapshotReadOnly(key->id, key->name));
    return st.ok() ? st : failed(st);
  }
  absl::Status st =
      io::RunSync(*image.engine, q->LoadSnapshotReadOnly(arg, std::nullopt));
  if (StatusErrno(st) == ENOENT) {
    st = io::RunSync(*image.engine, q->LoadSnapshotReadOnly(std::nullopt, arg));
  }
  return st.ok() ? st : failed(st);
}

}  // namespace imgtool::cli
