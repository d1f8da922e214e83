#!/usr/bin/env bash
# Builds the Debian package from this checkout on Debian 12:
#
#   bash packaging/build-deb.sh        # -> target/debian/agentgate_<version>_<arch>.deb
#
# Installs the build tools it needs (debhelper, dpkg-dev, lintian, valgrind) with apt-get when they are
# missing, builds with rustup's cargo, and runs lintian on the result (LINTIAN=0 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
for package in debhelper dpkg-dev lintian valgrind; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
out=target/debian
mkdir -p "$out"
dpkg-buildpackage -us -uc -b >"$out/build.log" 2>&1 || { tail -n 40 "$out/build.log" >&2; exit 1; }
version=$(dpkg-parsechangelog -S Version)
arch=$(dpkg-architecture -qDEB_HOST_ARCH)
for artifact in ../agentgate_"${version}"_"${arch}".deb ../agentgate_"${version}"_"${arch}".buildinfo ../agentgate_"${version}"_"${arch}".changes; do
    [ -e "$artifact" ] && mv -f "$artifact" "$out/"
done
deb="$out/agentgate_${version}_${arch}.deb"
if [ "${LINTIAN:-1}" != 0 ]; then
    lintian --pedantic --fail-on error "$deb" >&2
fi
echo "$deb"
