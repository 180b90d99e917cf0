#!/usr/bin/env bash
# Re-creates manager/static/vendor/echarts/ from the npm registry's echarts@6.1.0 tarball.
#
# This is the timeline page's build step: its output is committed, and nothing is fetched at run
# time. The script takes dist/echarts.min.js, LICENSE, NOTICE and licenses/LICENSE-d3 out of `npm pack echarts@6.1.0`,
# checks the sha256 of echarts.min.js against the one recorded in VERSION (so a re-run proves the
# committed asset is the registry's), and writes VERSION anew only when it did not exist.
#
# Usage: scripts/vendor-echarts.sh            (from any directory; needs npm, tar, sha256sum)
#        ECHARTS_UPDATE_SHA=1 scripts/vendor-echarts.sh   (record the new sha256 after a version bump)
set -euo pipefail

ECHARTS_VERSION="6.1.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/manager/static/vendor/echarts"

TMP="$(mktemp -d "${TMPDIR:-/tmp}/vendor-echarts.XXXXXX")"
trap 'rm -rf -- "$TMP"' EXIT

# npm pack writes the tarball into the current directory, and its cache is kept out of the repo.
(cd "$TMP" && npm pack --silent --cache "$TMP/npm-cache" "echarts@$ECHARTS_VERSION" >/dev/null)
tar -xzf "$TMP/echarts-$ECHARTS_VERSION.tgz" -C "$TMP"

PKG="$TMP/package"
for f in dist/echarts.min.js LICENSE NOTICE licenses/LICENSE-d3; do
    [[ -f "$PKG/$f" ]] || { echo "vendor-echarts: $f is not in the echarts@$ECHARTS_VERSION tarball" >&2; exit 1; }
done

actual="$(sha256sum "$PKG/dist/echarts.min.js" | cut -d' ' -f1)"
if [[ -f "$DEST/VERSION" && "${ECHARTS_UPDATE_SHA:-0}" != "1" ]]; then
    # VERSION: line 1 "echarts <version>", line 2 "<sha256>  echarts.min.js" (sha256sum's format).
    recorded_version="$(sed -n '1p' "$DEST/VERSION")"
    expected="$(sed -n '2p' "$DEST/VERSION" | cut -d' ' -f1)"
    if [[ "$recorded_version" != "echarts $ECHARTS_VERSION" ]]; then
        echo "vendor-echarts: VERSION says '$recorded_version', this script packs echarts $ECHARTS_VERSION" >&2
        exit 1
    fi
    if [[ "$actual" != "$expected" ]]; then
        echo "vendor-echarts: sha256 mismatch for echarts.min.js: registry $actual, VERSION $expected" >&2
        exit 1
    fi
fi

mkdir -p "$DEST"
cp "$PKG/dist/echarts.min.js" "$DEST/echarts.min.js"
cp "$PKG/LICENSE" "$DEST/LICENSE"
cp "$PKG/NOTICE" "$DEST/NOTICE"
cp "$PKG/licenses/LICENSE-d3" "$DEST/LICENSE-d3"  # LICENSE names it: parts of echarts come from d3
printf 'echarts %s\n%s  echarts.min.js\n' "$ECHARTS_VERSION" "$actual" > "$DEST/VERSION"

# The copied file is checked once more, as sha256sum would check it from VERSION.
(cd "$DEST" && sed -n '2p' VERSION | sha256sum --check --quiet -)
echo "vendor-echarts: $DEST holds echarts $ECHARTS_VERSION (sha256 $actual)"
