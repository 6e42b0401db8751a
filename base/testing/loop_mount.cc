#include "base/testing/loop_mount.h"

#include <fcntl.h>
#include <linux/loop.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/errno_status.h"
#include "base/status_macros.h"

namespace imgtool::testing {
namespace {

// Finds `tool` in $PATH and the sbin directories (test environments often
// have a short PATH). kFailedPrecondition if it is nowhere.
absl::StatusOr<std::string> FindTool(const std::string& tool) {
  std::vector<std::string> dirs;
  if (const char* path = std::getenv("PATH")) {
    dirs = absl::StrSplit(path, ':', absl::SkipEmpty());
  }
  for (const char* dir : {"/usr/local/sbin", "/usr/sbin", "/sbin",
                          "/usr/local/bin", "/usr/bin", "/bin"}) {
    dirs.emplace_back(dir);
  }
  for (const std::string& dir : dirs) {
    std::string candidate = absl::StrCat(dir, "/", tool);
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  const char* package = tool == "mkfs.xfs"    ? "xfsprogs"
                        : tool == "mkfs.ext4" ? "e2fsprogs"
                                              : "util-linux";
  return absl::FailedPreconditionError(absl::StrCat(
      "LoopMount: '", tool, "' not found (Debian package ", package, ")"));
}

// Runs `argv` (argv[0] is an absolute path) and returns its stdout.
// kInternal with the command line and its combined output if it fails.
absl::StatusOr<std::string> Run(const std::vector<std::string>& argv) {
  int out_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0) return ErrnoStatus("", "pipe", errno);
  int err_pipe[2];
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    const int error = errno;
    close(out_pipe[0]);
    close(out_pipe[1]);
    return ErrnoStatus("", "pipe", error);
  }
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    const int error = errno;
    for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]}) close(fd);
    return ErrnoStatus("", "fork", error);
  }
  if (pid == 0) {
    dup2(out_pipe[1], STDOUT_FILENO);
    dup2(err_pipe[1], STDERR_FILENO);
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, STDIN_FILENO);
    execv(args[0], args.data());
    _exit(127);
  }
  close(out_pipe[1]);
  close(err_pipe[1]);
  // The tools print little; read stdout fully, then stderr.
  auto read_all = [](int fd) {
    std::string text;
    char buf[4096];
    ssize_t n;
    while ((n = read(fd, buf, sizeof(buf))) > 0 || (n < 0 && errno == EINTR)) {
      if (n > 0) text.append(buf, n);
    }
    close(fd);
    return text;
  };
  std::string out = read_all(out_pipe[0]);
  std::string err = read_all(err_pipe[0]);
  int wstatus = 0;
  while (waitpid(pid, &wstatus, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) return out;
  return absl::InternalError(absl::StrCat(
      "LoopMount: `", absl::StrJoin(argv, " "), "` failed (",
      WIFEXITED(wstatus) ? absl::StrCat("exit ", WEXITSTATUS(wstatus))
                         : absl::StrCat("signal ", WTERMSIG(wstatus)),
      "): ", absl::StripAsciiWhitespace(absl::StrCat(err, out))));
}

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  if (dir != nullptr && *dir != '\0') return dir;
  return "/tmp";
}

}  // namespace

absl::StatusOr<std::unique_ptr<LoopMount>> LoopMount::Create(
    FsKind kind, uint64_t size_bytes) {
  return Make(kind, size_bytes, 0);
}

absl::StatusOr<std::unique_ptr<LoopMount>> LoopMount::CreateWithSectorSize(
    FsKind kind, uint64_t size_bytes, uint32_t sector_size) {
  if (sector_size != 512 && sector_size != 1024 && sector_size != 2048 &&
      sector_size != 4096) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LoopMount: sector size ", sector_size,
        " is not 512, 1024, 2048 or 4096"));
  }
  return Make(kind, (size_bytes + sector_size - 1) / sector_size * sector_size,
              sector_size);
}

absl::StatusOr<std::unique_ptr<LoopMount>> LoopMount::Make(
    FsKind kind, uint64_t size_bytes, uint32_t sector_size) {
  if (geteuid() != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "LoopMount: needs root to mount filesystems (euid ", geteuid(), ")"));
  }
  ASSIGN_OR_RETURN(std::string mkfs_tool,
                   FindTool(kind == FsKind::kXfs ? "mkfs.xfs" : "mkfs.ext4"));
  std::vector<std::string> mkfs;
  switch (kind) {
    case FsKind::kXfs:
      mkfs = {mkfs_tool, "-q", "-f"};
      break;
    case FsKind::kExt4:
      mkfs = {mkfs_tool, "-q", "-F"};
      break;
    case FsKind::kExt4NoExtents:
      mkfs = {mkfs_tool, "-q", "-F", "-O", "^extents,^64bit"};
      break;
  }
  ASSIGN_OR_RETURN(std::string mount_tool, FindTool("mount"));
  std::string losetup;
  if (sector_size != 0) {
    ASSIGN_OR_RETURN(losetup, FindTool("losetup"));
  }

  // From here on the destructor undoes whatever was done.
  std::unique_ptr<LoopMount> m(new LoopMount());
  const std::string dir = TempDir();
  std::string backing_template = absl::StrCat(dir, "/loop_mount_XXXXXX");
  const int fd = mkstemp(backing_template.data());
  if (fd < 0) return ErrnoStatus(backing_template, "mkstemp", errno);
  m->backing_ = backing_template;
  if (ftruncate(fd, static_cast<off_t>(size_bytes)) != 0) {
    const int error = errno;
    close(fd);
    return ErrnoStatus(m->backing_, "ftruncate", error);
  }
  close(fd);

  std::string device = m->backing_;
  if (sector_size != 0) {
    ASSIGN_OR_RETURN(std::string loop,
                     Run({losetup, "-f", "--show", "--sector-size",
                          absl::StrCat(sector_size), m->backing_}));
    m->loop_device_ = std::string(absl::StripAsciiWhitespace(loop));
    device = m->loop_device_;
  }
  mkfs.push_back(device);
  RETURN_IF_ERROR(Run(mkfs).status());

  std::string mount_template = absl::StrCat(dir, "/loop_mount_mnt_XXXXXX");
  if (mkdtemp(mount_template.data()) == nullptr) {
    return ErrnoStatus(mount_template, "mkdtemp", errno);
  }
  m->mount_point_ = mount_template;
  if (sector_size != 0) {
    RETURN_IF_ERROR(Run({mount_tool, device, m->mount_point_}).status());
  } else {
    RETURN_IF_ERROR(
        Run({mount_tool, "-o", "loop", device, m->mount_point_}).status());
  }
  m->mounted_ = true;
  return m;
}

LoopMount::~LoopMount() {
  if (mounted_) {
    if (umount2(mount_point_.c_str(), 0) != 0) {
      // Busy (a test left a file open): detach now, finish when released.
      umount2(mount_point_.c_str(), MNT_DETACH);
    }
  }
  if (!loop_device_.empty()) {
    // On a busy device this only sets autoclear, which is what we want.
    const int fd = open(loop_device_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      ioctl(fd, LOOP_CLR_FD, 0);
      close(fd);
    }
  }
  if (!mount_point_.empty()) rmdir(mount_point_.c_str());
  if (!backing_.empty()) unlink(backing_.c_str());
}

}  // namespace imgtool::testing
