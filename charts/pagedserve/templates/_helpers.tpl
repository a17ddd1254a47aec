{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "pagedserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: the release name, plus the chart name unless the release name contains it. */}}
{{- define "pagedserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels of every object. Call with a dict: (dict "ctx" $ "component" "operator"). */}}
{{- define "pagedserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "pagedserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: pagedserve
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels: stable across upgrades. */}}
{{- define "pagedserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pagedserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pagedserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pagedserve.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) }}
{{- end }}

{{/* Relabelings shared by the ServiceMonitor and the PodMonitor: the dashboards and alerts group by
     `modeldeployment` (the ModelDeployment's name) and select engines by `component`. */}}
{{- define "pagedserve.monitorRelabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_instance]
  targetLabel: modeldeployment
- sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_component]
  targetLabel: component
- sourceLabels: [__meta_kubernetes_pod_name]
  targetLabel: pod
{{- end }}

{{- define "pagedserve.monitorNamespaceSelector" -}}
{{- if .Values.monitoring.namespaces }}
matchNames:
  {{- toYaml .Values.monitoring.namespaces | nindent 2 }}
{{- else }}
any: true
{{- end }}
{{- end }}
