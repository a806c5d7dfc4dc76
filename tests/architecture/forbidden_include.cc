// Compiled only by the test architecture.models_cannot_include_server, which
// passes when this fails: estuary_models sees models/ and base/, not server/.
#include "models/tensor.h"
#include "server/store.h"
