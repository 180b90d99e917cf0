#!/usr/bin/env bash
# Installs what trialstream and its tests need on a fresh Debian machine: redis-server from Debian's
# packages when it is missing (for tests also OpenSSH's server, acl, Chromium and its driver), and the
# Python package with its extras (`--test` adds the tuners' extras, test and dev).
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
if [ "${1:-}" = "--test" ]; then  # real sshd hosts for the remote platform's tests (tests/sshd.py)
  [ -x /usr/sbin/sshd ] || need_apt+=(openssh-server)
  command -v setfacl >/dev/null || need_apt+=(acl)
  # NNI's web UI is tested in a real headless browser (tests/browser.py): Debian's, never a downloaded one
  [ -x /usr/bin/chromium ] || need_apt+=(chromium)
  [ -x /usr/bin/chromedriver ] || need_apt+=(chromium-driver)
  [ -d /usr/share/fonts/truetype/liberation ] || need_apt+=(fonts-liberation)  # a font to render pages with
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
fi

extras="nni"
[ "${1:-}" = "--test" ] && extras="nni,tuners,test,dev"
python3 -m pip install -q --disable-pip-version-check -e ".[${extras}]"
