#!/usr/bin/env bash
# Docker engine + busybox-static for the job tests (test-components section 1).
# Idempotent: installs only what is missing. Starts no daemon: tests/fixtures/docker.py starts
# a private dockerd (no bridge, no iptables) under a temp dir and stops it at the end.
# Usage: `.ci/docker.sh` or `source .ci/docker.sh && install_docker` (sourcing changes no
# shell options).

_apt_install() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  # The package's postinst cannot start the service in a container/VM; that is expected.
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

install_docker() {
  # docker.io brings dockerd, containerd, runc and docker-init (tini: init=True for fast stops).
  _apt_install docker.io busybox-static
  command -v dockerd >/dev/null || { echo "dockerd missing after install" >&2; return 1; }
  [ -x /bin/busybox ] || [ -x /usr/bin/busybox ] || { echo "busybox missing" >&2; return 1; }
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  install_docker
fi
