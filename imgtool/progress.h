// The progress line of the imgtool commands: block/progress.h's Progress
// (it moved there beside the copy engine), under its old name.
#ifndef IMGTOOL_IMGTOOL_PROGRESS_H_
#define IMGTOOL_IMGTOOL_PROGRESS_H_

#include "block/progress.h"

namespace imgtool::cli {

using Progress = block::Progress;

}  // namespace imgtool::cli

#endif  // IMGTOOL_IMGTOOL_PROGRESS_H_
