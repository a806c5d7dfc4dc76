// The folder graph Estuary is built within, and a checker of the includes
// against it. A folder is one layer (one or two CMake libraries); an arrow
// a -> b lets a's files include b's headers and, through b, whatever b may.
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

namespace estuary::architecture {

// The design's arrows, each folder to the folders it may include directly.
// Everything the arrows reach transitively is allowed too.
const std::map<std::string, std::set<std::string>>& DesignGraph();

struct Include {
  std::string file;    // the including file: "client/agent.cc"
  int line = 0;
  std::string header;  // what it includes: "proto/frame.h"
};

// Every `#include "folder/..."` of the source folders under `root` that
// names another source folder.
std::vector<Include> ScanIncludes(const std::string& root);

// One line per include the graph forbids: "models/llama.cc:12 includes
// server/store.h: models may not depend on server".
std::vector<std::string> Violations(const std::vector<Include>& includes,
                                    const std::map<std::string, std::set<std::string>>& graph);

// The folders the graph lets `folder` reach (itself excluded).
std::set<std::string> Reachable(const std::map<std::string, std::set<std::string>>& graph, const std::string& folder);

// The graph as a Mermaid flowchart, arrows in sorted order: what
// docs/ARCHITECTURE.md shows.
std::string RenderMermaid(const std::map<std::string, std::set<std::string>>& graph);

}  // namespace estuary::architecture
