# Sourced by images.sh and hack/conformance/images.sh: writes a one-layer
# docker-archive (what `ctr images import` reads) from a directory, without a
# registry or an image builder.

# docker_archive OUT.tar TAG ENTRYPOINT_JSON CMD_JSON ROOTFS_DIR [MORE_TAGS...]
# The layer is reproducible (numeric owners, mtime 0, sorted names), so an
# unchanged rootfs gives the same image ID.
docker_archive() {
  local out=$1 tag=$2 entry=$3 cmd=$4 rootfs=$5; shift 5
  local work; work=$(mktemp -d "$out.work.XXXXXX")
  tar --numeric-owner --owner=0 --group=0 --mtime=@0 --sort=name -C "$rootfs" -cf "$work/layer.tar" .
  local diff; diff=$(sha256sum "$work/layer.tar" | cut -d' ' -f1)
  cat >"$work/config.json" <<JSON
{"architecture":"amd64","os":"linux","created":"1970-01-01T00:00:00Z",
 "config":{"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],"Entrypoint":$entry,"Cmd":$cmd,"WorkingDir":"/"},
 "rootfs":{"type":"layers","diff_ids":["sha256:$diff"]}}
JSON
  local cfg; cfg=$(sha256sum "$work/config.json" | cut -d' ' -f1)
  mv "$work/config.json" "$work/$cfg.json"
  mkdir -p "$work/$diff"; mv "$work/layer.tar" "$work/$diff/layer.tar"
  local tags="\"$tag\"" t
  for t in "$@"; do tags+=",\"$t\""; done
  printf '[{"Config":"%s.json","RepoTags":[%s],"Layers":["%s/layer.tar"]}]\n' "$cfg" "$tags" "$diff" >"$work/manifest.json"
  tar --numeric-owner --owner=0 --group=0 -C "$work" -cf "$out.tmp" manifest.json "$cfg.json" "$diff"
  mv "$out.tmp" "$out"
  rm -rf "$work"
  echo "built $out ($tag $*)"
}

# busybox_rootfs DIR BUSYBOX: a root filesystem of busybox applets in /bin,
# with root and nobody.
busybox_rootfs() {
  local dir=$1 busybox=$2 a
  mkdir -p "$dir"/{bin,etc,tmp,proc,sys,dev,root,var/run}
  chmod 1777 "$dir/tmp"
  cp "$busybox" "$dir/bin/busybox"
  for a in $("$busybox" --list); do
    [[ "$a" == busybox ]] || ln -sf busybox "$dir/bin/$a"
  done
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' >"$dir/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' >"$dir/etc/group"
}
