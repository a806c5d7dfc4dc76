// The includes of the source tree against the design's folder graph
// (tests/architecture/layering.h). The build already refuses an include
// whose library is not linked; this also catches a link added against the
// design, and keeps docs/ARCHITECTURE.md's picture of the graph true.
#include "tests/architecture/layering.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

namespace estuary::architecture {
namespace {

TEST(Layering, TheDesignGraphHasNoCycle) {
  for (const auto& [folder, arrows] : DesignGraph()) {
    EXPECT_FALSE(Reachable(DesignGraph(), folder).contains(folder)) << folder << " reaches itself";
    for (const std::string& to : arrows) EXPECT_TRUE(DesignGraph().contains(to)) << folder << " -> " << to;
  }
}

TEST(Layering, EveryIncludeFollowsAnArrowOfTheDesign) {
  const std::vector<Include> includes = ScanIncludes(ESTUARY_SOURCE_DIR);
  // A scan that finds nothing would pass anything.
  ASSERT_GT(includes.size(), 300u);
  for (const std::string& violation : Violations(includes, DesignGraph())) ADD_FAILURE() << violation;
}

TEST(Layering, AnIncludeAgainstAnArrowIsNamedWithItsPlace) {
  const std::vector<Include> includes = {
      {"models/llama.cc", 12, "server/store.h"},      // a model that knows the server
      {"proto/wire.h", 9, "models/tensor.h"},         // the wire above the models
      {"client/agent.cc", 3, "server/session.h"},     // the two ends of a connection
      {"server/store.cc", 4, "simulations/report.h"},  // nothing depends on simulations
      {"client/site.cc", 7, "comm/communicator.h"},   // allowed: client -> parallel -> comm
      {"server/main.cc", 5, "models/model.h"},         // allowed: server -> aggregation -> models
  };
  const std::vector<std::string> found = Violations(includes, DesignGraph());
  ASSERT_EQ(found.size(), 4u);
  EXPECT_EQ(found[0], "models/llama.cc:12 includes server/store.h: models may not depend on server");
  EXPECT_EQ(found[1], "proto/wire.h:9 includes models/tensor.h: proto may not depend on models");
  EXPECT_EQ(found[2], "client/agent.cc:3 includes server/session.h: client may not depend on server");
  EXPECT_EQ(found[3], "server/store.cc:4 includes simulations/report.h: server may not depend on simulations");
}

TEST(Layering, TheArchitecturePageShowsTheGraph) {
  std::ifstream in(std::string(ESTUARY_SOURCE_DIR) + "/docs/ARCHITECTURE.md");
  ASSERT_TRUE(in) << "docs/ARCHITECTURE.md is missing";
  std::stringstream page;
  page << in.rdbuf();
  const std::string graph = RenderMermaid(DesignGraph());
  EXPECT_NE(page.str().find(graph), std::string::npos)
      << "docs/ARCHITECTURE.md should show the folder graph as:\n" << graph;
}

}  // namespace
}  // namespace estuary::architecture
