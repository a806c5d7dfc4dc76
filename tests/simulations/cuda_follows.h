// A simulated federation with its clients on a GPU follows the same run on
// the CPU: the test loss per round within fp32's 1e-3 and bf16's 2e-2, and
// the report says where the sites trained (a cuda engine on a cuda device,
// in the precision asked), so a run that quietly fell back to the CPU fails.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "simulations/runner.h"

namespace estuary::simulations {

inline void ExpectCudaFollowsTheCpu(const Scenario& s, const std::string& label) {
  auto cpu = RunInproc(s, nullptr);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  for (const std::string precision : {"fp32", "bf16"}) {
    Scenario gpu = s;
    gpu.device = "cuda";
    gpu.precision = precision;
    auto run = RunInproc(gpu, nullptr);
    ASSERT_TRUE(run.ok()) << label << " " << precision << ": " << run.status().ToString();
    EXPECT_NE(run->trained_on.find("cuda::"), std::string::npos) << label << " " << precision << ": " << run->trained_on;
    EXPECT_NE(run->trained_on.find(precision == "fp32" ? " in f32" : " in bf16"), std::string::npos)
        << label << ": " << run->trained_on;
    if (s.recompute) {
      EXPECT_NE(run->trained_on.find("recompute"), std::string::npos) << label << ": " << run->trained_on;
    }
    ASSERT_EQ(run->rounds.size(), cpu->rounds.size());
    const double tolerance = precision == "fp32" ? 1e-3 : 2e-2;
    for (size_t r = 0; r < cpu->rounds.size(); ++r) {
      EXPECT_NEAR(run->rounds[r].test_loss, cpu->rounds[r].test_loss, tolerance * cpu->rounds[r].test_loss)
          << label << " " << precision << " round " << r + 1;
    }
  }
}

}  // namespace estuary::simulations
