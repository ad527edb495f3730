// A kernel's published verification (<entry>_verified, _verified_on; kernels/verified_devices.h):
// read like every published u32, said per kernel for `metrale info`, and the rule the automatic
// choices follow (core/published.h).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/published.h"
#include "kernels/verified_devices.h"

namespace metrale {
namespace {

// A symbol table of 4-byte little-endian values (the layout every backend's reader hands over).
SymbolReader table(const std::map<std::string, std::uint32_t>& values) {
  return [values](const std::string& name) -> std::optional<std::vector<std::byte>> {
    const auto it = values.find(name);
    if (it == values.end()) return std::nullopt;
    std::vector<std::byte> bytes(sizeof(std::uint32_t));
    std::memcpy(bytes.data(), &it->second, bytes.size());
    return bytes;
  };
}

TEST(PublishedVerification, ADeviceRunIsSaidWithItsGpuAndDate) {
  const KernelMeta m = read_published(
      "w4a16::gemm_tiled", "gemm_tiled",
      table({{"gemm_tiled_verified", 20261129}, {"gemm_tiled_verified_on", verified::kH200}}));
  EXPECT_EQ(m.verified, 20261129u);
  EXPECT_EQ(m.verified_on, verified::kH200);
  EXPECT_TRUE(automatic_choice_allowed(m));
  EXPECT_EQ(verification_text(m), "verified on NVIDIA H200, 2026-11-29");
}

TEST(PublishedVerification, NothingPublishedIsNotYetRunAndNeverAnAutomaticChoice) {
  const KernelMeta m =
      read_published("w4a16::gemm_fused", "gemm_fused", table({{"gemm_fused_n_tile", 128}}));
  EXPECT_EQ(m.verified_on, verified::kNone);
  EXPECT_FALSE(automatic_choice_allowed(m));
  EXPECT_EQ(verification_text(m), "not yet run on a GPU");
}

TEST(PublishedVerification, TheHostReferenceAndPlaceholdersAreSaidAsSuch) {
  KernelMeta host;
  host.verified_on = verified::kHostReference;
  EXPECT_TRUE(automatic_choice_allowed(host));
  EXPECT_EQ(verification_text(host), "the host reference");
  // A placeholder is never chosen, even where something says it was verified.
  const KernelMeta absent = read_published(
      "w4a16::gemm_fused", "gemm_fused",
      table({{"gemm_fused_absent", 1}, {"gemm_fused_verified_on", verified::kH200}}));
  EXPECT_TRUE(absent.absent);
  EXPECT_FALSE(automatic_choice_allowed(absent));
  EXPECT_EQ(verification_text(absent), "not on this target");
}

TEST(PublishedVerification, AnUnknownDeviceOrABadDateIsSaidNotGuessed) {
  KernelMeta m;
  m.verified_on = 99;
  m.verified = 20261129;
  EXPECT_EQ(verification_text(m), "verified on device 99, 2026-11-29");
  m.verified_on = verified::kH200;
  m.verified = 0;
  EXPECT_EQ(verification_text(m), "verified on NVIDIA H200, date 0 unreadable");
}

}  // namespace
}  // namespace metrale
