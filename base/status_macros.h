// Status propagation macros used by every package.
//
//   RETURN_IF_ERROR(expr);            // expr is an absl::Status
//   ASSIGN_OR_RETURN(T v, expr);      // expr is an absl::StatusOr<T>
//   CO_RETURN_IF_ERROR / CO_ASSIGN_OR_RETURN: the same inside a coroutine,
//   where `return` does not compile.
#ifndef IMGTOOL_BASE_STATUS_MACROS_H_
#define IMGTOOL_BASE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define IMGTOOL_CONCAT_INNER_(a, b) a##b
#define IMGTOOL_CONCAT_(a, b) IMGTOOL_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)                          \
  do {                                                 \
    if (absl::Status _st = (expr); !_st.ok()) return _st; \
  } while (0)

#define CO_RETURN_IF_ERROR(expr)                          \
  do {                                                    \
    if (absl::Status _st = (expr); !_st.ok()) co_return _st; \
  } while (0)

#define IMGTOOL_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr, ret) \
  auto tmp = (expr);                                        \
  if (!tmp.ok()) ret std::move(tmp).status();               \
  lhs = std::move(tmp).value()

#define ASSIGN_OR_RETURN(lhs, expr) \
  IMGTOOL_ASSIGN_OR_RETURN_IMPL_(IMGTOOL_CONCAT_(_statusor_, __LINE__), lhs, expr, return)

#define CO_ASSIGN_OR_RETURN(lhs, expr) \
  IMGTOOL_ASSIGN_OR_RETURN_IMPL_(IMGTOOL_CONCAT_(_statusor_, __LINE__), lhs, expr, co_return)

#endif  // IMGTOOL_BASE_STATUS_MACROS_H_
