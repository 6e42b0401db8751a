// Test helper: creates one image with CreateFile so that a test can run it
// under strace and count its syscalls.
// Usage: create_helper <path> <size> [preallocation] [extent_size_hint]
// Warnings go to stderr; exit status 1 with the error on failure.
#include <cstdint>
#include <iostream>
#include <string>

#include "absl/strings/numbers.h"
#include "posix_file/file_node.h"
#include "posix_file/file_options.pb.h"

int main(int argc, char** argv) {
  uint64_t size = 0;
  if (argc < 3 || !absl::SimpleAtoi(argv[2], &size)) {
    std::cerr << "usage: create_helper <path> <size> [preallocation] "
                 "[extent_size_hint]\n";
    return 2;
  }
  imgtool::posix_file::FileCreateOptions options;
  options.set_size(size);
  if (argc > 3) options.set_preallocation(argv[3]);
  uint64_t hint = 0;
  if (argc > 4) {
    if (!absl::SimpleAtoi(argv[4], &hint)) return 2;
    options.set_extent_size_hint(hint);
  }
  absl::Status st = imgtool::posix_file::CreateFile(argv[1], options, &std::cerr);
  if (!st.ok()) {
    std::cerr << "create_helper: " << st.message() << "\n";
    return 1;
  }
  return 0;
}
