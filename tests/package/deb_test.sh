#!/usr/bin/env bash
# The Debian packages from outside: cpack builds estuary-server and
# estuary-client; their contents, conffiles and Depends are checked with
# dpkg-deb; both are unpacked into a scratch root, where the units' own
# ExecStart lines (paths mapped into the root) run a federation on 127.0.0.1:
# the packaged config, rewritten to the root's /etc/estuary and
# /var/lib/estuary, with only the listen address, the server address and the
# federation's size given as flags. systemd-analyze verifies the units.
#   deb_test.sh CPACK BUILD_DIR SCRATCH_DIR
set -euo pipefail
cpack=$1 build=$2 scratch=$3
rm -rf "$scratch"
mkdir -p "$scratch"
fail() { echo "deb_test: $*"; exit 1; }
# The package names in a Depends or Provides field, without versions.
names() { sed 's/([^)]*)//g; s/[,|]/ /g' <<< "$1" | tr -s ' ' | sed 's/^ //'; }
# The package holding a library: dpkg knows it by the path it shipped, which
# may be the one ldd gives, the file behind its links, or either without
# /usr (/lib is /usr/lib on a merged system; dpkg records /lib).
owner_of() {
  local path
  for path in "$1" "$(readlink -f "$1")"; do
    for path in "$path" "${path#/usr}"; do
      if dpkg -S "$path" > "$scratch/owner" 2> /dev/null; then
        head -1 "$scratch/owner" | cut -d: -f1
        return
      fi
    done
  done
}

"$cpack" --config "$build/CPackConfig.cmake" -B "$scratch/packages" > "$scratch/cpack.log" 2>&1 ||
  { cat "$scratch/cpack.log"; fail "cpack failed"; }
