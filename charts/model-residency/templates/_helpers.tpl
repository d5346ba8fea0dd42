{{- define "model-residency.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "model-residency.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "model-residency.labels" -}}
app.kubernetes.io/name: {{ include "model-residency.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "model-residency.selectorLabels" -}}
app.kubernetes.io/name: {{ include "model-residency.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "model-residency.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "model-residency.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "model-residency.routerName" -}}
{{- printf "%s-router" (include "model-residency.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "model-residency.routerSelectorLabels" -}}
app.kubernetes.io/name: {{ include "model-residency.name" . }}-router
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "model-residency.routerServiceAccountName" -}}
{{- if .Values.router.serviceAccount.create -}}
{{- default (include "model-residency.routerName" .) .Values.router.serviceAccount.name -}}
{{- else -}}
{{- required "router.serviceAccount.name is required when router.serviceAccount.create is false" .Values.router.serviceAccount.name -}}
{{- end -}}
{{- end -}}
