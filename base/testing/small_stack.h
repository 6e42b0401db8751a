// Runs test code on a thread with a small stack, to show that it needs
// bounded stack: code whose stack use grows with its input (e.g. a chain of
// thousands of coroutine wakeups nested in each other) crashes the test
// with SIGSEGV there, even in optimised builds, where the default 8 MiB
// main stack would hide it until an ASan build or a bigger input.
#ifndef IMGTOOL_BASE_TESTING_SMALL_STACK_H_
#define IMGTOOL_BASE_TESTING_SMALL_STACK_H_

#include <cstddef>

#include "absl/functional/function_ref.h"

namespace imgtool::testing {

// Runs `fn` on a new thread whose stack is `stack_bytes` (at least
// PTHREAD_STACK_MIN, rounded up to pages by the system) and returns once it
// has finished. gtest assertions in `fn` work as on the main thread (a
// fatal one ends `fn` only). Aborts if the thread cannot be created.
void RunWithStack(size_t stack_bytes, absl::FunctionRef<void()> fn);

}  // namespace imgtool::testing

#endif  // IMGTOOL_BASE_TESTING_SMALL_STACK_H_
