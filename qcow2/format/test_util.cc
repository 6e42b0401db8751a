#include "qcow2/format/test_util.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace imgtool::qcow2::format::testing {

std::string TempPath(absl::string_view name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

absl::StatusOr<std::string> RunShell(const std::string& command) {
  const std::string full = command + " 2>&1";
  FILE* pipe = popen(full.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError("popen failed: " + command);
  std::string output;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) output.append(buf, n);
  const int rc = pclose(pipe);
  if (rc != 0) {
    return absl::InternalError(
        absl::StrCat("`", command, "` failed (", rc, "): ", output));
  }
  return output;
}

absl::StatusOr<std::string> QemuImgCreate(absl::string_view name,
                                          absl::string_view options,
                                          absl::string_view size) {
  const std::string path = TempPath(name);
  std::remove(path.c_str());
  // Run in the temporary directory so relative backing/data file names land
  // there too.
  std::string cmd = absl::StrCat("cd '", TempPath(""), "' && qemu-img create -q -f qcow2");
  if (!options.empty()) absl::StrAppend(&cmd, " -o '", options, "'");
  absl::StrAppend(&cmd, " '", path, "' ", size);
  absl::StatusOr<std::string> out = RunShell(cmd);
  if (!out.ok()) return out.status();
  return path;
}

absl::StatusOr<std::vector<uint8_t>> ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
  return bytes;
}

absl::Status WriteFileBytes(const std::string& path,
                            absl::Span<const uint8_t> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  if (!out) return absl::InternalError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace imgtool::qcow2::format::testing
