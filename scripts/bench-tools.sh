#!/usr/bin/env bash
# Installs what the router benchmark compares against, from Debian's
# packages: nginx-light (a plain reverse proxy) and wrk (the load
# generator). Prints "nginx=<path> wrk=<path>" last. Without starting the
# nginx service the package would otherwise start on port 80.
set -euo pipefail
missing=()
for p in nginx-light wrk; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { echo "bench-tools: installing ${missing[*]} needs root" >&2; exit 1; }
  echo "[bench-tools] apt-get install ${missing[*]}" >&2
  policy=/usr/sbin/policy-rc.d
  created=""
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && created=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || { DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
  [ -n "$created" ] && rm -f "$policy"
fi
echo "nginx=$(command -v nginx) wrk=$(command -v wrk)"