debs=("$scratch"/packages/*.deb)
[ ${#debs[@]} = 2 ] || fail "cpack made ${#debs[@]} packages, not 2: ${debs[*]}"
root=$scratch/root
for name in server client; do
  deb=$(ls "$scratch"/packages/estuary-${name}_*.deb) || fail "no estuary-$name package"
  info=$(dpkg-deb -I "$deb")
  # The control archive: the conffiles list, and the maintainer scripts executable ('*').
  grep -qE "^ +[0-9]+ bytes, +[0-9]+ lines +conffiles" <<< "$info" || fail "$deb: no conffiles:"$'\n'"$info"
  for script in postinst prerm postrm; do
    grep -qE "^ +[0-9]+ bytes, +[0-9]+ lines +\* +$script" <<< "$info" || fail "$deb: no executable $script:"$'\n'"$info"
  done
  contents=$(dpkg-deb -c "$deb")
  for path in ./usr/bin/estuary-$name ./usr/lib/systemd/system/estuary-$name.service ./etc/estuary/$name.toml; do
    grep -q " $path\$" <<< "$contents" || fail "$deb lacks $path:"$'\n'"$contents"
  done
  # Nothing of the other package, nor the client API's library and headers.
  if grep -E "estuary-$([ $name = server ] && echo client || echo server)|include/|\.so" <<< "$contents"; then
    fail "$deb holds more than estuary-$name's files"
  fi
  [ "$(dpkg-deb -f "$deb" Package)" = estuary-$name ] || fail "$deb: Package is not estuary-$name"
  control=$scratch/control-$name
  dpkg-deb -e "$deb" "$control"
  [ "$(cat "$control/conffiles")" = /etc/estuary/$name.toml ] || fail "$deb: conffiles: $(cat "$control/conffiles")"
  grep -q "adduser --system" "$control/postinst" || fail "$deb: postinst does not create the estuary user"
  for script in postinst prerm postrm; do
    sh -n "$control/$script" || fail "$deb: $script is not a valid sh script"
  done
  depends=$(dpkg-deb -f "$deb" Depends)
  grep -qE "(^|, )adduser(,|$)" <<< "$depends" || fail "$deb: Depends lacks adduser (postinst): $depends"
  if grep -qiE "cuda|cublas|nccl|nvidia" <<< "$depends"; then fail "$deb: CUDA in Depends: $depends"; fi
  dpkg-deb -x "$deb" "$root"
  # Depends names, for every library the binary links that a Debian package
  # of this host holds, that package, one that depends on it (libopenblas0
  # for libopenblas0-pthread) or a name it provides (libspdlog1.10-fmt9). A
  # library no package holds (NVIDIA's CUDA) is no dependency, as above.
  binary=$root/usr/bin/estuary-$name
  for soname in $(readelf -d "$binary" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
    path=$(ldd "$binary" | awk -v so="$soname" '$1 == so && $3 ~ /^\// {print $3} $1 ~ ("/" so "$") {print $1}')
    [ -n "$path" ] || fail "$binary: $soname is not found on this host"
    owner=$(owner_of "$path")
    [ -n "$owner" ] || continue
    found=
    for package in $(names "$depends"); do
      if [ "$package" = "$owner" ] ||
         [[ " $(names "$(dpkg-query -W -f='${Depends}' "$package" 2> /dev/null)") " == *" $owner "* ]] ||
         [[ " $(names "$(dpkg-query -W -f='${Provides}' "$owner" 2> /dev/null)") " == *" $package "* ]]; then
        found=$package
        break
      fi
    done
    [ -n "$found" ] || fail "$deb: $soname is $owner's, which Depends lacks: $depends"
  done
  echo "estuary-$name: Depends: $depends"
done

# The units: the user, the state directory and the hardening.
for name in server client; do
  unit=$root/usr/lib/systemd/system/estuary-$name.service
  for line in User=estuary StateDirectory=estuary NoNewPrivileges=yes ProtectSystem=strict ProtectHome=yes \
              PrivateTmp=yes ReadWritePaths=/var/lib/estuary Restart=on-failure; do
    grep -qx "$line" "$unit" || fail "$unit lacks $line"
  done
done
# systemd-analyze verify checks that ExecStart's program is there: it checks
# copies of the units whose programs are the root's.
if command -v systemd-analyze > /dev/null; then
  mkdir "$scratch/units"
  for name in server client; do
    sed "s#^ExecStart=/usr/bin/#ExecStart=$root/usr/bin/#" "$root/usr/lib/systemd/system/estuary-$name.service" \
      > "$scratch/units/estuary-$name.service"
  done
  if ! out=$(systemd-analyze verify "$scratch"/units/*.service 2>&1) || [ -n "$out" ]; then
    fail "systemd-analyze verify:"$'\n'"$out"
  fi
  echo "systemd-analyze verify: both units clean"
else
  echo "deb_test: no systemd-analyze (package systemd): the units' syntax is not verified"
fi

# The packaged configs name the packaged places; the copies in the root are
# rewritten to the root's, as the only change to them.
for name in server client; do
  config=$root/etc/estuary/$name.toml
  grep -q '^cert = "/etc/estuary/tls/' "$config" || fail "$config: cert is not under /etc/estuary/tls"
  grep -q '^ca = "/etc/estuary/tls/ca.pem"' "$config" || fail "$config: ca is not /etc/estuary/tls/ca.pem"
  grep -q '"/var/lib/estuary/' "$config" || fail "$config names nothing under /var/lib/estuary"
  sed -i "s#\"/etc/estuary/#\"$root/etc/estuary/#; s#\"/var/lib/estuary/#\"$root/var/lib/estuary/#" "$config"
done
# A unit's ExecStart, its absolute paths moved into the root, as words.
exec_start() {
  local line
  line=$(sed -n 's/^ExecStart=//p' "$root/usr/lib/systemd/system/estuary-$1.service")
  [ -n "$line" ] || fail "estuary-$1.service has no ExecStart"
  line=$(sed "s#\(^\| \)/usr/bin/#\1$root/usr/bin/#g; s#\(^\| \)/etc/estuary/#\1$root/etc/estuary/#g" <<< "$line")
  read -r -a words <<< "$line"
}

# What the administrator does (docs/DEPLOYING.md): certificates into
# /etc/estuary/tls, the site's data, and the state directory systemd makes.
bin=$root/usr/bin
tls=$root/etc/estuary/tls
"$bin/estuary-server" certs init --dir "$tls" > /dev/null
"$bin/estuary-server" certs issue --dir "$tls" --name server --role server --ip 127.0.0.1 > /dev/null
"$bin/estuary-server" certs issue --dir "$tls" --name site-a > /dev/null
mv "$tls/site-a.pem" "$tls/client.pem"
mv "$tls/site-a.key" "$tls/client.key"
state=$root/var/lib/estuary
mkdir -p "$state"
python3 - "$state/data" <<'PY'
# A learnable 10-class problem in MNIST's IDX format: a bright bar per class.
import os, random, struct, sys
out = sys.argv[1]
os.makedirs(out)
rng = random.Random(7)
for prefix, n in (("train", 200), ("t10k", 50)):
    labels = [rng.randrange(10) for _ in range(n)]
    pixels = bytearray()
    for label in labels:
        for row in range(28):
            bar = 200 if 2 + 2 * label <= row < 4 + 2 * label else 0
            pixels += bytes(min(255, bar + rng.randrange(50)) for _ in range(28))
    with open(f"{out}/{prefix}-images-idx3-ubyte", "wb") as f:
        f.write(struct.pack(">IIII", 0x803, n, 28, 28) + pixels)
    with open(f"{out}/{prefix}-labels-idx1-ubyte", "wb") as f:
        f.write(struct.pack(">II", 0x801, n) + bytes(labels))
PY

exec_start server
(cd "$state" && exec timeout 300 "${words[@]}" --listen 127.0.0.1:0 --rounds 2 --min-clients 1 --clients-per-round 1 \
    --epochs 1 --exit-when-done) > "$scratch/server.log" 2>&1 &
server=$!
trap 'kill $server 2> /dev/null || true' EXIT
port=
for _ in $(seq 600); do  # 30 s for the server to listen
  port=$(sed -n 's/^listening on 127.0.0.1:\([0-9]*\)$/\1/p' "$scratch/server.log")
  [ -n "$port" ] && break
  kill -0 $server 2> /dev/null || break
  sleep 0.05
done
[ -n "$port" ] || { cat "$scratch/server.log"; fail "the packaged server did not listen"; }

exec_start client
(cd "$state" && exec timeout 300 "${words[@]}" --server "127.0.0.1:$port" --max-backoff 1) > "$scratch/client.log" 2>&1 ||
  { cat "$scratch/client.log"; fail "the packaged client failed"; }
wait $server || { cat "$scratch/server.log"; fail "the packaged server failed"; }
grep -q "federation complete; trained 2 rounds" "$scratch/client.log" || { cat "$scratch/client.log"; fail "client"; }
# The round log and the models are where the packaged config puts them.
rounds=$("$bin/estuary-server" rounds list --db "$state/rounds.db" --json)
python3 - "$rounds" <<'PY' || fail "round log: $rounds"
import json, sys
rounds = json.loads(sys.argv[1])
assert [(r["round"], r["state"], r["updates_received"]) for r in rounds] == [(1, "committed", 1), (2, "committed", 1)]
PY
[ -n "$(ls "$state/checkpoints")" ] || fail "no checkpoint in $state/checkpoints"
echo "packages in $scratch/packages: their units ran a federation of 2 rounds from $root"
