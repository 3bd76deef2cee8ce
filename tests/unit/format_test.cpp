#include <gtest/gtest.h>

#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"

using reservoir::format_size;
using reservoir::parse_size;

TEST(Format, SizesAsPyTorchPrintsThem) {
  EXPECT_EQ(format_size(0), "0 bytes");
  EXPECT_EQ(format_size(1024), "1024 bytes");
  EXPECT_EQ(format_size(1025), "1.00 KiB");
  EXPECT_EQ(format_size(1536), "1.50 KiB");
  EXPECT_EQ(format_size(1048576), "1024.00 KiB");
  EXPECT_EQ(format_size(20971520), "20.00 MiB");
  EXPECT_EQ(format_size(1073741824), "1024.00 MiB");
  EXPECT_EQ(format_size(1073741825), "1.00 GiB");
  EXPECT_EQ(format_size(85899345920), "80.00 GiB");
}

TEST(Format, ParsesSizesWithUnits) {
  EXPECT_EQ(parse_size("512"), 512u);
  EXPECT_EQ(parse_size("4KiB"), 4096u);
  EXPECT_EQ(parse_size("1.5MiB"), 1572864u);
  EXPECT_EQ(parse_size("24GiB"), 24ull << 30);
  EXPECT_EQ(parse_size("2gb"), 2ull << 30);
  EXPECT_THROW(parse_size("abc"), reservoir::UsageError);
  EXPECT_THROW(parse_size("."), reservoir::UsageError);
  EXPECT_THROW(parse_size("12XB"), reservoir::UsageError);
}
