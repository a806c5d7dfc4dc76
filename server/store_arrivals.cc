// The Store's asynchronous rounds (store.h, Arrival): one row per update
// that arrived while a version was built. Apart from store.cc, which holds
// the synchronous round's record.
#include <sqlite3.h>

#include "server/store.h"
#include "server/store_sql.h"

namespace estuary::server {

Status Store::RecordArrival(const Arrival& a) {
  return sql::Statement(db_,
                        "INSERT INTO round_arrivals(round, seq, client, status, trained_from, staleness, weight, "
                        "examples, train_loss, bytes_up, seconds, at_ms, detail) "
                        "VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
      .Bind(a.round)
      .Bind(a.seq)
      .Bind(a.client)
      .Bind(a.status)
      .Bind(a.trained_from)
      .Bind(a.staleness)
      .Bind(a.weight)
      .Bind(a.examples)
      .Bind(a.train_loss)
      .Bind(a.bytes_up)
      .Bind(a.seconds)
      .Bind(a.at_ms)
      .Bind(a.detail)
      .Run();
}

Result<std::vector<Arrival>> Store::Arrivals(uint64_t round) {
  std::vector<Arrival> out;
  if (!has_arrivals_) return out;
  sql::Statement s(db_,
                   "SELECT round, seq, client, status, trained_from, staleness, weight, examples, train_loss, bytes_up, "
                   "seconds, at_ms, detail FROM round_arrivals WHERE round = ? ORDER BY seq");
  s.Bind(round);
  for (;;) {
    ESTUARY_ASSIGN_OR_RETURN(bool row, s.Step());
    if (!row) return out;
    out.push_back({.round = uint64_t(s.Int(0)),
                   .seq = uint64_t(s.Int(1)),
                   .client = s.Text(2),
                   .status = s.Text(3),
                   .trained_from = uint64_t(s.Int(4)),
                   .staleness = uint64_t(s.Int(5)),
                   .weight = s.Real(6),
                   .examples = uint64_t(s.Int(7)),
                   .train_loss = s.Real(8),
                   .bytes_up = uint64_t(s.Int(9)),
                   .seconds = s.Real(10),
                   .at_ms = s.Int(11),
                   .detail = s.Text(12)});
  }
}

}  // namespace estuary::server
