// The flags that define a federation, the same for `estuary-server serve`
// and `estuary-sim`: the task (--model, --epochs, --batch, --lr, ..., the
// --lora-* keys), the strategy (--strategy, --server-lr, --beta1, --beta2,
// --tau), --seed, --template, --base-model, --initial-model, --eval-windows and the limits on an update
// (--max-update-norm, --max-norm-over-median, --max-examples) and DP-FedAvg
// (--dp-noise-multiplier, --dp-clip, --dp-adaptive-clip, ...). Each flag writes its field
// of the v1::FederationConfig straight away, so the message stays the one
// definition; --help shows each field's value when the flags were added (the
// defaults). A TOML config file takes the same keys (base/config_file.h).
// Values are checked by CheckFederation (federation.h), not here, except
// where a flag parses a name: --update-kind full | lora.
#pragma once

#include <vector>

#include "federation.pb.h"

namespace CLI {
class App;
class Option;
}  // namespace CLI

namespace estuary::aggregation {

// `config` must outlive the parse. Returns the flags added, so a caller can
// tell which were given (CLI::Option::count).
std::vector<CLI::Option*> AddFederationFlags(CLI::App& app, v1::FederationConfig* config);

}  // namespace estuary::aggregation
