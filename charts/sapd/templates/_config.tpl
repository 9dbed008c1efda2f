{{/* The run config a job reads: the shared `config`, the job's own over it, the chart's keys. */}}

{{/* The resolved overlay of one job: the shared `config`, the job's own `config` over it, and the
     values that the chart owns (run_root, workers; `.extra` for keys a job block sets). */}}
{{- define "sapd.jobConfig" -}}
{{- $cfg := mergeOverwrite (deepCopy .root.Values.config) (deepCopy (.job.config | default dict)) (deepCopy (.extra | default dict)) -}}
{{- $_ := set $cfg "run_root" .root.Values.runRoot -}}
{{- $_ := set $cfg "workers" (int .root.Values.teacherScores.parallelism) -}}
{{- include "sapd.yaml" $cfg -}}
{{- end -}}

{{/* A job's own config over the shared one, as JSON (for the lookups below). */}}
{{- define "sapd.ownConfig" -}}
{{- mergeOverwrite (deepCopy .root.Values.config) (deepCopy (.job.config | default dict)) | toJson -}}
{{- end -}}

{{/* The benchmark a job's config names (its own config over the shared one). */}}
{{- define "sapd.benchmark" -}}
{{- $cfg := include "sapd.ownConfig" . | fromJson -}}
{{- (($cfg.data | default dict).benchmark | default "alfworld") -}}
{{- end -}}

{{/* The training engine a job's config names (its own config over the shared one): torch or deepspeed. */}}
{{- define "sapd.trainEngine" -}}
{{- $cfg := include "sapd.ownConfig" . | fromJson -}}
{{- (($cfg.train | default dict).engine | default "torch") -}}
{{- end -}}

{{/* toYaml, except that a decimal number `--set` passed as a string (Helm's --set types only integers,
     so `--set config.train.lr=1e-6` is the string "1e-6", which toYaml quotes) is written unquoted: the
     run config holds numbers, and sapd reads YAML 1.2 (sapd/yamlio.py), where 1e-6, .5 and 1e-06 (Go's
     way of writing small floats) are all floats. Only values with a dot or an exponent are unquoted. */}}
{{- define "sapd.yaml" -}}
{{- $y := toYaml . -}}
{{- $y = regexReplaceAll "(?m)^(\\s*(?:- |[^\\s:#'\"][^:#'\"]*: +))[\"']([-+]?(?:\\.[0-9]+|[0-9]+\\.[0-9]*|[0-9]+(?:\\.[0-9]*)?[eE][-+]?[0-9]+)(?:[eE][-+]?[0-9]+)?)[\"']$" $y "${1}${2}" -}}
{{- $y -}}
{{- end -}}
