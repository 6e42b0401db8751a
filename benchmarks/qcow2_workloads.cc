#include "benchmarks/qcow2_workloads.h"

#include <unistd.h>

#include <memory>

#include "base/status_macros.h"
#include "benchmarks/workloads.h"
#include "io/engine.h"
#include "io/task.h"
#include "posix_file/file_node.h"
#include "posix_file/file_options.pb.h"
#include "qcow2/create.h"
#include "qcow2/qcow2_options.pb.h"

namespace imgtool::benchmarks {

absl::Status CreateQcow2Image(const std::string& path, uint64_t size,
                              uint64_t cluster_size, bool extended_l2,
                              const std::string& backing_raw) {
  unlink(path.c_str());
  posix_file::FileCreateOptions create;
  create.set_size(0);
  RETURN_IF_ERROR(posix_file::CreateFile(path, create, nullptr));
  ASSIGN_OR_RETURN(std::unique_ptr<io::Engine> engine,
                   io::CreateEngine(io::EngineKind::kAuto, 64, nullptr));
  ASSIGN_OR_RETURN(std::unique_ptr<posix_file::FileNode> file,
                   OpenFileNode(*engine, path, /*read_only=*/false));
  qcow2::Qcow2CreateOptions options;
  options.set_size(size);
  options.set_cluster_size(cluster_size);
  if (!backing_raw.empty()) {
    options.set_backing_file(backing_raw);
    options.set_backing_fmt("raw");
  }
  options.set_extended_l2(extended_l2);
  absl::Status st = io::RunSync(*engine, qcow2::CreateQcow2(*file, options));
  absl::Status closed = io::RunSync(*engine, file->Close());
  RETURN_IF_ERROR(st);
  return closed;
}

}  // namespace imgtool::benchmarks
