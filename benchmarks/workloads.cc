#include "benchmarks/workloads.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "io/aligned_buffer.h"
#include "io/task.h"
#include "posix_file/file_options.pb.h"

namespace imgtool::benchmarks {
namespace {

struct StridedState {
  io::BlockNode* node = nullptr;
  uint64_t next = 0;
  uint64_t end = 0;
  uint64_t step = 0;
  uint64_t request_size = 0;
  int running = 0;
  absl::Status error;
};

io::Task<void> StridedWorker(StridedState* s, io::ConstIoVec buf) {
  while (s->error.ok() && s->next + s->request_size <= s->end) {
    const uint64_t offset = s->next;
    s->next += s->step;
    absl::Status st = co_await s->node->Write(offset, buf);
    if (!st.ok() && s->error.ok()) s->error = std::move(st);
  }
}

io::Task<absl::StatusOr<uint64_t>> Walk(io::BlockNode* node) {
  const uint64_t size = node->size();
  uint64_t answers = 0;
  for (uint64_t offset = 0; offset < size;) {
    CO_ASSIGN_OR_RETURN(io::BlockStatus status,
                        co_await node->GetBlockStatus(offset, size - offset));
    offset += status.length;
    ++answers;
  }
  co_return answers;
}

}  // namespace

absl::Status WriteStrided(io::Engine& engine, io::BlockNode& node,
                          uint64_t first_offset, uint64_t end, uint64_t step,
                          uint64_t request_size, int depth, uint8_t pattern) {
  if (depth < 1 || step == 0) {
    return absl::InvalidArgumentError("WriteStrided: depth and step must be > 0");
  }
  StridedState s;
  s.node = &node;
  s.next = first_offset;
  s.end = end;
  s.step = step;
  s.request_size = request_size;
  io::AlignedBuffer buffer(request_size);
  std::memset(buffer.data(), pattern, buffer.size());
  for (int i = 0; i < depth; ++i) {
    ++s.running;
    io::Spawn(StridedWorker(&s, buffer.span()), [&s] { --s.running; });
  }
  while (s.running > 0) {
    if (engine.in_flight() == 0) {
      return absl::InternalError("WriteStrided: workers stalled");
    }
    RETURN_IF_ERROR(engine.Poll(/*wait=*/true));
  }
  return s.error;
}

absl::Status WriteInterleaved(io::Engine& engine, io::BlockNode& node,
                              int depth) {
  constexpr uint64_t kBlock = 4096;
  RETURN_IF_ERROR(WriteStrided(engine, node, 0, node.size(), 2 * kBlock,
                               kBlock, depth));
  return WriteStrided(engine, node, kBlock, node.size(), 2 * kBlock, kBlock,
                      depth);
}

absl::StatusOr<uint64_t> WalkBlockStatus(io::Engine& engine,
                                         io::BlockNode& node) {
  return io::RunSync(engine, Walk(&node));
}

absl::StatusOr<RawImage> CreateAndOpenRaw(const std::string& path,
                                          uint64_t size,
                                          std::optional<uint64_t> hint) {
  posix_file::FileCreateOptions create;
  create.set_size(size);
  if (hint.has_value()) create.set_extent_size_hint(*hint);
  RETURN_IF_ERROR(posix_file::CreateFile(path, create, /*warnings=*/nullptr));
  return OpenRaw(path);
}

absl::StatusOr<std::unique_ptr<posix_file::FileNode>> OpenFileNode(
    io::Engine& engine, const std::string& path, bool read_only) {
  posix_file::FileOpenOptions open;
  open.set_filename(path);
  open.set_cache("none");
  open.set_read_only(read_only);
  return posix_file::FileNode::Open(engine, open, nullptr);
}

absl::StatusOr<RawImage> OpenRaw(const std::string& path, bool read_only) {
  RawImage image;
  ASSIGN_OR_RETURN(image.engine,
                   io::CreateEngine(io::EngineKind::kAuto, 64, nullptr));
  ASSIGN_OR_RETURN(image.node, OpenFileNode(*image.engine, path, read_only));
  return image;
}

absl::Status CloseRaw(RawImage& image) {
  absl::Status st = io::RunSync(*image.engine, image.node->Close());
  image.node.reset();
  image.engine.reset();
  return st;
}

absl::Status CreateFullRaw(const std::string& path, uint64_t size) {
  ASSIGN_OR_RETURN(RawImage image, CreateAndOpenRaw(path, size, 0));
  absl::Status st = WriteStrided(*image.engine, *image.node, 0, size, 1 << 20,
                                 1 << 20, 8, 0xaa);
  absl::Status closed = CloseRaw(image);
  RETURN_IF_ERROR(st);
  return closed;
}

}  // namespace imgtool::benchmarks
