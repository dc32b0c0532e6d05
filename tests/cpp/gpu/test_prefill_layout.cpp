// The chunk-record layout shared by K1 (writer) and K2 (wgmma descriptors), checked on the host:
// no GPU needed, so these run in CI wherever the CUDA backend is built.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda/sm90/prefill/config.h"
#include "cuda/sm90/prefill_v2/layout.h"

namespace flashkda::cuda::sm90::prefill {
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

// Both record layouts (precise and fast mode) satisfy the same contracts.
template <class Rec>
class PrefillRecordLayout : public ::testing::Test {};
using Layouts = ::testing::Types<PreciseRecord, FastRecord>;
struct LayoutName {
  template <class Rec>
  static std::string GetName(int) {
    return std::is_same_v<Rec, PreciseRecord> ? "Precise" : "Fast";
  }
};
TYPED_TEST_SUITE(PrefillRecordLayout, Layouts, LayoutName);

TYPED_TEST(PrefillRecordLayout, WoTileCoversEveryByteOnce) {
  using Rec = TypeParam;
  expect_bijection(Rec::kWoTileBytes, Rec::kWoOperands * kChunk, kHeadDim,
                   [](int n, int c) { return Rec::wo_offset(n / kChunk, n % kChunk, c); });
}

TEST(PrefillRecordLayoutKr, KrTileCoversEveryByteOnce) {
  expect_bijection(kTileBytes, kChunk, kHeadDim, [](int t, int c) { return kr_offset(t, c); });
}

// The wgmma canonical no-swizzle layouts (docs/notes/wgmma.md) with the descriptor strides K2
// uses: K-major B for the WO tile (n = 16 * which + t, k = channel), MN-major B for Kr
// (n = channel, k = token).
TYPED_TEST(PrefillRecordLayout, OffsetsMatchTheDescriptorStrides) {
  using Rec = TypeParam;
  for (int which = 0; which < Rec::kWoOperands; ++which)
    for (int t = 0; t < kChunk; ++t)
      for (int c = 0; c < kHeadDim; ++c) {
        const int n = kChunk * which + t, k = c;
        ASSERT_EQ(Rec::wo_offset(which, t, c),
                  16 * (n % 8) + 2 * (k % 8) + Rec::kWoSbo * (n / 8) + Rec::kWoLbo * (k / 8));
      }
  for (int t = 0; t < kChunk; ++t)
    for (int c = 0; c < kHeadDim; ++c) {
      const int n = c, k = t;
      ASSERT_EQ(kr_offset(t, c), 16 * (k % 8) + 2 * (n % 8) + kKrSbo * (n / 8) + kKrLbo * (k / 8));
    }
  // k-step s of the W/O products starts kWoStepBytes further on; the update's second half of
  // channels starts 8 core-matrix rows further on; LBO spans the tile's rows once.
  EXPECT_EQ(Rec::wo_offset(0, 0, 16), Rec::kWoStepBytes);
  EXPECT_EQ(Rec::kWoLbo, Rec::kWoOperands * kChunk * 16);
  EXPECT_EQ(kr_offset(0, 64), 8 * kKrSbo);
}

// K1's store_granules: a granule is 8 consecutive channels of one token (16 contiguous bytes), and
// the granule of token t + 1 (t even) follows that of token t, so a lane pair writes 32 bytes.
TYPED_TEST(PrefillRecordLayout, GranulesPairUpForK1Stores) {
  using Rec = TypeParam;
  for (int t = 0; t < kChunk; t += 2)
    for (int c = 0; c < kHeadDim; c += 8) {
      for (int which = 0; which < Rec::kWoOperands; ++which) {
        for (int i = 0; i < 8; ++i) ASSERT_EQ(Rec::wo_offset(which, t, c + i), Rec::wo_offset(which, t, c) + 2 * i);
        ASSERT_EQ(Rec::wo_offset(which, t + 1, c), Rec::wo_offset(which, t, c) + 16);
        ASSERT_EQ(Rec::wo_offset(which, t, c) % 32, 0);
        // K1 stores each operand at wo_offset(0, t, c) from the operand's base.
        ASSERT_EQ(Rec::wo_offset(which, t, c), Rec::wo_offset(which, 0, 0) + Rec::wo_offset(0, t, c));
      }
      for (int i = 0; i < 8; ++i) ASSERT_EQ(kr_offset(t, c + i), kr_offset(t, c) + 2 * i);
      ASSERT_EQ(kr_offset(t + 1, c), kr_offset(t, c) + 16);
      ASSERT_EQ(kr_offset(t, c) % 32, 0);
    }
}

// The parts of a record tile it exactly, in order, with the alignment their readers need
// (128 B for wgmma operands, 16 B for the 16-byte fragment loads).
TYPED_TEST(PrefillRecordLayout, PartsTileTheRecordAligned) {
  using Rec = TypeParam;
  constexpr bool kPrecise = std::is_same_v<Rec, PreciseRecord>;
  std::vector<std::pair<int, int>> parts = {{Rec::kOffWo, Rec::kWoTileBytes}, {Rec::kOffKRestored, kTileBytes}};
  if (kPrecise) parts.push_back({Rec::kOffKRestoredLo, kTileBytes});
  parts.push_back({Rec::kOffGamma, kGammaBytes});
  parts.push_back({Rec::kOffMqk, kSmallTileBytes});
  parts.push_back({Rec::kOffInvB, kSmallTileBytes});
  if (kPrecise) {
    parts.push_back({Rec::kOffMqkLo, kSmallTileBytes});
    parts.push_back({Rec::kOffInvBLo, kSmallTileBytes});
  }
  int end = 0;
  for (auto [off, bytes] : parts) {
    EXPECT_EQ(off, end);
    EXPECT_EQ(off % 16, 0) << off;
    end = off + bytes;
  }
  EXPECT_EQ(end, Rec::kBytes);
  for (int off : {Rec::kOffWo, Rec::kOffKRestored}) EXPECT_EQ(off % 128, 0) << off;
  if (kPrecise) EXPECT_EQ(Rec::kOffKRestoredLo % 128, 0);
  EXPECT_EQ(Rec::kBytes % 128, 0);
  EXPECT_LE(Rec::kBytes, kMaxRecordBytes);  // the workspace is sized for the larger record
}

// The precise record's offsets, pinned: the layout the GPU suites validate (a layout change moves this test with it).
TEST(PrefillRecordLayoutKr, PreciseRecordUnchanged) {
  EXPECT_EQ(PreciseRecord::kOffKRestored, 12288);
  EXPECT_EQ(PreciseRecord::kOffKRestoredLo, 16384);
  EXPECT_EQ(PreciseRecord::kOffGamma, 20480);
  EXPECT_EQ(PreciseRecord::kOffMqk, 20992);
  EXPECT_EQ(PreciseRecord::kOffInvB, 21504);
  EXPECT_EQ(PreciseRecord::kOffMqkLo, 22016);
  EXPECT_EQ(PreciseRecord::kOffInvBLo, 22528);
  EXPECT_EQ(PreciseRecord::kBytes, 23040);
  EXPECT_EQ(PreciseRecord::kWoLbo, 768);
}

// The fused kernel's rule (config.h fused_rule), host-callable, so its edges are checked in CI too
// (the GPU suite checks that the launcher follows it): 2/3 of the SMs busy over the longest
// sequence, and the longest sequence at least the floor (64 tokens, or the candidate's).
TEST(PrefillFusedRule, EdgesOfSmsAndFloor) {
  constexpr int64_t sms = 132, h_min = (2 * sms + 2) / 3;  // 88: the least H with 3 H >= 2 SMs
  const auto one = [&](int64_t H, int64_t T, int64_t floor = kFusedMinTokens) {
    return fused_rule(H, (T + kFusedChunk - 1) / kFusedChunk, T, sms, floor);
  };
  EXPECT_EQ(kFusedMinTokens, 64);
  EXPECT_TRUE(one(h_min, 64));
  EXPECT_FALSE(one(h_min - 1, 64));
  EXPECT_FALSE(one(h_min, 63));
  EXPECT_TRUE(one(h_min, 8192));
  EXPECT_FALSE(one(h_min, 256, 512));  // a raised floor (internal fused_min_tokens)
  EXPECT_TRUE(one(h_min, 32, 32));     // a lowered one
  EXPECT_FALSE(one(h_min, 32));
  // several sequences: the chunks of all against the longest's; a long prompt among short ones
  EXPECT_TRUE(fused_rule(16, 8 * 64, 2048, sms));                   // 8 x 2048 at H = 16
  EXPECT_FALSE(fused_rule(32, 64 + 30 * 2, 2048, sms));             // 2048 + 30 x 64 at H = 32
  EXPECT_TRUE(fused_rule(64, 64 + 30 * 2, 2048, sms));              // ... at H = 64
}

// The chained pieces' rule (config.h fused_chain_pieces), host-callable: only where the N H CTAs
// leave SMs idle, pieces of at least 64 chunks, and only where the wave model gains 15% (one
// sequence on 132 SMs: four pieces at H = 96 from T = 8192, three at H = 88, none at 112 or 128,
// none below T = 8192; two sequences at H = 48 as one at 96).
TEST(PrefillFusedRule, ChainedPieces) {
  constexpr int64_t sms = 132;
  const auto one = [&](int64_t H, int64_t T, int64_t N = 1) { return fused_chain_pieces(H, N, T / 32, sms); };
  EXPECT_EQ(one(96, 8192), 4);
  EXPECT_EQ(one(96, 32768), 4);
  EXPECT_EQ(one(96, 131072), 11);
  EXPECT_EQ(one(88, 8192), 3);
  EXPECT_EQ(one(48, 8192, 2), 4);
  EXPECT_EQ(one(96, 4096), 1);  // pieces of 32 chunks: shorter than kMinChainPieceChunks
  EXPECT_EQ(one(96, 2048), 1);
  EXPECT_EQ(one(112, 8192), 1);  // no count gains 15%
  EXPECT_EQ(one(128, 8192), 1);
  EXPECT_EQ(one(132, 8192), 1);  // no idle SM
  EXPECT_EQ(one(12, 8192, 11), 1);
  for (int64_t H = 1; H < sms; ++H)  // never more pieces than the cap, never pieces shorter than the floor
    for (int64_t T : {int64_t(2048), int64_t(8192), int64_t(65536), int64_t(1) << 20}) {
      const int64_t P = one(H, T);
      EXPECT_GE(P, 1);
      EXPECT_LE(P, kMaxChainPieces);
      if (P > 1) EXPECT_GE((T / 32 + P - 1) / P, kMinChainPieceChunks) << "H " << H << " T " << T;
    }
}

// The few-head pieces' rule (config.h fused_few_head_pieces): one wave, #SMs / (N H) pieces a sequence
// (11 at H = 12, 8 at H = 16, 4 at H = 32 on 132 SMs), none where N H fills the SMs, and none shorter
// than kMinFewPieceChunks chunks.
TEST(PrefillFusedRule, FewHeadPieces) {
  constexpr int64_t sms = 132;
  const auto one = [&](int64_t H, int64_t T, int64_t N = 1) { return fused_few_head_pieces(H, N, T / 32, sms); };
  EXPECT_EQ(one(12, 8192), 11);
  EXPECT_EQ(one(12, 131072), 11);
  EXPECT_EQ(one(16, 65536), 8);
  EXPECT_EQ(one(32, 32768), 4);
  EXPECT_EQ(one(12, 2048), 11);  // 64 chunks: pieces of 5-6
  EXPECT_EQ(one(12, 512), 4);    // 16 chunks: four pieces of kMinFewPieceChunks
  EXPECT_EQ(one(12, 128), 1);    // 4 chunks: no two pieces of four
  EXPECT_EQ(one(16, 2048, 8), 1);  // 8 x 2048 at H = 16: 128 CTAs, no second piece fits
  EXPECT_EQ(one(24, 2048, 4), 1);
  EXPECT_EQ(one(12, 8192, 2), 5);
  EXPECT_EQ(one(132, 8192), 1);
  EXPECT_EQ(one(66, 8192), 2);
  for (int64_t H = 1; H < 2 * sms; ++H)  // one wave, never pieces shorter than the floor
    for (int64_t T : {int64_t(64), int64_t(2048), int64_t(8192), int64_t(1) << 20}) {
      const int64_t P = one(H, T);
      EXPECT_GE(P, 1);
      EXPECT_LE(P * H, std::max<int64_t>(sms, H)) << "H " << H << " T " << T;
      if (P > 1) EXPECT_GE(T / 32 / P, kMinFewPieceChunks) << "H " << H << " T " << T;
    }
}

// Prefill v2's SW128 bf16 tile (sw128_offset, in bit operations) against its definition, and a
// consumer thread's slots in the fused kernel's staged v (sw128_slot_offset): each slot at the
// thread's slot 0 plus the slot's constant, for every thread (warpgroup 1 or 2, warp w, lane 4 g + t4).
TEST(PrefillV2Layout, Sw128TileAndSlotOffsets) {
  using prefill_v2::sw128_offset;
  using prefill_v2::sw128_slot_offset;
  for (const int rows : {32, 64})
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < kHeadDim; ++c)
        ASSERT_EQ(sw128_offset(rows, r, c), (c / 64) * rows * 128 + r * 128 + (((c % 64) / 8) ^ (r % 8)) * 16 + (c % 8) * 2);
  for (int wg = 1; wg <= 2; ++wg)
    for (int w = 0; w < 4; ++w)
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane >> 2, t4 = lane & 3, v_row = 64 * (wg - 1) + 16 * w + g;
        for (int i = 0; i < 16; ++i)
          ASSERT_EQ(sw128_offset(32, 2 * t4, v_row) + sw128_slot_offset(i),
                    sw128_offset(32, 8 * (i >> 2) + 2 * t4 + (i & 1), v_row + 8 * ((i >> 1) & 1)))
              << "warpgroup " << wg << " warp " << w << " lane " << lane << " slot " << i;
      }
}

