// CPU decode step (SPEC.md §5). Placeholder until the decode issue lands.
#include "backend.h"

namespace flashkda::cpu {
void decode(const DecodeParams&) {
  throw Error(ErrorCode::kUnsupported, "decode: the CPU decode backend is not built yet");
}
}  // namespace flashkda::cpu
