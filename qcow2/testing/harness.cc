#include "qcow2/testing/harness.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <regex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "io/chain_status.h"
#include "posix_file/file_node.h"
#include "posix_file/file_options.pb.h"
#include "qcow2/create.h"

namespace imgtool::qcow2::testing {

std::string TempPath(absl::string_view name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

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
  const std::vector<uint8_t> err = ReadWholeFile(err_path);
  r.err.assign(err.begin(), err.end());
  unlink(err_path.c_str());
  return r;
}

std::vector<uint8_t> Pattern(uint64_t length, uint64_t seed) {
  std::vector<uint8_t> v(length);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (uint64_t i = 0; i < length; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v[i] = static_cast<uint8_t>(x | 1);
  }
  return v;
}

std::vector<uint8_t> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

namespace {

// Data extents [start, end) of an open file below `size`.
std::vector<std::pair<uint64_t, uint64_t>> DataExtents(int fd, uint64_t size) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  uint64_t pos = 0;
  while (pos < size) {
    off_t d = lseek(fd, static_cast<off_t>(pos), SEEK_DATA);
    if (d < 0) break;
    off_t h = lseek(fd, d, SEEK_HOLE);
    if (h < 0) h = static_cast<off_t>(size);
    out.emplace_back(d, std::min<uint64_t>(h, size));
    pos = h;
  }
  return out;
}

}  // namespace

int64_t FirstDifference(const std::string& a, const std::string& b) {
  const int fa = open(a.c_str(), O_RDONLY);
  const int fb = open(b.c_str(), O_RDONLY);
  struct stat sa, sb;
  if (fa < 0 || fb < 0 || fstat(fa, &sa) != 0 || fstat(fb, &sb) != 0) {
    if (fa >= 0) close(fa);
    if (fb >= 0) close(fb);
    return 0;
  }
  const uint64_t size = std::min<uint64_t>(sa.st_size, sb.st_size);
  std::vector<std::pair<uint64_t, uint64_t>> ranges = DataExtents(fa, size);
  for (auto r : DataExtents(fb, size)) ranges.push_back(r);
  std::sort(ranges.begin(), ranges.end());
  int64_t result = -1;
  std::vector<uint8_t> ba(1 << 20), bb(1 << 20);
  uint64_t done = 0;
  for (auto [start, end] : ranges) {
    start = std::max<uint64_t>(start, done);
    for (uint64_t pos = start; pos < end && result < 0;) {
      const uint64_t n = std::min<uint64_t>(ba.size(), end - pos);
      if (pread(fa, ba.data(), n, pos) != static_cast<ssize_t>(n) ||
          pread(fb, bb.data(), n, pos) != static_cast<ssize_t>(n)) {
        result = pos;
        break;
      }
      if (std::memcmp(ba.data(), bb.data(), n) != 0) {
        for (uint64_t i = 0; i < n; ++i) {
          if (ba[i] != bb[i]) {
            result = pos + i;
            break;
          }
        }
      }
      pos += n;
    }
    if (result >= 0) break;
    done = std::max<uint64_t>(done, end);
  }
  close(fa);
  close(fb);
  if (result < 0 && sa.st_size != sb.st_size) result = size;
  return result;
}

Env::Env(io::EngineKind kind, int depth) {
  absl::StatusOr<std::unique_ptr<io::Engine>> engine =
      io::CreateEngine(kind, depth, nullptr);
  if (!engine.ok()) std::abort();
  engine_ = *std::move(engine);
}

absl::StatusOr<std::unique_ptr<io::BlockNode>> Env::CreateEmpty(
    const std::string& path) {
  posix_file::FileCreateOptions create;
  create.set_size(0);
  RETURN_IF_ERROR(posix_file::CreateFile(path, create, nullptr));
  return OpenFile(path, /*read_only=*/false);
}

absl::StatusOr<std::unique_ptr<io::BlockNode>> Env::OpenFile(
    const std::string& path, bool read_only) {
  posix_file::FileOpenOptions options;
  options.set_filename(path);
  options.set_read_only(read_only);
  options.set_force_share(read_only);
  ASSIGN_OR_RETURN(std::unique_ptr<posix_file::FileNode> node,
                   posix_file::FileNode::Open(*engine_, options, nullptr));
  return std::unique_ptr<io::BlockNode>(std::move(node));
}

BackingOpener Env::Opener() {
  return [this](std::string filename, std::string format)
             -> io::Task<absl::StatusOr<std::unique_ptr<io::BlockNode>>> {
    CO_ASSIGN_OR_RETURN(std::unique_ptr<io::BlockNode> file,
                        OpenFile(filename, /*read_only=*/true));
    uint8_t magic[4] = {};
    CO_RETURN_IF_ERROR(co_await file->Read(0, io::IoVec(magic, 4)));
    const bool is_qcow2 =
        format == "qcow2" ||
        (format.empty() && std::memcmp(magic, "QFI\xfb", 4) == 0);
    if (!is_qcow2) co_return file;
    CO_ASSIGN_OR_RETURN(std::unique_ptr<Qcow2Node> node,
                        co_await Qcow2Node::Open(std::move(file),
                                                 Qcow2OpenOptions(), Opener()));
    co_return std::unique_ptr<io::BlockNode>(std::move(node));
  };
}

absl::StatusOr<std::unique_ptr<Qcow2Node>> Env::OpenQcow2(
    const std::string& path, bool read_only, Qcow2OpenOptions options) {
  ASSIGN_OR_RETURN(std::unique_ptr<io::BlockNode> file,
                   OpenFile(path, read_only));
  return Run(Qcow2Node::Open(std::move(file), options, Opener()));
}

absl::Status Env::CreateImage(const std::string& path,
                              const Qcow2CreateOptions& options) {
  ASSIGN_OR_RETURN(std::unique_ptr<io::BlockNode> file, CreateEmpty(path));
  absl::Status st = Run(CreateQcow2(*file, options));
  absl::Status closed = Run(file->Close());
  RETURN_IF_ERROR(st);
  return closed;
}

absl::Status Env::DumpToRaw(io::BlockNode& node, const std::string& path) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return ErrnoStatus(path, "open", errno);
  std::vector<uint8_t> buf(1 << 20);
  absl::Status st;
  for (uint64_t pos = 0; pos < node.size() && st.ok();) {
    const uint64_t n = std::min<uint64_t>(buf.size(), node.size() - pos);
    st = Run(node.Read(pos, io::IoVec(buf.data(), n)));
    if (!st.ok()) break;
    const bool zero = std::all_of(buf.begin(), buf.begin() + n,
                                  [](uint8_t b) { return b == 0; });
    if (!zero && pwrite(fd, buf.data(), n, pos) != static_cast<ssize_t>(n)) {
      st = ErrnoStatus(path, "pwrite", errno);
    }
    pos += n;
  }
  if (st.ok() && ftruncate(fd, node.size()) != 0) {
    st = ErrnoStatus(path, "ftruncate", errno);
  }
  close(fd);
  return st;
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

}  // namespace imgtool::qcow2::testing
