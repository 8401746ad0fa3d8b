{{- define "weightlift.labels" -}}
app.kubernetes.io/name: weightlift
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "weightlift.fullname" -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "weightlift.workerNamespaces" -}}
{{- if .Values.workerNamespaces -}}
{{- toJson .Values.workerNamespaces -}}
{{- else if .Values.watchNamespaces -}}
{{- toJson .Values.watchNamespaces -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}

{{- define "weightlift.leaseName" -}}
{{- .Values.leaderElection.leaseName | default (include "weightlift.fullname" .) -}}
{{- end -}}
