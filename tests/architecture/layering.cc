#include "tests/architecture/layering.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>

namespace estuary::architecture {

namespace fs = std::filesystem;

const std::map<std::string, std::set<std::string>>& DesignGraph() {
  static const std::map<std::string, std::set<std::string>> graph = {
      {"base", {}},
      {"proto", {"base"}},
      {"crypto", {"base"}},
      {"models", {"base"}},
      {"comm", {"base"}},
      {"privacy", {"base"}},
      {"secagg", {"crypto", "proto"}},
      {"parallel", {"comm", "models"}},
      {"aggregation", {"models", "proto"}},
      {"client", {"parallel", "models", "proto", "crypto", "secagg"}},
      {"server", {"aggregation", "proto", "crypto", "privacy", "secagg"}},
      {"simulations", {"client", "server", "secagg"}},
      {"bench", {"simulations", "secagg"}},
  };
  return graph;
}

static std::string FolderOf(const std::string& path) { return path.substr(0, path.find('/')); }

std::vector<Include> ScanIncludes(const std::string& root) {
  static const std::regex include(R"(^\s*#\s*include\s+"([a-z_]+)/([^"]+)\")");
  std::vector<Include> found;
  for (const auto& [folder, arrows] : DesignGraph()) {
    if (!fs::is_directory(fs::path(root) / folder)) continue;
    for (const auto& entry : fs::recursive_directory_iterator(fs::path(root) / folder)) {
      const std::string ext = entry.path().extension().string();
      if (!entry.is_regular_file() || (ext != ".h" && ext != ".cc" && ext != ".cu" && ext != ".cuh")) continue;
      const std::string file = fs::relative(entry.path(), root).generic_string();
      std::ifstream in(entry.path());
      std::string text;
      for (int line = 1; std::getline(in, text); ++line) {
        std::smatch m;
        if (std::regex_search(text, m, include) && DesignGraph().contains(m[1].str())) {
          found.push_back({file, line, m[1].str() + "/" + m[2].str()});
        }
      }
    }
  }
  std::sort(found.begin(), found.end(), [](const Include& a, const Include& b) {
    return std::tie(a.file, a.line) < std::tie(b.file, b.line);
  });
  return found;
}

std::set<std::string> Reachable(const std::map<std::string, std::set<std::string>>& graph, const std::string& folder) {
  std::set<std::string> seen;
  std::vector<std::string> todo = {folder};
  while (!todo.empty()) {
    const std::string at = todo.back();
    todo.pop_back();
    auto it = graph.find(at);
    if (it == graph.end()) continue;
    for (const std::string& next : it->second) {
      if (seen.insert(next).second) todo.push_back(next);
    }
  }
  seen.erase(folder);
  return seen;
}

std::vector<std::string> Violations(const std::vector<Include>& includes,
                                    const std::map<std::string, std::set<std::string>>& graph) {
  std::vector<std::string> out;
  std::map<std::string, std::set<std::string>> reach;
  for (const Include& include : includes) {
    const std::string from = FolderOf(include.file), to = FolderOf(include.header);
    if (from == to) continue;
    if (!graph.contains(from)) {
      out.push_back(fmt::format("{}:{} includes {}: folder '{}' is not in the design's graph", include.file,
                                include.line, include.header, from));
      continue;
    }
    if (!reach.contains(from)) reach[from] = Reachable(graph, from);
    if (!reach[from].contains(to)) {
      out.push_back(fmt::format("{}:{} includes {}: {} may not depend on {}", include.file, include.line,
                                include.header, from, to));
    }
  }
  return out;
}

std::string RenderMermaid(const std::map<std::string, std::set<std::string>>& graph) {
  std::string out = "```mermaid\nflowchart TD\n";
  for (const auto& [from, arrows] : graph) {
    for (const std::string& to : arrows) out += fmt::format("  {} --> {}\n", from, to);
  }
  return out + "```\n";
}

}  // namespace estuary::architecture
