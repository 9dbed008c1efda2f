{{/* Batch fields every Job spec carries: retries (or per-index retries), deadline, TTL, and a
     podFailurePolicy that fails the Job at once on exit code 2 (a config or input error, not worth a
     retry on a GPU node) and counts everything else (75 is sapd's "storage unreachable, retry").
     `.failJobCodes` overrides [2]; `.perIndex` uses backoffLimitPerIndex instead of backoffLimit.
     A preemption, eviction or drain (the pod's DisruptionTarget condition) is not the pod's fault: it is
     ignored (the pod is replaced, uncounted), except with `.gang` (a torchrun group, which cannot take one
     replaced rank): then it fails the Job through rule 0, and the driver (or JobSet) restarts the whole
     group without counting it. Rule 1 is always the exit-code rule: JobSet's rules tell them apart by index.
     `status: "True"` is written out: the API server defaults it, but the 1.31–1.34 schemas require it. */}}
{{- define "sapd.batchFields" -}}
{{- if .perIndex }}
backoffLimitPerIndex: {{ int .job.backoffLimitPerIndex }}
maxFailedIndexes: {{ int .job.maxFailedIndexes }}
{{- else }}
backoffLimit: {{ int .job.backoffLimit }}
{{- end }}
activeDeadlineSeconds: {{ int .job.activeDeadlineSeconds }}
ttlSecondsAfterFinished: {{ int .job.ttlSecondsAfterFinished }}
podReplacementPolicy: Failed
podFailurePolicy:
  rules:
    - action: {{ ternary "FailJob" "Ignore" (eq (toString .gang) "true") }}
      onPodConditions:
        - type: DisruptionTarget
          status: "True"
    - action: FailJob
      onExitCodes:
        containerName: {{ .container | default .component }}
        operator: In
        values: {{ toJson (.failJobCodes | default (list 2)) }}
{{- end -}}
