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

{{- /*
Cluster-scoped objects (ClusterRoles and their bindings, the admission policy) carry the release's
namespace as well as its name: Helm tells releases apart by both, so two releases called
"weightlift" in two namespaces still get apart names. Every name stays below 253 characters
(namespace 63 + release 53 + suffixes).
*/ -}}
{{- define "weightlift.clusterName" -}}
{{- printf "%s-%s" .Release.Namespace (include "weightlift.fullname" .) -}}
{{- end -}}

{{- /* The workers' ServiceAccount, Role and RoleBinding (and NetworkPolicy) in each worker
namespace: per release, so two releases may share a worker namespace's name-space. The default
release name "weightlift" keeps the name "weightlift-worker" that manifests name. */ -}}
{{- define "weightlift.workerName" -}}
{{- printf "%s-worker" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- /* What this release's operator watches, as the annotation that other releases read:
namespaces, comma separated, or "*" for the whole cluster. */ -}}
{{- define "weightlift.watchScope" -}}
{{- if .Values.watchNamespaces }}{{ join "," .Values.watchNamespaces }}{{ else }}*{{ end -}}
{{- end -}}

{{- /*
Two operators watching one namespace would both reconcile its ModelDeployments. At install and
upgrade (not `helm template`: lookup sees no cluster there) the other releases' watch scopes are
read from their ClusterRoleBindings' weightlift.dev/watch-namespaces annotation, and an overlap
fails the release naming the namespace and the release that has it.
*/ -}}
{{- define "weightlift.refuseWatchOverlap" -}}
{{- $me := printf "%s/%s" .Release.Namespace .Release.Name -}}
{{- $mine := .Values.watchNamespaces | default list -}}
{{- $bindings := lookup "rbac.authorization.k8s.io/v1" "ClusterRoleBinding" "" "" | default dict -}}
{{- range ($bindings.items | default list) -}}
{{- $annotations := .metadata.annotations | default dict -}}
{{- $scope := index $annotations "weightlift.dev/watch-namespaces" | default "" -}}
{{- $owner := printf "%s/%s" (index $annotations "meta.helm.sh/release-namespace" | default "") (index $annotations "meta.helm.sh/release-name" | default "") -}}
{{- if and $scope (ne $owner $me) -}}
{{- $theirs := splitList "," $scope -}}
{{- if or (not $mine) (has "*" $theirs) -}}
{{- fail (printf "watchNamespaces: release %s watches %s and this release %s: two operators would reconcile the same ModelDeployments; give each release its own namespaces (none cluster-wide)" $owner (ternary "the whole cluster" $scope (eq $scope "*")) (ternary "the whole cluster" (join ", " $mine) (not $mine))) -}}
{{- end -}}
{{- range $mine -}}
{{- if has . $theirs -}}
{{- fail (printf "watchNamespaces: namespace %s is already watched by release %s: two operators would reconcile its ModelDeployments; give each release its own namespaces" . $owner) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
