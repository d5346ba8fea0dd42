# Sourced by scripts that install Debian packages the project needs.

# apt_missing PKG...: prints those of PKG... not installed yet.
apt_missing() {
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || echo "$p"
  done
}

# apt_install PKG...: installs those not installed yet (root needed),
# refreshing the package lists only when the install fails without.
apt_install() {
  local missing
  mapfile -t missing < <(apt_missing "$@")
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" = 0 ] || { echo "installing ${missing[*]} needs root" >&2; return 1; }
  echo "[apt] apt-get install ${missing[*]}" >&2
  # Packages with a service (prometheus) must not start it: a daemon on
  # every interface that nothing stops. policy-rc.d says no to every
  # start; a temporary one where the image has none.
  local policy=/usr/sbin/policy-rc.d made=
  if [ ! -e $policy ]; then
    printf '#!/bin/sh\nexit 101\n' >$policy && chmod 755 $policy && made=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || { DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
  local rc=$?
  [ -n "$made" ] && rm -f $policy
  return $rc
}
