#!/bin/sh
# The flagship scenario in process and over loopback mutual TLS (a real
# estuary-server child, one Agent per site), alternately, N times each (5 by
# default), so the load of a shared machine falls on both alike. Prints each
# run's wall time, the medians and their ratio, and the load average before
# and after. Extra arguments go to both runs.
#
#   bench/loopback_vs_inproc.sh [N] [estuary-sim flags...]
#
# Run from the source tree after scripts/build; the certificates are made
# once, in run/loop-bench, before the timed runs (as in any loopback run after
# the first: --workdir keeps them).
set -eu
n=${1:-5}
[ $# -gt 0 ] && shift
sim=${ESTUARY_SIM:-build/simulations/estuary-sim}
work=run/loop-bench
"$sim" --mode loopback --workdir "$work" --rounds 1 "$@" > /dev/null

seconds() {  # the wall time a run reports on its last line: "... in 1.23 s"
  "$sim" "$@" | sed -n 's/^final .* in \([0-9.]*\) s$/\1/p'
}
median() { sort -n | awk '{ v[NR] = $1 } END { print v[int(NR / 2) + 1] }'; }

echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
inproc="" loop=""
i=1
while [ "$i" -le "$n" ]; do
  a=$(seconds --mode inproc "$@")
  b=$(seconds --mode loopback --workdir "$work" "$@")
  echo "run $i: inproc $a s, loopback $b s"
  inproc="$inproc $a" loop="$loop $b"
  i=$((i + 1))
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
mi=$(echo "$inproc" | tr ' ' '\n' | grep . | median)
ml=$(echo "$loop" | tr ' ' '\n' | grep . | median)
echo "median: inproc $mi s, loopback $ml s"
awk -v l="$ml" -v i="$mi" 'BEGIN { printf "ratio (loopback / inproc): %.2f\n", l / i }'
