// flashkda error facility: one typed exception, one check macro, used by every backend.
// Library code never exits or aborts on bad input; it throws flashkda::Error with a message
// that names the argument and what was expected.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace flashkda {

enum class ErrorCode : int {
  kInvalidArgument = 1,  // bad shape, dtype, value or pointer from the caller (Python: ValueError)
  kUnsupported = 2,      // valid request this build or device cannot serve (Python: RuntimeError)
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
// Streams any number of values into one message: make_message("T=", t, " must be >= 0").
template <typename... Args>
std::string make_message(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
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
