#!/usr/bin/env bash
# Makes a Debian base image from Debian's own packages, for machines that reach no image registry:
#   deploy/base-image.sh [NAME]          (default trialstream-base:bookworm; nothing to do if it exists)
# It carries python3 (build trialstream's image on it: TRIALSTREAM_BASE_IMAGE=NAME), redis-server (the
# stack's redis: TRIALSTREAM_REDIS_IMAGE=NAME) and openssh-server (a remote host in the stack's tests).
# Needs root, debootstrap and a Debian mirror (DEBIAN_MIRROR, default deb.debian.org).
set -euo pipefail
name=${1:-trialstream-base:bookworm}
if docker image inspect "$name" >/dev/null 2>&1; then
  exit 0
fi
rootfs=$(mktemp -d /tmp/trialstream-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,redis-server,openssh-server,ca-certificates \
  bookworm "$rootfs" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$rootfs.log" 2>&1 \
  || { tail -20 "$rootfs.log" >&2; exit 1; }
rm -f "$rootfs.log"
# openssh-server's install made host keys: they would be the same in every container, so a container
# that runs sshd makes its own (ssh-keygen -A).
rm -f "$rootfs"/etc/ssh/ssh_host_*
# What an image does not need: package lists and downloads, documentation, translations.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/usr/share/doc/* \
  "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
# /data: the stack's redis keeps its AOF there, owned by redis as in the official redis image.
chroot "$rootfs" install -d -o redis -g redis /data
tar -C "$rootfs" -c . | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$name" >/dev/null
