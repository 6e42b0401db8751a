// qemu-io 7.2's extended command help texts (`help CMD`).
#ifndef IMGTOOL_IMGTOOL_IO_HELP_H_
#define IMGTOOL_IMGTOOL_IO_HELP_H_

#include "absl/strings/string_view.h"

namespace imgtool::cli {

// What qemu-io 7.2 prints for `help NAME` after the command's one-line
// summary, byte for byte (it starts with a newline); empty for commands that
// have none (abort, close, flush, ...). NAME is the command's full name, not
// an alias. The texts were captured from the qemu-io 7.2 binary's output.
absl::string_view QemuIoCommandHelp(absl::string_view name);

}  // namespace imgtool::cli

#endif  // IMGTOOL_IMGTOOL_IO_HELP_H_
