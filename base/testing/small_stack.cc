#include "base/testing/small_stack.h"

#include <pthread.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace imgtool::testing {
namespace {

void* Trampoline(void* arg) {
  (*static_cast<absl::FunctionRef<void()>*>(arg))();
  return nullptr;
}

void Check(int err, const char* what) {
  if (err == 0) return;
  std::fprintf(stderr, "RunWithStack: %s: %s\n", what, std::strerror(err));
  std::abort();
}

}  // namespace

void RunWithStack(size_t stack_bytes, absl::FunctionRef<void()> fn) {
  pthread_attr_t attr;
  Check(pthread_attr_init(&attr), "pthread_attr_init");
  if (stack_bytes < PTHREAD_STACK_MIN) stack_bytes = PTHREAD_STACK_MIN;
  Check(pthread_attr_setstacksize(&attr, stack_bytes),
        "pthread_attr_setstacksize");
  pthread_t thread;
  Check(pthread_create(&thread, &attr, Trampoline, &fn), "pthread_create");
  pthread_attr_destroy(&attr);
  Check(pthread_join(thread, nullptr), "pthread_join");
}

}  // namespace imgtool::testing
