{{- define "kvasir.fullname" -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvasir.labels" -}}
app.kubernetes.io/name: kvasir-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvasir.selector" -}}
app.kubernetes.io/name: kvasir-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvasir.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvasir.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}
