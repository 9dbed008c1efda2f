{{- define "sapd.teacherScoresResources" -}}
{{- $v := .root.Values.teacherScores -}}
{{- $res := deepCopy $v.resources -}}
{{- $gpus := max (int $v.tensorParallelSize) (int $v.teacherTensorParallelSize) -}}
{{- if gt $gpus 1 -}}
{{- range $k := list "requests" "limits" -}}
{{- $_ := set (get $res $k | default dict) "nvidia.com/gpu" $gpus -}}
{{- end -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{- define "sapd.teacherScoresJob" -}}
{{- $workers := int .root.Values.teacherScores.parallelism }}
{{- $c := dict "root" .root "component" "teacher-scores" "job" .root.Values.teacherScores "round" .round "index" true "perIndex" true "hostSuffix" (add 1 (len (toString (sub $workers 1)))) }}
{{- $_ := set $c "resources" (include "sapd.teacherScoresResources" $c | fromYaml) }}
# Indexed Job: pod i of `workers` is teacher-scores worker i (JOB_COMPLETION_INDEX); a retried index
# redoes only its own uncommitted part; the last worker to finish commits the round.
apiVersion: batch/v1
kind: Job
metadata:
  {{- include "sapd.stageMeta" $c | nindent 2 }}
spec:
  completionMode: Indexed
  completions: {{ $workers }}
  parallelism: {{ $workers }}
  {{- include "sapd.batchFields" $c | trim | nindent 2 }}
  template:
    metadata:
      {{- include "sapd.podMeta" $c | nindent 6 }}
    spec:
      {{- include "sapd.podCommon" $c | nindent 6 }}
      containers:
        - name: teacher-scores
          {{- include "sapd.containerCommon" $c | nindent 10 }}
          args: {{ concat (list "python" "-m" "sapd.jobs.teacher_scores" "--config" "/etc/sapd/config.yaml" "--round" (toString .round)) (include "sapd.workerArgs" . | fromJsonArray) | toJson }}
          env:
            {{- include "sapd.env" $c | nindent 12 }}
{{- end -}}
