// RMM's logging_resource_adaptor CSV log: allocations, frees, failures and
// streams; errors that name the line.
#include <gtest/gtest.h>
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "error_text.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/history.hpp"
#include "reservoir/sim_device.hpp"
#include "reservoir/trace.hpp"
#include "shared_traces.hpp"
#include "trace_fixture.hpp"

namespace reservoir {
namespace {

TEST(RmmCsv, ReadsAllocationsFreesFailuresAndStreams) {
  const Trace t = read_rmm_csv(
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "140573312345856,10:30:45.123456,allocate,0x7f8a40000000,1024,0x0\n"
      "140573312345856,10:30:45.234567,allocate,0x7f8a40000400,2048,0x7f8a38001020\r\n"
      "140573312345857,10:30:45.300000,allocate failure,0x0,4294967296,0x7f8a38001020\n"
      "\n"
      "140573312345856,1634567890.5,free,0x7f8a40000000,1024,0x0\n"
      "140573312345856,10:30:46.000001,deallocate,0x7f8a40000400,2048,0x7f8a38001020\n"
      "140573312345856,10:30:46.000002,free,0x7f0000000000,4096,0x7f8a38001090\n",
      "log.csv");
  EXPECT_EQ(t.format, "rmm-csv");
  EXPECT_FALSE(t.has_addresses);
  const std::vector<TraceEvent> want = {
      {TraceAction::alloc, 0x7f8a40000000, 1024, 0, 37845123456, 0},
      {TraceAction::alloc, 0x7f8a40000400, 2048, 1, 37845234567, 0},
      {TraceAction::oom, 0, 4294967296, 1, 37845300000, 0},
      {TraceAction::free_requested, 0x7f8a40000000, 1024, 0, 1634567890500000, 0},
      {TraceAction::free_requested, 0x7f8a40000400, 2048, 1, 37846000001, 0},
      {TraceAction::free_requested, 0x7f0000000000, 4096, 2, 37846000002, 0},
  };
  EXPECT_EQ(t.events, want);
  // The block freed but never allocated in the log was live at the start.
  const ReplayProgram p = compile(t);
  ASSERT_EQ(p.initial.size(), 1u);
  EXPECT_EQ(p.initial[0].size, 4096u);
  const ReplayResult r = replay(p, AllocatorConfig{}, "");
  EXPECT_EQ(r.peak_requested_bytes, 4096u + 1024 + 2048);
}

TEST(RmmCsv, ErrorsNameTheLine) {
  auto read = [](const std::string& body) {
    return error_of([&] {
      (void)read_rmm_csv("Thread,Time,Action,Pointer,Size,Stream\n" + body, "log.csv");
    });
  };
  EXPECT_EQ(error_of([] { (void)read_rmm_csv("", "log.csv"); }),
            "RMM log log.csv: line 1: empty log: expected the header "
            "'Thread,Time,Action,Pointer,Size,Stream'");
  EXPECT_EQ(error_of([] { (void)read_rmm_csv("Thread,Time,Action\n", "log.csv"); }),
            "RMM log log.csv: line 1: expected the header "
            "'Thread,Time,Action,Pointer,Size,Stream', found 'Thread,Time,Action'");
  EXPECT_EQ(read("1,10:00:00.0,allocate,0x10,5\n"),
            "RMM log log.csv: line 2: expected 6 fields (Thread,Time,Action,Pointer,Size,Stream), "
            "found 5");
  EXPECT_EQ(read("1,10:00:00.0,allocate,0x1g,5,0\n"),
            "RMM log log.csv: line 2: Pointer '0x1g' is not an unsigned hexadecimal number");
  EXPECT_EQ(read("1,10:00:00.0,allocate,0x10,-5,0\n"),
            "RMM log log.csv: line 2: Size '-5' is not an unsigned decimal number");
  EXPECT_EQ(read("1,yesterday,allocate,0x10,5,0\n"),
            "RMM log log.csv: line 2: Time 'yesterday' is neither HH:MM:SS.ffffff nor seconds "
            "since the epoch");
  EXPECT_EQ(read("1,1.0,reallocate,0x10,5,0\n"),
            "RMM log log.csv: line 2: unknown Action 'reallocate' (accepted: allocate, free, "
            "deallocate, allocate failure)");
  EXPECT_EQ(read("1,1.0,allocate,0x10,5,0\n1,1.0,allocate,0x10,7,0\n"),
            "RMM log log.csv: line 3: Pointer 0x10 is allocated again while live (allocated on "
            "line 2)");
  EXPECT_EQ(read("1,1.0,allocate,0x10,5,0\n1,1.0,free,0x10,7,0\n"),
            "RMM log log.csv: line 3: Pointer 0x10 is freed with Size 7 but was allocated with 5 "
            "(line 2)");
  EXPECT_EQ(read("1,1.0,free,0x10,7,0\n1,1.0,free,0x10,7,0\n"),
            "RMM log log.csv: line 3: Pointer 0x10 is freed twice");
  EXPECT_EQ(read("1,1.0,allocate,0x0,7,0\n"),
            "RMM log log.csv: line 2: allocate returned a null Pointer");
  EXPECT_EQ(read(std::string("1,1.0,allocate,0x10,7,0\0\n", 24)),
            "RMM log log.csv: line 2: contains a NUL byte");
}

}  // namespace
}  // namespace reservoir
