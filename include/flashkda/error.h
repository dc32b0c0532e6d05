// flashkda error facility: one typed exception, one check macro, used by every backend.
// Library code never exits or aborts on bad input; it throws flashkda::Error with a message
// that names the argument and what was expected.
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace flashkda {

enum class ErrorCode : int {
  kInvalidArgument = 1,  // bad shape, dtype, value or pointer from the caller (Python: ValueError)
  kUnsupported = 2,      // valid request this build or device cannot serve (Python: NotImplementedError)
  kCuda = 3,             // a CUDA runtime call or a launch failed (Python: RuntimeError)
  kInternal = 4,         // a broken invariant inside the library (Python: RuntimeError)
};

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

namespace detail {
// Builds error messages without iostreams: a locale-free path that cannot fault even when the
// host process has set up C++ locales in an unusual way (seen: an ostringstream crashing inside a
// Python extension next to PyTorch's runtime).
inline void append(std::string& s, const std::string& x) { s += x; }
inline void append(std::string& s, const char* x) { s += (x != nullptr ? x : "(null)"); }
template <size_t N>
inline void append(std::string& s, const char (&x)[N]) { s += x; }
inline void append(std::string& s, char x) { s += x; }
inline void append(std::string& s, bool x) { s += x ? "true" : "false"; }
template <typename T>
inline void append(std::string& s, const T& x) {
  if constexpr (std::is_integral_v<T>) {
    s += std::to_string(x);
  } else if constexpr (std::is_floating_point_v<T>) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", double(x));
    s += buf;
  } else if constexpr (std::is_enum_v<T>) {
    s += std::to_string(static_cast<long long>(x));
  } else {
    static_assert(std::is_pointer_v<T>, "make_message: unsupported argument type");
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%p", static_cast<const void*>(x));
    s += buf;
  }
}

// Concatenates any number of values into one message: make_message("T=", t, " must be >= 0").
template <typename... Args>
std::string make_message(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}
}  // namespace detail

}  // namespace flashkda

// FLASHKDA_CHECK(cond, code, parts...): throw flashkda::Error(code, concat(parts)) unless cond.
#define FLASHKDA_CHECK(cond, code, ...)                                                 \
  do {                                                                                   \
    if (!(cond)) throw ::flashkda::Error((code), ::flashkda::detail::make_message(__VA_ARGS__)); \
  } while (0)

// Argument check: the message names the argument and what was expected.
#define FLASHKDA_CHECK_ARG(cond, ...) FLASHKDA_CHECK(cond, ::flashkda::ErrorCode::kInvalidArgument, __VA_ARGS__)
