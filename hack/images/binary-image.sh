# Sourced by sidecars.sh and csi-addons.sh (which set BASE_IMAGE and log).
# binary_image BINARY ENTRYPOINT REF ARCHIVE VERSION MODULE: BASE_IMAGE with BINARY copied to
# ENTRYPOINT, its entrypoint, labelled with the module and version it was built from, committed
# as REF and exported as a docker-archive to ARCHIVE.
binary_image() {
  local bin=$1 entry=$2 ref=$3 archive=$4 ver=$5 mod=$6 ctr
  ctr=$(buildah from --pull=never "$BASE_IMAGE")
  buildah copy --chmod 0755 "$ctr" "$bin" "$entry" >/dev/null
  buildah config --cmd '' "$ctr"   # drop the base's bash before setting the entrypoint
  buildah config --entrypoint "[\"$entry\"]" \
    --label "org.opencontainers.image.version=$ver" \
    --label "io.modeguard.built-from=$mod@$ver" "$ctr"
  buildah commit --rm -q "$ctr" "$ref" >/dev/null
  rm -f "$archive"
  buildah push -q "$ref" "docker-archive:$archive:$ref"
  log "$ref -> $archive ($(du -h "$archive" | cut -f1))"
}
