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
The node that keeps the NFS volumes' data, where the controller runs:
nfs.node; else the node an earlier release pinned the controller to (the
Deployment's modeguard.csi.dev/nfs-node annotation); else, at the first
install against a cluster, the first Ready node by name that the
controller's nodeSelector admits and that has no NoSchedule taint. Empty
when rendering without a cluster (helm template): the controller is then
not pinned, which NOTES.txt says.
*/}}
{{- define "modeguard.nfsNode" -}}
{{- if .Values.nfs.node }}
{{- .Values.nfs.node }}
{{- else }}
{{- $found := "" }}
{{- $d := lookup "apps/v1" "Deployment" .Release.Namespace "modeguard-controller" }}
{{- with $d }}{{ with .metadata.annotations }}{{ $found = index . "modeguard.csi.dev/nfs-node" | default "" }}{{ end }}{{ end }}
{{- if not $found }}
{{- $nodes := lookup "v1" "Node" "" "" }}
{{- $names := list }}
{{- range ($nodes.items | default list) }}
{{- $ok := true }}
{{- range $k, $v := $.Values.controller.nodeSelector }}{{ if ne (index $.Values.controller.nodeSelector $k | toString) ((index (.metadata.labels | default dict) $k) | default "" | toString) }}{{ $ok = false }}{{ end }}{{ end }}
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
