#!/bin/sh
# The Redis users of the stack with deploy/compose.acl.yml: writes deploy/redis-acl/users.acl (passwords
# hashed) from deploy/redis-acl/passwords/<user> (made, random and mode 0600, when missing), and sets each
# user's password in ENV_FILE (default .env), which compose reads. Run from the repository root; again after
# a password file changed (then restart redis).
set -eu
env_file=${1:-.env}
dir=deploy/redis-acl
platforms="remote kubeflow frameworkcontroller"
set --
for platform in $platforms; do set -- "$@" --platform "$platform"; done
umask 022  # redis reads the ACL file as its own user; it holds hashes only
mkdir -p "$dir"
trialstream redis-acl --passwords "$dir/passwords" "$@" > "$dir/users.acl.new"
mv "$dir/users.acl.new" "$dir/users.acl"
touch "$env_file"
for user in manager worker viewer $(for p in $platforms; do echo "worker-$p"; done); do
  name=TRIALSTREAM_REDIS_$(echo "$user" | tr 'a-z-' 'A-Z_')_PASSWORD
  sed -i "/^$name=/d" "$env_file"
  echo "$name=$(cat "$dir/passwords/$user")" >> "$env_file"
done
echo "wrote $dir/users.acl and the Redis users' passwords in $env_file"
