#include "imgtool/testing/command_runner.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "absl/strings/str_cat.h"

namespace imgtool::cli::testing {

std::string CommandResult::stderr_text() const {
  return status.ok() ? err : err + FormatError(status);
}

CommandResult RunCommand(CommandFn run, const std::vector<std::string>& args) {
  std::ostringstream out;
  std::ostringstream err;
  CommandResult result;
  result.status = run(args, Streams{out, err});
  result.out = out.str();
  result.err = err.str();
  return result;
}

std::string MakeTestDir() {
  static std::atomic<int> counter{0};
  const char* base = std::getenv("TEST_TMPDIR");
  const std::string dir =
      absl::StrCat(base != nullptr ? base : "/tmp", "/imgtool_test_",
                   getpid(), "_", counter++);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

void MakeSparseFile(const std::string& path, uint64_t size) {
  std::filesystem::remove(path);
  { std::ofstream create(path, std::ios::binary); }
  std::filesystem::resize_file(path, size);
}

void WriteBytes(const std::string& path, uint64_t offset, uint64_t length,
                uint8_t byte) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT, 0644);
  if (fd < 0) throw std::runtime_error("open " + path);
  const std::vector<uint8_t> data(length, byte);
  if (pwrite(fd, data.data(), data.size(), offset) !=
      static_cast<ssize_t>(data.size())) {
    close(fd);
    throw std::runtime_error("pwrite " + path);
  }
  close(fd);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

uint64_t FileSize(const std::string& path) {
  return std::filesystem::file_size(path);
}

uint64_t AllocatedBytes(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

}  // namespace imgtool::cli::testing