// Prefill v2's fp32 (tf32) SW128 tiles, the L / Mqk product's operands: every element on its own
// 4 bytes, the tile covered once, a thread's 4 channels from a multiple of 4 one 16-byte granule,
// and the atom in bytes the bf16 tiles' one (granule position g ^ (r % 8) in a 128-byte row), so
// the same descriptors (SBO 1024) and 32-byte k-steps read them.
TEST(PrefillV2Layout, F32Sw128TileCoversEveryByteOnce) {
  using prefill_v2::sw128_offset;
  using prefill_v2::sw128_offset_f32;
  for (const int rows : {32, 64}) {
    std::vector<int> hits(rows * kHeadDim * 4, 0);
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < kHeadDim; ++c) {
        const int o = sw128_offset_f32(rows, r, c);
        ASSERT_GE(o, 0);
        ASSERT_LT(o + 3, int(hits.size()));
        ASSERT_EQ(o % 4, 0);
        for (int b = 0; b < 4; ++b) ++hits[o + b];
        if (c % 4 == 0) {
          ASSERT_EQ(o % 16, 0);
          for (int e = 1; e < 4; ++e) ASSERT_EQ(sw128_offset_f32(rows, r, c + e), o + 4 * e);
        }
        // byte for byte the bf16 tile's swizzle: block of 128 bytes a row, granule g ^ (r % 8)
        const int block = c / 32, g = (c % 32) / 4;
        ASSERT_EQ(o, block * rows * 128 + sw128_offset(rows, r, 8 * g) + (c % 4) * 4);
      }
    for (size_t b = 0; b < hits.size(); ++b) ASSERT_EQ(hits[b], 1) << "byte " << b;
    // the k-steps of 8 channels that l_mqk_product's descriptors start at (row 0: no swizzle)
    for (int s = 0; s < kHeadDim / 8; ++s) ASSERT_EQ(sw128_offset_f32(rows, 0, 8 * s), (s / 4) * rows * 128 + (s % 4) * 32);
  }
  static_assert(prefill_v2::ProduceScratch::kOffB - prefill_v2::ProduceScratch::kOffA == 64 * kHeadDim * 4);
  static_assert(prefill_v2::ProduceScratch::kOffL - prefill_v2::ProduceScratch::kOffB == 32 * kHeadDim * 4);
}

