// Certificates and identities for many sites on one machine.
//
// The simulator's loopback mode and the connection benchmark run thousands of
// sites in one process, each with its own certificate; issuing and loading
// them one after another took longer than the federation. These spread the
// work over threads and keep what an earlier run left.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "crypto/certs.h"
#include "crypto/tls.h"

namespace estuary::crypto {

// Makes `dir` hold a CA (created when missing) and a certificate of
// options.role for each of `names`, issued on `threads` threads. One already
// there is kept when it is valid and plays that role; any other (expired,
// another CA's, issued before roles) is issued anew. Fails with the first
// failure in the order of `names`.
Status ProvisionCertificates(const std::filesystem::path& dir, const std::vector<std::string>& names,
                             size_t threads, const CertOptions& options = {});

// LoadIdentity(dir/<name>.pem, dir/<name>.key) for each of `names`, on
// `threads` threads, in the order of `names`. Fails with the first failure in
// that order.
Result<std::vector<std::shared_ptr<const Identity>>> LoadIdentities(const std::filesystem::path& dir,
                                                                    const std::vector<std::string>& names,
                                                                    size_t threads);

}  // namespace estuary::crypto
