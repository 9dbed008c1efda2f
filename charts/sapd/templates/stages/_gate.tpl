{{/* mode manual: the gate of one stage of round `round` — the driver limited to that stage
     (python -m sapd.jobs.pipeline --stage S --round K). Its small pod waits until the stage's input is
     committed, then creates the stage Job from the pipeline-templates ConfigMap (so no GPU is held, and no
     deadline runs, while a stage waits), adopts it if it exists, and retries it like the driver does. */}}
{{- define "sapd.gateJob" -}}
{{- $templates := include "sapd.name" (dict "root" .root "component" "pipeline-templates") }}
{{- $vols := list (dict "name" "stage-templates" "configMap" (dict "name" $templates)) }}
{{- $mounts := list (dict "name" "stage-templates" "mountPath" "/etc/sapd-pipeline" "readOnly" true) }}
{{- $sa := include "sapd.name" (dict "root" .root "component" "pipeline") }}
{{- $c := dict "root" .root "component" (printf "gate-%s" .stage) "job" .root.Values.pipeline "round" .round "manual" true "extraVolumes" $vols "extraMounts" $mounts "serviceAccount" $sa "automount" true "failJobCodes" (list 1 2) "configKey" "pipeline" }}
{{- $args := list "python" "-m" "sapd.jobs.pipeline" "--config" "/etc/sapd/config.yaml" "--release" .root.Release.Name "--templates" "/etc/sapd-pipeline" "--owner" (printf "configmap/%s" $templates) "--retries" (toString (int .root.Values.pipeline.stageRetries)) "--poll-seconds" (toString (int .root.Values.manual.pollSeconds)) "--log-every-seconds" (toString .root.Values.pipeline.logEverySeconds) "--stage" .stage }}
{{- with .round }}{{ $args = concat $args (list "--round" (toString .)) }}{{ end }}
{{- if and (eq .stage "evaluate") (include "sapd.alfworldFillWanted" .root) }}
{{- $args = concat $args (list "--evaluate-after-job" (include "sapd.alfworldFillName" .root)) }}
{{- end }}
{{- if .root.Values.pipeline.forceTakeover }}{{ $args = append $args "--force-takeover" }}{{ end }}
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
      {{- include "sapd.podCommon" $c | nindent 6 }}
      containers:
        - name: {{ printf "gate-%s" .stage }}
          {{- include "sapd.containerCommon" $c | nindent 10 }}
          args: {{ toJson $args }}
          env:
            {{- include "sapd.env" $c | nindent 12 }}
{{- end -}}