// The fused kernel's pieces (prefill_v2 piece_span, FusedArgs::pieces): for lengths about the chunk
// edges and piece counts beyond the chunks, every chunk of the sequence is some piece's own exactly
// once and in order; a piece's warm-up never starts before the sequence, is the asked one where it
// fits, and its tokens run from its first warm-up chunk to its end (the last one partial); exactly one
// piece writes the final state (an empty sequence's first); pieces without chunks leave (T = -1).
TEST(PrefillV2Pieces, SpansCoverTheSequenceOnce) {
  using prefill_v2::piece_span;
  for (const int64_t len : {int64_t(0), int64_t(1), int64_t(31), int64_t(32), int64_t(33), int64_t(96), int64_t(301),
                            int64_t(1000), int64_t(8192), int64_t(8193)})
    for (const int64_t pieces : {int64_t(1), int64_t(2), int64_t(3), int64_t(4), int64_t(11), int64_t(40)})
      for (const int64_t warmup : {int64_t(1), int64_t(2), int64_t(5)}) {
        SCOPED_TRACE("len " + std::to_string(len) + " pieces " + std::to_string(pieces) + " warmup " +
                     std::to_string(warmup));
        const int64_t chunks = (len + 31) / 32;
        int64_t next = 0, lasts = 0;
        for (int64_t p = 0; p < pieces; ++p) {
          const prefill_v2::PieceSpan s = piece_span(len, pieces, warmup, p);
          lasts += s.last;
          if (s.begin >= chunks) {
            EXPECT_EQ(s.T, chunks == 0 && p == 0 ? 0 : -1);
            EXPECT_EQ(s.shift, 0);
            continue;
          }
          EXPECT_EQ(s.begin, next) << "piece " << p;
          EXPECT_GT(s.end, s.begin);
          next = s.end;
          EXPECT_EQ(s.warmup, std::min(warmup, s.begin));
          EXPECT_EQ(s.shift, (s.begin - s.warmup) * 32);
          EXPECT_EQ(s.shift + s.T, std::min(s.end * 32, len)) << "piece " << p << " ends elsewhere";
          EXPECT_EQ(s.last, s.end == chunks);
        }
        EXPECT_EQ(next, chunks) << "the pieces do not reach the sequence's end";
        EXPECT_EQ(lasts, 1) << "not exactly one piece writes the final state";
      }
}

}  // namespace
}  // namespace flashkda::cuda::sm90::prefill
