#!/usr/bin/env bash
# The C++ package from outside: `cmake --install` into a scratch prefix, then
# examples/cpp-site configured and built against it as a user would
# (find_package(Estuary), Estuary::client), and the site it builds run: one
# line on data it cannot read, then a round of the installed server. And the
# Python module from the prefix's lib/python3/dist-packages, in a clean
# environment: two sites of estuary.Simulation through the installed server.
#   install_test.sh BUILD_DIR SOURCE_DIR SCRATCH_DIR
set -euo pipefail
build=$1 source=$2 scratch=$3
rm -rf "$scratch"
mkdir -p "$scratch"
cmake --install "$build" --prefix "$scratch/prefix" > "$scratch/install.log"
python_dir=lib/python3/dist-packages
for f in include/estuary/client.h lib/cmake/Estuary/EstuaryConfig.cmake lib/cmake/Estuary/EstuaryTargets.cmake \
         bin/estuary-server bin/estuary-client $python_dir/estuary/__init__.py $python_dir/estuary/_installed.py; do
  [ -e "$scratch/prefix/$f" ] || { echo "install: $f is missing from the prefix"; exit 1; }
done
# Only the public header: an out-of-tree site never sees Estuary's internals.
if [ "$(find "$scratch/prefix/include" -type f | wc -l)" != 1 ]; then
  echo "install: headers beyond estuary/client.h:"; find "$scratch/prefix/include" -type f; exit 1
fi
# Nothing for a host's /etc or systemd: those are the Debian packages' (cpack).
if grep -E "/etc/|systemd" "$scratch/install.log"; then
  echo "install: a prefix install wrote the packages' files (above)"; exit 1
fi

# The Python module from the prefix alone: nothing of this shell's
# environment, no ESTUARY_SERVER, no build tree on any path. It imports from
# the prefix, finds the prefix's estuary-server, and averages two sites.
env -i HOME="$scratch" PATH=/usr/bin:/bin PYTHONPATH="$scratch/prefix/$python_dir" OPENBLAS_NUM_THREADS=1 \
    python3 - "$scratch/prefix" > "$scratch/python.log" 2>&1 <<'PY' || { echo "python:"; cat "$scratch/python.log"; exit 1; }
import os, sys
import numpy as np
import estuary
prefix = os.path.realpath(sys.argv[1])
for module in (estuary, estuary._estuary):
    assert os.path.realpath(module.__file__).startswith(prefix + "/"), module.__file__
assert estuary.find_server() == os.path.join(prefix, "bin", "estuary-server"), estuary.find_server()
initial = {"w": np.array([1.0, -2.0, 0.5], dtype=np.float32)}
def site(step):
    return lambda weights, config: ({"w": weights["w"] + step}, 10, {"loss": 0.0})
result = estuary.Simulation(initial, [site(1.0), site(3.0)], rounds=1).run(timeout_s=120)
# FedAvg of two sites of 10 examples each: the mean of their weights.
assert np.array_equal(result.model["w"], initial["w"] + 2.0), result.model
print("python: estuary from", os.path.dirname(estuary.__file__), "averaged two sites through", estuary.find_server())
PY
launcher=()
if command -v ccache > /dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
generator=()
if command -v ninja > /dev/null; then generator=(-G Ninja); fi
cmake -S "$source/examples/cpp-site" -B "$scratch/site" "${generator[@]}" "${launcher[@]}" \
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$scratch/prefix" > "$scratch/configure.log"
cmake --build "$scratch/site" -j2 > "$scratch/build.log"
# It runs (the library loads) and fails in one line on data it cannot read.
set +e
output=$("$scratch/site/linreg-site" --data "$scratch/missing.csv" 2>&1)
code=$?
set -e
if [ $code != 1 ] || [[ "$output" != "site: $scratch/missing.csv: cannot read it" ]]; then
  echo "linreg-site: exit $code, output: $output"; exit 1
fi
# And it trains: a round of the installed server over TLS on 127.0.0.1 with a
# Linear(3, 1) of its own, the site checking the model's name.
bin=$scratch/prefix/bin
"$bin/estuary-server" certs init --dir "$scratch/certs" > /dev/null
"$bin/estuary-server" certs issue --dir "$scratch/certs" --name server --role server --ip 127.0.0.1 > /dev/null
"$bin/estuary-server" certs issue --dir "$scratch/certs" --name site > /dev/null
python3 - "$scratch" <<'PY'
import json, struct, sys
d = sys.argv[1]
header = json.dumps({"linear.weight": {"dtype": "F32", "shape": [1, 3], "data_offsets": [0, 12]},
                     "linear.bias": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]}}).encode()
with open(f"{d}/linear.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header + struct.pack("<4f", 0.5, -0.25, 0.125, 0.2))
with open(f"{d}/site.csv", "w") as f:
    for i in range(10):
        f.write(f"{i / 10},{1 - i / 10},{(i % 3) / 3},{i / 5 + 1}\n")
PY
"$bin/estuary-server" serve --listen 127.0.0.1:0 --cert "$scratch/certs/server.pem" --key "$scratch/certs/server.key" \
    --ca "$scratch/certs/ca.pem" --db "$scratch/rounds.db" --initial-model "$scratch/linear.safetensors" \
    --rounds 1 --clients-per-round 1 --min-clients 1 --round-deadline 60 --exit-when-done \
    > "$scratch/server.log" 2>&1 &
server=$!
trap 'kill $server 2> /dev/null || true' EXIT
port=
for _ in $(seq 200); do
  port=$(sed -n 's/^listening on 127.0.0.1:\([0-9]*\)$/\1/p' "$scratch/server.log")
  [ -n "$port" ] && break
  kill -0 $server 2> /dev/null || break
  sleep 0.05
done
[ -n "$port" ] || { echo "estuary-server did not listen:"; cat "$scratch/server.log"; exit 1; }
timeout 120 "$scratch/site/linreg-site" --server "127.0.0.1:$port" --ca "$scratch/certs/ca.pem" \
    --cert "$scratch/certs/site.pem" --key "$scratch/certs/site.key" --data "$scratch/site.csv" --check-model \
    > "$scratch/site.log" 2>&1 || { echo "linreg-site failed:"; cat "$scratch/site.log"; exit 1; }
wait $server || { echo "estuary-server failed:"; cat "$scratch/server.log"; exit 1; }
grep -q "round 1 committed: 1 updates" "$scratch/server.log" || { cat "$scratch/server.log"; exit 1; }
cat "$scratch/python.log"
echo "installed into $scratch/prefix; examples/cpp-site built against it trained a round of the installed server"
