// Argument validation for decode (SPEC.md §5). Placeholder until the decode issue lands.
#include "backend.h"

namespace flashkda::detail {
void validate_decode(const DecodeParams&, Backend) {}
}  // namespace flashkda::detail
