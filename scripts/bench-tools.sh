#!/usr/bin/env bash
# Installs what the router benchmark compares against, from Debian's
# packages: nginx-light (a plain reverse proxy) and wrk (the load
# generator). Prints "nginx=<path> wrk=<path>" last. Without starting the
# nginx service the package would otherwise start on port 80.
set -euo pipefail
source "$(dirname "$0")/apt.sh"
tools=(nginx-light wrk)
if [ -n "$(apt_missing "${tools[@]}")" ]; then
  policy=/usr/sbin/policy-rc.d
  created=""
  if [ ! -e "$policy" ] && [ "$(id -u)" = 0 ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && created=1
  fi
  status=0
  apt_install "${tools[@]}" || status=$?
  [ -n "$created" ] && rm -f "$policy"
  [ "$status" = 0 ] || exit "$status"
fi
echo "nginx=$(command -v nginx) wrk=$(command -v wrk)"
