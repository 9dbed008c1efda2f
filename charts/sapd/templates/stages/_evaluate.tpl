{{/* The evaluation pod: benchmark-specific data and servers, device & co. from the run config; with
     `.round` (the evaluate-r<R> Job, not the CronJob's) exactly checkpoint R is evaluated. */}}
{{- define "sapd.evaluatePod" -}}
{{- $c := .c }}
{{- $e := .root.Values.evaluate }}
{{- $bench := include "sapd.benchmark" $c }}
{{- $args := list "python" "-m" "sapd.jobs.evaluate" "--config" "/etc/sapd/config.yaml" }}
{{- with .round }}{{ $args = concat $args (list "--checkpoint" (toString .)) }}{{ end }}
{{- range $e.args }}{{ $args = append $args (toString .) }}{{ end }}
{{- if eq $bench "alfworld" }}
{{- $_ := set $c "extraVolumes" (list (dict "name" "alfworld" "persistentVolumeClaim" (dict "claimName" (include "sapd.alfworldClaim" .root) "readOnly" true))) }}
{{- $_ := set $c "extraMounts" (list (dict "name" "alfworld" "mountPath" "/data/alfworld" "readOnly" true)) }}
{{- $args = concat $args (list "--data-dir" "/data/alfworld") }}
{{- else if eq $bench "webshop" }}
{{- $args = concat $args (list "--webshop-url" (required "evaluate.webshop.url is required for benchmark webshop: the URL of your WebShop server (docs/kubernetes/operate.md \"Evaluation\"; the chart deploys none)" $e.webshop.url)) }}
{{- $_ := set $c "webshop" true }}
{{- else if eq $bench "searchqa" }}
{{- $url := $e.searchqa.retrieverUrl | default (ternary (printf "http://%s:%d" (include "sapd.name" (dict "root" .root "component" "retriever")) (int $e.searchqa.retriever.port)) "" $e.searchqa.retriever.enabled) }}
{{- $args = concat $args (list "--rows" $e.searchqa.rows "--retriever-url" (required "evaluate.searchqa.retrieverUrl (or evaluate.searchqa.retriever.enabled) is required for benchmark searchqa" $url)) }}
{{- end }}
{{- include "sapd.podCommon" $c }}
containers:
  - name: evaluate
    {{- include "sapd.containerCommon" $c | nindent 4 }}
    args: {{ toJson $args }}
    env:
      {{- include "sapd.env" $c | nindent 6 }}
      {{- if eq $bench "alfworld" }}
      - name: ALFWORLD_DATA
        value: /data/alfworld
      {{- end }}
{{- end -}}

{{/* The claim holding ALFWorld's game files: the user's, or the one this release creates. */}}
{{- define "sapd.alfworldClaim" -}}
{{- .Values.evaluate.alfworld.claimName | default (include "sapd.name" (dict "root" . "component" "alfworld-data")) -}}
{{- end -}}

{{- define "sapd.evaluateContext" -}}
{{- $flavor := ternary "eval" .root.Values.image.flavor (eq .root.Values.image.flavor "gpu") }}
{{- toYaml (dict "component" "evaluate" "flavor" $flavor "shm" .root.Values.evaluate.shmSize) }}
{{- end -}}

{{- define "sapd.evaluateJob" -}}
{{- $c := merge (dict "root" .root "job" .root.Values.evaluate "round" .round) (include "sapd.evaluateContext" . | fromYaml) }}
apiVersion: batch/v1
kind: Job
metadata:
  {{- include "sapd.stageMeta" $c | nindent 2 }}
spec:
  {{- include "sapd.batchFields" $c | trim | nindent 2 }}
  template:
    metadata:
      {{- include "sapd.podMeta" $c | nindent 6 }}
    spec:
      {{- include "sapd.evaluatePod" (dict "root" .root "c" $c "round" .round) | nindent 6 }}
{{- end -}}
