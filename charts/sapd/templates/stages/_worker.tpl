{{/* The arguments of a worker that may serve several rounds (sapd/jobs/teacher_scores.py, sapd/jobs/train.py): the
     count the driver fills in, how often it checks a round's input, and how long it waits for one: one
     round of each pool (a scoring worker waits for the trainer's round and the slowest worker's; the
     trainer for the scoring round), past which it exits 75 and is retried. */}}
{{- define "sapd.workerArgs" -}}
{{- $v := .root.Values -}}
{{- $wait := add (int $v.teacherScores.activeDeadlineSeconds) (int $v.train.activeDeadlineSeconds) -}}
{{- toJson (list "--rounds" "__SAPD_ROUNDS__" "--poll-seconds" (toString $v.pipeline.inputPollSeconds) "--input-timeout-seconds" (toString $wait)) -}}
{{- end -}}
