{{/* Labels every object carries: the kustomize base's, plus Helm's own. */}}
{{- define "modeguard.labels" -}}
app.kubernetes.io/part-of: modeguard
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* An image reference from {repository, tag}. */}}
{{- define "modeguard.image" -}}
{{ .repository }}:{{ .tag }}
{{- end -}}

{{/* The driver's image: image.tag, or the chart's appVersion. */}}
{{- define "modeguard.driverImage" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The node plugin's socket directory on the host. */}}
{{- define "modeguard.pluginDir" -}}
{{ .Values.kubeletDir }}/plugins/{{ .Values.driverName }}
{{- end -}}

{{/* imagePullSecrets of every pod, from imagePullSecrets: names or {name}. */}}
{{- define "modeguard.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ if kindIs "string" . }}{{ . }}{{ else }}{{ .name }}{{ end }}
  {{- end }}
{{- end }}
{{- end -}}

{{/*
A sidecar's resources and securityContext: its own resources, else
sidecars.resources; sidecars.securityContext. Called with (list $ $sidecar).
*/}}
{{- define "modeguard.sidecarExtras" -}}
{{- $root := index . 0 }}
{{- $s := index . 1 }}
{{- with ($s.resources | default $root.Values.sidecars.resources) }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.sidecars.securityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
The node that keeps the NFS volumes' data, where ganesha runs (the NFS
target, or with nfs.servedBy=controller the controller): nfs.node; else the
node an earlier release pinned it to (the modeguard.csi.dev/nfs-node
annotation of the NFS target's StatefulSet, or of the controller Deployment
of a release that served NFS from the controller); else, at the first
install against a cluster, the first Ready node by name that the node
selector admits (nfs.nodeSelector, or controller.nodeSelector with
servedBy=controller) and that has no NoSchedule taint. Empty when rendering
without a cluster (helm template): nothing is then pinned, which NOTES.txt
says.
*/}}
{{- define "modeguard.nfsNode" -}}
{{- if .Values.nfs.node }}
{{- .Values.nfs.node }}
{{- else }}
{{- $found := "" }}
{{- range list (list "StatefulSet" "modeguard-nfs") (list "Deployment" "modeguard-controller") }}
{{- if not $found }}
{{- with lookup "apps/v1" (index . 0) $.Release.Namespace (index . 1) }}{{ with .metadata.annotations }}{{ $found = index . "modeguard.csi.dev/nfs-node" | default "" }}{{ end }}{{ end }}
{{- end }}
{{- end }}
{{- $selector := .Values.nfs.nodeSelector | default dict }}
{{- if include "modeguard.nfsInController" . }}{{ $selector = .Values.controller.nodeSelector | default dict }}{{ end }}
{{- if not $found }}
{{- $nodes := lookup "v1" "Node" "" "" }}
{{- $names := list }}
{{- range ($nodes.items | default list) }}
{{- $ok := true }}
{{- range $k, $v := $selector }}{{ if ne ($v | toString) ((index (.metadata.labels | default dict) $k) | default "" | toString) }}{{ $ok = false }}{{ end }}{{ end }}
{{- range (.spec.taints | default list) }}{{ if eq .effect "NoSchedule" }}{{ $ok = false }}{{ end }}{{ end }}
{{- $ready := false }}
{{- range (.status.conditions | default list) }}{{ if and (eq .type "Ready") (eq .status "True") }}{{ $ready = true }}{{ end }}{{ end }}
{{- if and $ok $ready }}{{ $names = append $names .metadata.name }}{{ end }}
{{- end }}
{{- with (sortAlpha $names) }}{{ $found = first . }}{{ end }}
{{- end }}
{{- $found }}
{{- end }}
{{- end -}}

{{/*
The zones of the cluster's nodes that .Values.zones leaves out, from the
nodes' zone label (none when rendering without a cluster), comma-separated.
*/}}
{{- define "modeguard.unservedZones" -}}
{{- $listed := list }}
{{- range .Values.zones }}{{ $listed = append $listed .name }}{{ end }}
{{- $missing := list }}
{{- $nodes := lookup "v1" "Node" "" "" }}
{{- range ($nodes.items | default list) }}
{{- $z := index (.metadata.labels | default dict) $.Values.zoneLabel | default "" }}
{{- if and $z (not (has $z $listed)) (not (has $z $missing)) }}{{ $missing = append $missing $z }}{{ end }}
{{- end }}
{{- join "," (sortAlpha $missing) }}
{{- end -}}

{{/* The nodes without a zone label, comma-separated (none without a cluster). */}}
{{- define "modeguard.zonelessNodes" -}}
{{- $out := list }}
{{- $nodes := lookup "v1" "Node" "" "" }}
{{- range ($nodes.items | default list) }}
{{- if not (index (.metadata.labels | default dict) $.Values.zoneLabel) }}{{ $out = append $out .metadata.name }}{{ end }}
{{- end }}
{{- join "," (sortAlpha $out) }}
{{- end -}}

{{/*
"true" where the csi-snapshot-metadata sidecar runs: snapshotMetadata.enabled
true; or auto, the snapshotter running and the cluster serving the
SnapshotMetadataService CRD (which the sidecar reads on every call).
*/}}
{{- define "modeguard.snapshotMetadata" -}}
{{- $e := toString .Values.snapshotMetadata.enabled }}
{{- $served := .Capabilities.APIVersions.Has "cbt.storage.k8s.io/v1alpha1/SnapshotMetadataService" }}
{{- if or (eq $e "true") (and (eq $e "auto") $served .Values.sidecars.snapshotter.enabled) }}true{{ end }}
{{- end -}}

{{/* "true" where the NFS target (templates/nfs-target.yaml) serves NFS. */}}
{{- define "modeguard.nfsTarget" -}}
{{- if and .Values.nfs.enabled (eq .Values.nfs.servedBy "target") }}true{{ end }}
{{- end -}}

{{/* "true" where the controller itself serves NFS from its node. */}}
{{- define "modeguard.nfsInController" -}}
{{- if and .Values.nfs.enabled (eq .Values.nfs.servedBy "controller") }}true{{ end }}
{{- end -}}

{{/* "true" where the controller reaches a storage target (iSCSI or NFS). */}}
{{- define "modeguard.targets" -}}
{{- if or .Values.iscsi.enabled (include "modeguard.nfsTarget" .) }}true{{ end }}
{{- end -}}

{{/* "true" where the controller runs more than one replica. */}}
{{- define "modeguard.peers" -}}
{{- if gt (int .Values.controller.replicas) 1 }}true{{ end }}
{{- end -}}

{{/* "true" where the controller speaks mutual TLS: to targets or peers. */}}
{{- define "modeguard.tls" -}}
{{- if or (include "modeguard.targets" .) (include "modeguard.peers" .) }}true{{ end }}
{{- end -}}

{{/* "true" where the controller mounts the block pools and /dev itself. */}}
{{- define "modeguard.controllerHostStorage" -}}
{{- if or (not .Values.iscsi.enabled) (include "modeguard.nfsInController" .) }}true{{ end }}
{{- end -}}

{{/*
The values the chart refuses, with what it accepts instead: two controllers
cannot serve NFS from their own nodes' disks, nor keep one fence list in
their own nodes' directories.
*/}}
{{- define "modeguard.checkController" -}}
{{- if and (include "modeguard.peers" .) (include "modeguard.nfsInController" .) }}
{{- fail (printf "controller.replicas=%v with nfs.servedBy=controller: one controller serves NFS from its node's disk, and a second would serve other data. Set nfs.servedBy=target (the NFS target keeps the data; the controllers keep nothing), or controller.replicas=1" .Values.controller.replicas) }}
{{- end }}
{{- if and (include "modeguard.peers" .) .Values.csiAddons.enabled (not (include "modeguard.targets" .)) }}
{{- fail (printf "controller.replicas=%v with csiAddons and no storage target: the fence list would be kept on each controller's own node. Serve NFS from its target (nfs.servedBy=target) or block volumes over iSCSI, which keep it, or set controller.replicas=1" .Values.controller.replicas) }}
{{- end }}
{{- end -}}

{{/*
A sidecar's election flags: none of it with one replica (as releases before
ran it); with more, a Lease in the release's namespace, on
controller.leaderElection's clock.
*/}}
{{- define "modeguard.leaderElection" -}}
{{- if include "modeguard.peers" . -}}
- --leader-election
- --leader-election-namespace=$(NAMESPACE)
- --leader-election-lease-duration={{ .Values.controller.leaderElection.leaseDuration }}
- --leader-election-renew-deadline={{ .Values.controller.leaderElection.renewDeadline }}
- --leader-election-retry-period={{ .Values.controller.leaderElection.retryPeriod }}
{{- else -}}
- --leader-election=false
{{- end }}
{{- end -}}

{{/*
A sidecar's --feature-gates: its own featureGates, and with more than one
replica ReleaseLeaderElectionOnExit, so that a stopped leader hands its
Lease over at once instead of letting it run out. Called with
(list $ $sidecar).
*/}}
{{- define "modeguard.sidecarFeatureGates" -}}
{{- $root := index . 0 }}
{{- $gates := list }}
{{- if include "modeguard.peers" $root }}{{ $gates = append $gates "ReleaseLeaderElectionOnExit=true" }}{{ end }}
{{- with (index . 1).featureGates }}{{ $gates = append $gates . }}{{ end }}
{{- join "," $gates }}
{{- end -}}
