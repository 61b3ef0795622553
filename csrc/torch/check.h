// Argument checks that raise Python ValueError / TypeError / RuntimeError through torch's
// exception translation, like TORCH_CHECK_VALUE and friends, but without capturing a C++
// backtrace: TORCH_CHECK walks the whole native stack when it builds the error, and on some
// toolchains (seen on the GPU machine) that walk crashes the process instead of raising.
// Our messages already name the argument, so the backtrace adds nothing for users.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#define GQA_RAISE(error_type, ...) throw ::c10::error_type(::c10::str(__VA_ARGS__), {}, nullptr)

#define GQA_CHECK_VALUE(cond, ...) \
  do {                             \
    if (!(cond)) GQA_RAISE(ValueError, __VA_ARGS__); \
  } while (0)

#define GQA_CHECK_TYPE(cond, ...) \
  do {                            \
    if (!(cond)) GQA_RAISE(TypeError, __VA_ARGS__); \
  } while (0)

#define GQA_CHECK(cond, ...) \
  do {                       \
    if (!(cond)) GQA_RAISE(Error, __VA_ARGS__); \
  } while (0)
