#include "qcow2/testing/harness.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <regex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "io/chain_status.h"

namespace imgtool::qcow2::testing {

CommandResult RunCommand(const std::string& command) {
  static std::atomic<int> counter{0};
  const std::string err_path =
      TempPath(absl::StrCat("stderr.", getpid(), ".", counter++));
  CommandResult r;
  FILE* p = popen(absl::StrCat("(", command, ") 2>", err_path).c_str(), "r");
  if (p == nullptr) {
    r.exit_code = -1;
    return r;
  }
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  const std::vector<uint8_t> err = ReadFile(err_path);
  r.err.assign(err.begin(), err.end());
  unlink(err_path.c_str());
  return r;
}

std::string ToString(const MapEntry& e) {
  std::string s = absl::StrFormat(
      "{ \"start\": %u, \"length\": %u, \"depth\": %d, \"present\": %s, "
      "\"zero\": %s, \"data\": %s",
      e.start, e.length, e.depth, e.present ? "true" : "false",
      e.zero ? "true" : "false", e.data ? "true" : "false");
  if (e.has_offset) absl::StrAppend(&s, ", \"offset\": ", e.offset);
  return s + "}";
}

std::string ToString(const std::vector<MapEntry>& map) {
  std::string s;
  for (const MapEntry& e : map) absl::StrAppend(&s, ToString(e), "\n");
  return s;
}

absl::StatusOr<std::vector<MapEntry>> ParseQemuMap(const std::string& json) {
  static const std::regex kLine(
      R"re(\{ "start": (\d+), "length": (\d+), "depth": (\d+), "present": (true|false), "zero": (true|false), "data": (true|false)(, "compressed": (?:true|false))?(, "offset": (\d+))?\})re");
  std::vector<MapEntry> out;
  for (absl::string_view line : absl::StrSplit(json, '\n')) {
    if (line.find('{') == absl::string_view::npos) continue;
    std::cmatch m;
    if (!std::regex_search(line.begin(), line.end(), m, kLine)) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected map line: ", line));
    }
    MapEntry e;
    e.start = std::stoull(m[1].str());
    e.length = std::stoull(m[2].str());
    e.depth = std::stoi(m[3].str());
    e.present = m[4] == "true";
    e.zero = m[5] == "true";
    e.data = m[6] == "true";
    if (m[8].matched) {
      e.has_offset = true;
      e.offset = std::stoull(m[9].str());
    }
    out.push_back(e);
  }
  return out;
}

io::Task<absl::StatusOr<std::vector<MapEntry>>> ChainMap(io::BlockNode& top) {
  std::vector<MapEntry> out;
  const io::BlockNode* last_file = nullptr;
  for (uint64_t pos = 0; pos < top.size();) {
    CO_ASSIGN_OR_RETURN(io::ChainStatus cs, co_await io::GetChainStatus(
                                                top, pos, top.size() - pos));
    MapEntry e;
    e.start = pos;
    e.length = cs.status.length;
    e.depth = cs.depth;
    e.present = cs.present;
    e.zero = cs.status.zero;
    e.data = cs.status.data;
    e.has_offset = cs.status.offset_valid;
    e.offset = cs.status.host_offset;
    if (e.length == 0) {
      co_return absl::InternalError(absl::StrCat("empty status at ", pos));
    }
    pos += e.length;
    if (!out.empty()) {
      MapEntry& prev = out.back();
      if (prev.depth == e.depth && prev.present == e.present &&
          prev.zero == e.zero && prev.data == e.data &&
          prev.has_offset == e.has_offset && last_file == cs.status.file &&
          (!e.has_offset || prev.offset + prev.length == e.offset)) {
        prev.length += e.length;
        continue;
      }
    }
    last_file = cs.status.file;
    out.push_back(e);
  }
  co_return out;
}

namespace {

uint64_t JsonNumber(const std::string& json, const std::string& key) {
  const std::string needle = absl::StrCat("\"", key, "\": ");
  const size_t at = json.find(needle);
  if (at == std::string::npos) return 0;
  uint64_t v = 0;
  size_t end = json.find_first_not_of("0123456789", at + needle.size());
  (void)absl::SimpleAtoi(absl::string_view(json).substr(
                             at + needle.size(), end - (at + needle.size())),
                         &v);
  return v;
}

}  // namespace

QemuCheck RunQemuCheck(const std::string& path, const std::string& extra) {
  QemuCheck c;
  CommandResult r;
  for (int attempt = 0; attempt < 100; ++attempt) {
    r = RunCommand(
        absl::StrCat("qemu-img check --output=json ", extra, " ", path));
    if (r.err.find("Failed to get") == std::string::npos) break;
    usleep(50000);
  }
  c.exit_code = r.exit_code;
  c.err = r.err;
  c.output = r.out;
  c.corruptions = JsonNumber(r.out, "corruptions");
  c.leaks = JsonNumber(r.out, "leaks");
  c.check_errors = JsonNumber(r.out, "check-errors");
  c.image_end_offset = JsonNumber(r.out, "image-end-offset");
  c.total_clusters = JsonNumber(r.out, "total-clusters");
  c.allocated_clusters = JsonNumber(r.out, "allocated-clusters");
  c.fragmented_clusters = JsonNumber(r.out, "fragmented-clusters");
  c.compressed_clusters = JsonNumber(r.out, "compressed-clusters");
  return c;
}

uint64_t LastDataEnd(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) return 0;
  uint64_t end = 0;
  for (off_t pos = 0;;) {
    const off_t d = lseek(fd, pos, SEEK_DATA);
    if (d < 0) break;
    const off_t h = lseek(fd, d, SEEK_HOLE);
    if (h < 0) break;
    end = static_cast<uint64_t>(h);
    pos = h;
  }
  close(fd);
  return end;
}

uint64_t FileLength(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_size);
}

}  // namespace imgtool::qcow2::testing
