#!/usr/bin/env bash
# Installs every Debian package that imgtool's build, tests and benchmarks need,
# and the dashboard's npm packages (benchmarks/web, `npm ci`).
# Idempotent: safe to re-run. Must run as root on Debian 12.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(
  bazel-bootstrap g++ pkg-config
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev libbenchmark-tools
  liburing-dev libaio-dev libprotobuf-dev protobuf-compiler zlib1g-dev
  libzstd-dev
  clang libclang-rt-14-dev  # tools/fuzz.sh: --config=fuzz (libFuzzer, ASan, UBSan)
  libnbd-bin  # nbdinfo: bitmap_oracle_test reads bitmaps through qemu-nbd
  libnbd-dev  # nbd_block: the nbd client driver is built on libnbd 1.14
  python3-libnbd  # nbdsh: nbd_server_oracle_test's client without structured replies
  qemu-system-x86 busybox-static  # nbd_guest_test: a QEMU guest on an imgtool nbd export
  nbdkit nbd-server  # nbd_interop_oracle_test: the nbd client against other servers
  libgnutls28-dev  # nbd_server/tls: GnuTLS's headers (libgnutls30 is loaded with dlopen)
  gnutls-bin  # certtool, psktool: nbd_tls_oracle_test makes its certificates and keys
  qemu-utils xfsprogs e2fsprogs util-linux strace fio hyperfine python3
  chromium fonts-dejavu-core
  zip file  # bazel test packs undeclared outputs (dashboard_test's screenshot) with them
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js and npm for the dashboard's Chart.js: Debian's unless a node/npm is
# already there (e.g. another Node.js package that ships its own npm).
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
if ((${#missing[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# nbd_guest_test's kernel: the .deb of the current bookworm cloud kernel
# (what linux-image-cloud-amd64 depends on), downloaded, not installed, into
# the cache directory the test reads (it stays offline); older ones removed.
kdir=${IMGTOOL_GUEST_KERNEL_DIR:-/var/cache/imgtool/guest-kernel}
kpkg() { apt-cache depends linux-image-cloud-amd64 2>/dev/null |
  sed -n 's/^ *Depends: \(linux-image-[^ ]*-cloud-amd64\)$/\1/p' | head -1; }
kernel=$(kpkg)
[[ -n $kernel ]] || { apt-get update -qq; kernel=$(kpkg); }
[[ -n $kernel ]] || { echo "setup.sh: no linux-image-cloud-amd64 in apt" >&2; exit 1; }
if ! compgen -G "$kdir/${kernel}_*_amd64.deb" >/dev/null; then
  mkdir -p "$kdir"
  (cd "$kdir" && apt-get download -q -o APT::Sandbox::User=root "$kernel")
  find "$kdir" -name 'linux-image-*.deb' ! -name "${kernel}_*" -delete
fi

# benchmarks/web/node_modules (git- and bazel-ignored), exactly as locked;
# re-run only when package-lock.json changed since the last install.
web=benchmarks/web
if ! cmp -s "$web/package-lock.json" "$web/node_modules/.imgtool-installed-lock"; then
  (cd "$web" && npm ci --no-audit --no-fund --loglevel=error)
  cp "$web/package-lock.json" "$web/node_modules/.imgtool-installed-lock"
fi
