#include "simulations/population.h"

#include "aggregation/sampling.h"
#include "base/seed.h"
#include "client/site.h"
#include "simulations/poisson_sampling.h"
#include "simulations/workload.h"

namespace estuary::simulations {

Result<std::shared_ptr<const Population>> Population::Create(const Scenario& s) {
  ESTUARY_ASSIGN_OR_RETURN(const PartitionSpec spec, ParsePartition(s.partition));
  ESTUARY_ASSIGN_OR_RETURN(models::Dataset train, models::LoadIdx(s.data_dir, models::Split::kTrain));
  ESTUARY_ASSIGN_OR_RETURN(SiteExamples examples, SiteExamples::Create(train.labels, train.num_classes, spec,
                                                                       s.examples_per_client, s.task().seed()));
  std::shared_ptr<Population> p(new Population(s, std::move(examples)));
  p->sites_ = s.clients;
  p->seed_ = s.task().seed();
  // As wide as the last site's index, and never narrower than a split run's client-NNN.
  p->name_width_ = std::max<int>(3, int(fmt::formatted_size("{}", s.clients > 0 ? s.clients - 1 : 0)));
  ESTUARY_ASSIGN_OR_RETURN(p->attack_, ParseAttack(s.attack));
  ESTUARY_ASSIGN_OR_RETURN(p->stragglers_, ParseStragglers(s.stragglers, s.straggler_work));
  // --attack label-flip: the malicious sites draw their examples from a copy
  // of the training set under labels l -> C - 1 - l (only then).
  if (p->attack_.kind == Attack::Kind::kLabelFlip) {
    auto copy = std::make_shared<models::Dataset>(train);
    for (int32_t& label : copy->labels) label = copy->num_classes - 1 - label;
    p->flipped_ = std::move(copy);
  }
  p->train_ = std::make_shared<const models::Dataset>(std::move(train));
  return std::shared_ptr<const Population>(std::move(p));
}

std::string Population::Name(uint64_t site) const { return fmt::format("client-{:0{}}", site, name_width_); }

bool Population::Malicious(uint64_t site) const {
  return attack_.kind != Attack::Kind::kNone && IsChosenSite(site, sites_, scenario_.attackers, seed_, "attackers");
}

uint64_t Population::attackers() const {
  return attack_.kind == Attack::Kind::kNone ? 0 : ChosenSiteCount(sites_, scenario_.attackers);
}

Result<std::unique_ptr<client::Trainer>> Population::Site(uint64_t site) const {
  if (site >= sites_) return InvalidArgument("sim: site {} of a population of {}", site, sites_);
  const bool malicious = Malicious(site);
  ESTUARY_ASSIGN_OR_RETURN(const client::LocalSiteOptions options, SiteOptionsOf(scenario_));
  ESTUARY_ASSIGN_OR_RETURN(
      auto made,
      client::MakeLocalSite({.images = flipped_ && malicious ? flipped_ : train_, .indices = examples_.Of(site)},
                            options));
  std::unique_ptr<client::Trainer> trainer = std::move(made);
  if (malicious && attack_.kind != Attack::Kind::kLabelFlip) {
    trainer = MakeAttacker(std::move(trainer), attack_, seed_, uint32_t(site));
  }
  if (stragglers_.fraction > 0 && IsChosenSite(site, sites_, stragglers_.fraction, seed_, "stragglers")) {
    trainer = MakeStraggler(std::move(trainer), stragglers_, seed_, uint32_t(site));
  }
  return trainer;
}

std::vector<uint64_t> Population::Sample(uint64_t round) const {
  if (scenario_.sample_rate > 0) return PoissonSampleIndices(sites_, scenario_.sample_rate, seed_, round);
  return aggregation::SampleIndices(sites_, aggregation::ClientsPerRound(scenario_.per_round, sites_), seed_, round);
}

Result<Workload> Population::Materialise() const {
  Workload w;
  for (uint64_t site = 0; site < sites_; ++site) {
    w.names.push_back(Name(site));
    ESTUARY_ASSIGN_OR_RETURN(auto trainer, Site(site));
    w.trainers.push_back(std::move(trainer));
  }
  return w;
}

}  // namespace estuary::simulations
