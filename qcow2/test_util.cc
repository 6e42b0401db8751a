#include "qcow2/test_util.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "gtest/gtest.h"
#include "posix_file/file_node.h"
#include "posix_file/file_options.pb.h"
#include "qcow2/create.h"

namespace imgtool::qcow2::testing {

std::string TempPath(absl::string_view name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

ShellResult Shell(const std::string& command) {
  ShellResult r;
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) {
    r.exit_code = -1;
    return r;
  }
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::vector<uint8_t> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

ShellOutput RunShell(const std::string& dir, const std::string& command) {
  const std::string out = dir + ".sh_out";
  const std::string err = dir + ".sh_err";
  const std::string full = absl::StrCat("cd '", dir, "' && (", command, ") >'",
                                        out, "' 2>'", err, "'");
  const int status = std::system(full.c_str());
  ShellOutput r;
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = ReadAll(out);
  r.err = ReadAll(err);
  return r;
}

void PatchHex(const std::string& path, uint64_t offset,
              const std::string& hex) {
  std::string bytes;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    bytes.push_back(
        static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  const int fd = open(path.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(pwrite(fd, bytes.data(), bytes.size(), offset),
            static_cast<ssize_t>(bytes.size()));
  close(fd);
}

void WriteFile(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

namespace {

// Data extents [start, end) of an open file (holes read as zeroes).
std::vector<std::pair<uint64_t, uint64_t>> DataExtents(int fd, uint64_t size) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  uint64_t pos = 0;
  while (pos < size) {
    off_t d = lseek(fd, static_cast<off_t>(pos), SEEK_DATA);
    if (d < 0) break;
    off_t h = lseek(fd, d, SEEK_HOLE);
    if (h < 0) h = static_cast<off_t>(size);
    out.emplace_back(d, h);
    pos = h;
  }
  return out;
}

}  // namespace

int64_t FirstDifference(const std::string& a, const std::string& b) {
  int fa = open(a.c_str(), O_RDONLY);
  int fb = open(b.c_str(), O_RDONLY);
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
  uint64_t done = 0;  // everything below was compared
  for (auto [start, end] : ranges) {
    start = std::max<uint64_t>(start, done);
    end = std::min<uint64_t>(end, size);
    for (uint64_t pos = start; pos < end && result < 0;) {
      const uint64_t n = std::min<uint64_t>(ba.size(), end - pos);
      ssize_t ra = pread(fa, ba.data(), n, pos);
      ssize_t rb = pread(fb, bb.data(), n, pos);
      if (ra != static_cast<ssize_t>(n) || rb != static_cast<ssize_t>(n)) {
        result = pos;
        break;
      }
      for (uint64_t i = 0; i < n; ++i) {
        if (ba[i] != bb[i]) {
          result = pos + i;
          break;
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

ForwardingNode::ForwardingNode(std::unique_ptr<io::BlockNode> target)
    : io::BlockNode(target->filename(), target->read_only()),
      target_(std::move(target)) {}

io::Task<absl::Status> ForwardingNode::DoRead(uint64_t offset, io::IoVec buf) {
  return target_->Read(offset, buf);
}

io::Task<absl::Status> ForwardingNode::DoWrite(uint64_t offset,
                                               io::ConstIoVec data) {
  return target_->Write(offset, data);
}

io::Task<absl::Status> ForwardingNode::DoWriteZeroes(
    uint64_t offset, uint64_t length, io::WriteZeroesFlags flags) {
  return target_->WriteZeroes(offset, length, flags);
}

io::Task<absl::Status> ForwardingNode::DoDiscard(uint64_t offset,
                                                 uint64_t length) {
  return target_->Discard(offset, length);
}

io::Task<absl::Status> ForwardingNode::DoFlush() { return target_->Flush(); }

io::Task<absl::Status> ForwardingNode::DoTruncate(uint64_t size,
                                                  io::PreallocMode prealloc) {
  return target_->Truncate(size, prealloc);
}

io::Task<absl::StatusOr<io::BlockStatus>> ForwardingNode::DoGetBlockStatus(
    uint64_t offset, uint64_t max_length) {
  return target_->GetBlockStatus(offset, max_length);
}

Env::Env()
    : Env(std::getenv("QCOW2_TEST_THREADS") != nullptr
              ? io::EngineKind::kThreads
              : io::EngineKind::kAuto) {}

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
    const bool is_qcow2 = format == "qcow2" ||
                          (format.empty() && std::memcmp(magic, "QFI\xfb", 4) == 0);
    if (!is_qcow2) co_return file;
    CO_ASSIGN_OR_RETURN(std::unique_ptr<Qcow2Node> node,
                        co_await Qcow2Node::Open(std::move(file),
                                                 Qcow2OpenOptions(), Opener()));
    co_return std::unique_ptr<io::BlockNode>(std::move(node));
  };
}

absl::StatusOr<std::unique_ptr<Qcow2Node>> Env::OpenQcow2(
    const std::string& path, bool read_only, Qcow2OpenOptions options,
    uint64_t grow_length_ahead) {
  ASSIGN_OR_RETURN(std::unique_ptr<io::BlockNode> file, OpenFile(path, read_only));
  // OpenFile opens a FileNode.
  auto& file_node = static_cast<posix_file::FileNode&>(*file);
  file_node.GrowLengthAhead(grow_length_ahead);
  ASSIGN_OR_RETURN(std::unique_ptr<Qcow2Node> node,
                   Run(Qcow2Node::Open(std::move(file), options, Opener())));
  if (grow_length_ahead != 0 && !read_only &&
      file_node.MayHaveTailGrownAhead()) {
    // As block/registry.cc: a hole tail past the last refcounted cluster is
    // cut at close.
    absl::StatusOr<uint64_t> used_end = Run(node->RefcountedEnd());
    if (used_end.ok()) file_node.AdoptHoleTail(*used_end);
  }
  return node;
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

void RunMixedBatches(Env& env, io::BlockNode& node, std::vector<uint8_t>& ref,
                     std::mt19937_64& rng, int batches, uint64_t slot,
                     uint64_t discard_unit) {
  enum Kind { kWrite, kWrite2, kZero, kZeroUnmap, kRead, kDiscard };
  const uint64_t slots = node.size() / slot;
  const int kinds = discard_unit > 0 ? 6 : 5;
  for (int batch = 0; batch < batches; ++batch) {
    std::vector<uint64_t> picks;
    while (picks.size() < 64) {
      const uint64_t s = rng() % slots;
      if (std::find(picks.begin(), picks.end(), s) == picks.end()) {
        picks.push_back(s);
      }
    }
    struct Op {
      int kind;
      uint64_t offset, length;
      std::vector<uint8_t> data;
      absl::Status status;
      std::vector<uint8_t> expected;  // reads
    };
    std::vector<Op> ops(picks.size());
    for (size_t i = 0; i < picks.size(); ++i) {
      Op& op = ops[i];
      op.kind = static_cast<int>(rng() % kinds);
      op.offset = picks[i] * slot + rng() % 100;
      op.length = 1 + rng() % (slot - 100);
      switch (op.kind) {
        case kWrite:
        case kWrite2:
          op.data = Pattern(op.length, batch * 100 + i);
          std::copy(op.data.begin(), op.data.end(), ref.begin() + op.offset);
          break;
        case kZero:
        case kZeroUnmap:
          std::fill(ref.begin() + op.offset,
                    ref.begin() + op.offset + op.length, 0);
          break;
        case kRead:
          op.expected.assign(ref.begin() + op.offset,
                             ref.begin() + op.offset + op.length);
          op.data.assign(op.length, 0xee);
          break;
        case kDiscard: {
          // Whole units only (partial ones may be dropped).
          const uint64_t a = (op.offset + discard_unit - 1) / discard_unit *
                             discard_unit;
          const uint64_t b = std::max(
              a, (op.offset + op.length) / discard_unit * discard_unit);
          op.offset = a;
          op.length = b - a;
          std::fill(ref.begin() + a, ref.begin() + b, 0);
          break;
        }
      }
    }
    int done = 0;
    for (Op& op : ops) {
      auto finish = [&done, &op](absl::Status st) {
        op.status = st;
        ++done;
      };
      switch (op.kind) {
        case kWrite:
        case kWrite2:
          io::Spawn(node.Write(op.offset, io::ConstIoVec(op.data)), finish);
          break;
        case kZero:
        case kZeroUnmap: {
          io::WriteZeroesFlags f;
          f.may_unmap = op.kind == kZeroUnmap;
          io::Spawn(node.WriteZeroes(op.offset, op.length, f), finish);
          break;
        }
        case kRead:
          io::Spawn(node.Read(op.offset, io::IoVec(op.data)), finish);
          break;
        case kDiscard:
          io::Spawn(node.Discard(op.offset, op.length), finish);
          break;
      }
    }
    if (batch % 7 == 3) {
      io::Spawn(node.Flush(),
                [](absl::Status st) { EXPECT_TRUE(st.ok()) << st; });
    }
    while (done < static_cast<int>(ops.size())) {
      ASSERT_TRUE(env.engine().Poll(true).ok());
    }
    for (const Op& op : ops) {
      ASSERT_TRUE(op.status.ok()) << op.status;
      if (op.kind == kRead) {
        EXPECT_EQ(op.data, op.expected) << "read at " << op.offset;
      }
    }
  }
}

}  // namespace imgtool::qcow2::testing
