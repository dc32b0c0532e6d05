// The chunk-record layout shared by K1 (writer) and K2 (wgmma descriptors), checked on the host:
// no GPU needed, so these run in CI wherever the CUDA backend is built.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

#include "cuda/sm90/prefill/config.h"

namespace flashkda::sm90::prefill {
namespace {

// Every bf16 element of a tile lands on its own 2 bytes and the tile is covered exactly once.
template <class Offset>
void expect_bijection(int tile_bytes, int rows, int cols, Offset off) {
  std::vector<int> hits(tile_bytes, 0);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      const int o = off(r, c);
      ASSERT_GE(o, 0);
      ASSERT_LT(o + 1, tile_bytes);
      ASSERT_EQ(o % 2, 0);
      ++hits[o], ++hits[o + 1];
    }
  for (int b = 0; b < tile_bytes; ++b) ASSERT_EQ(hits[b], 1) << "byte " << b;
}

TEST(PrefillRecordLayout, WoTileCoversEveryByteOnce) {
  expect_bijection(kWoTileBytes, 3 * kChunk, kHeadDim,
                   [](int n, int c) { return wo_offset(n / kChunk, n % kChunk, c); });
}

TEST(PrefillRecordLayout, KrTileCoversEveryByteOnce) {
  expect_bijection(kTileBytes, kChunk, kHeadDim, [](int t, int c) { return kr_offset(t, c); });
}

// The wgmma canonical no-swizzle layouts (docs/notes/wgmma.md) with the descriptor strides K2
// uses: K-major B for the WO tile (n = 16 * which + t, k = channel), MN-major B for Kr
// (n = channel, k = token).
TEST(PrefillRecordLayout, OffsetsMatchTheDescriptorStrides) {
  for (int which = 0; which < 3; ++which)
    for (int t = 0; t < kChunk; ++t)
      for (int c = 0; c < kHeadDim; ++c) {
        const int n = kChunk * which + t, k = c;
        ASSERT_EQ(wo_offset(which, t, c), 16 * (n % 8) + 2 * (k % 8) + kWoSbo * (n / 8) + kWoLbo * (k / 8));
      }
  for (int t = 0; t < kChunk; ++t)
    for (int c = 0; c < kHeadDim; ++c) {
      const int n = c, k = t;
      ASSERT_EQ(kr_offset(t, c), 16 * (k % 8) + 2 * (n % 8) + kKrSbo * (n / 8) + kKrLbo * (k / 8));
    }
  // k-step s of the W/O products starts kWoStepBytes further on; the update's second half of
  // channels starts 8 core-matrix rows further on.
  EXPECT_EQ(wo_offset(0, 0, 16), kWoStepBytes);
  EXPECT_EQ(kr_offset(0, 64), 8 * kKrSbo);
}

// K1's store_granules: a granule is 8 consecutive channels of one token (16 contiguous bytes), and
// the granule of token t + 1 (t even) follows that of token t, so a lane pair writes 32 bytes.
TEST(PrefillRecordLayout, GranulesPairUpForK1Stores) {
  for (int t = 0; t < kChunk; t += 2)
    for (int c = 0; c < kHeadDim; c += 8) {
      for (int which = 0; which < 3; ++which) {
        for (int i = 0; i < 8; ++i) ASSERT_EQ(wo_offset(which, t, c + i), wo_offset(which, t, c) + 2 * i);
        ASSERT_EQ(wo_offset(which, t + 1, c), wo_offset(which, t, c) + 16);
        ASSERT_EQ(wo_offset(which, t, c) % 32, 0);
        // K1 stores q_decayed and its remainder at wo_offset(0, t, c) from the operand's base.
        ASSERT_EQ(wo_offset(which, t, c), wo_offset(which, 0, 0) + wo_offset(0, t, c));
      }
      for (int i = 0; i < 8; ++i) ASSERT_EQ(kr_offset(t, c + i), kr_offset(t, c) + 2 * i);
      ASSERT_EQ(kr_offset(t + 1, c), kr_offset(t, c) + 16);
      ASSERT_EQ(kr_offset(t, c) % 32, 0);
    }
}

TEST(PrefillRecordLayout, RecordOffsetsAreAligned) {
  for (int off : {kOffWo, kOffKRestored, kOffKRestoredLo}) EXPECT_EQ(off % 128, 0) << off;
  for (int off : {kOffGamma, kOffMqk, kOffInvB, kOffMqkLo, kOffInvBLo}) EXPECT_EQ(off % 16, 0) << off;
  EXPECT_EQ(kOffInvBLo + kSmallTileBytes, kChunkRecordBytes);
  EXPECT_EQ(kChunkRecordBytes % 128, 0);
}

}  // namespace
}  // namespace flashkda::sm90::prefill
