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

{{/* The node plugin's socket directory on the host. */}}
{{- define "modeguard.pluginDir" -}}
{{ .Values.kubeletDir }}/plugins/{{ .Values.driverName }}
{{- end -}}
